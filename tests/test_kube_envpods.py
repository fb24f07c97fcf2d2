"""The kubernetes env backend's pods against the API stand-in (rollart.testing.kube): the official client,
kubeconfig loading, watches and readiness run for real; pods are real processes in network namespaces
of their own, reached at their own IPs. Only the scheduler is stood in."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client, config, watch  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from rollart.envservice.kubernetes import (  # noqa: E402
    EnvPodError,
    EnvPodManager,
    KubeConnection,
    KubePodSpec,
    in_cluster_configuration,
    load_api,
)
from rollart.testing import hosts  # noqa: E402
from rollart.testing.kube import KubeStandIn  # noqa: E402

_reason = hosts.skip_reason()
pytestmark = pytest.mark.skipif(
    _reason is not None and "ray" not in _reason, reason=f"the kube stand-in needs namespaces: {_reason}"
)

# a tiny HTTP server: /healthz answers the pod's own name and IP (POD_NAME / POD_IP, as set by the kubelet)
TINY = (
    "import http.server, json, os, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = json.dumps({'pod': os.environ.get('POD_NAME'), 'ip': os.environ.get('POD_IP'),\n"
    "                           'path': self.path}).encode()\n"
    "        self.send_response(200 if self.path == '/healthz' else 404); self.end_headers(); self.wfile.write(body)\n"
    "    def log_message(self, *a): pass\n"
    "http.server.ThreadingHTTPServer(('0.0.0.0', int(sys.argv[1])), H).serve_forever()\n"
)
SERVER = "rollart/tiny-http:dev"
SLEEPER = "rollart/sleeper:dev"
CRASHER = "rollart/crasher:dev"
UNPULLABLE = "registry.invalid/rollart/nope:1"
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStandIn]:
    with KubeStandIn(crash_backoff_s=0.2, max_crash_backoff_s=1.0, grace_s=1.0) as k:
        k.add_image(SERVER, ["python", "-c", TINY], ["8000"])
        k.add_image(SLEEPER, ["python", "-c", "import time; time.sleep(3600)"])
        k.add_image(CRASHER, ["python", "-c", "import sys; print('env server: bad config'); sys.exit(3)"])
        k.add_unpullable(UNPULLABLE)
        k.kubeconfig = k.write_kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig")  # type: ignore[attr-defined]
        yield k
    assert not k.live_namespaces()  # every namespace (and so every link) of the run is gone


@pytest.fixture(scope="module")
def api(kube: KubeStandIn) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))  # type: ignore[attr-defined]


def pod_body(name: str, image: str, labels: dict[str, str], probe: bool = True) -> dict:
    c: dict = {"name": "main", "image": image}
    if probe:
        c["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": 8000}, "periodSeconds": 1}
    return {"metadata": {"name": name, "labels": labels}, "spec": {"containers": [c]}}


def test_standin_speaks_the_client_paths(kube: KubeStandIn, api: client.CoreV1Api) -> None:
    ns = "default"
    listed = api.list_namespaced_pod(ns, label_selector="t=paths")
    api.create_namespaced_pod(ns, pod_body("web", SERVER, {"t": "paths", "role": "web"}))
    api.create_namespaced_pod(ns, pod_body("idle", SLEEPER, {"t": "paths", "role": "idle"}, probe=False))
    with pytest.raises(ApiException) as dup:
        api.create_namespaced_pod(ns, pod_body("web", SERVER, {"t": "paths"}))
    assert dup.value.status == 409
    svc = api.create_namespaced_service(
        ns, {"metadata": {"name": "web", "labels": {"t": "paths"}}, "spec": {"ports": [{"port": 80}]}}
    )
    assert svc.spec.cluster_ip and api.read_namespaced_service("web", ns).metadata.labels == {"t": "paths"}
    # the watch from the list's resourceVersion sees every transition of both pods
    seen: dict[str, list[tuple[str, str, tuple]]] = {"web": [], "idle": []}
    ready: set[str] = set()
    w = watch.Watch()
    for ev in w.stream(
        api.list_namespaced_pod,
        ns,
        label_selector="t=paths",
        resource_version=listed.metadata.resource_version,
        timeout_seconds=60,
    ):
        p = ev["object"]
        conds = tuple((c.type, c.status) for c in p.status.conditions or [])
        seen[p.metadata.name].append((ev["type"], p.status.phase, conds))
        if ("Ready", "True") in conds:
            ready.add(p.metadata.name)
        if ready == {"web", "idle"}:
            w.stop()
    for name in ("web", "idle"):
        assert seen[name][0] == ("ADDED", "Pending", ())
        assert seen[name][-1] == (
            "MODIFIED",
            "Running",
            (("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", "True"), ("Ready", "True")),
        )
    # the probed pod is Running but not Ready until its server answers; the unprobed one is Ready at start
    assert any(ph == "Running" and ("Ready", "False") in c for _, ph, c in seen["web"])
    assert [p.metadata.name for p in api.list_namespaced_pod(ns, label_selector="t=paths,role=web").items] == ["web"]
    assert [p.metadata.name for p in api.list_namespaced_pod(ns, label_selector="t=paths,role!=web").items] == ["idle"]
    web = api.read_namespaced_pod("web", ns)
    assert web.status.container_statuses[0].state.running is not None
    ip = web.status.pod_ip
    assert ipaddress.ip_address(ip) in kube.subnet
    answer = json.loads(NO_PROXY.open(f"http://{ip}:8000/healthz", timeout=5).read())
    assert answer == {"pod": "web", "ip": ip, "path": "/healthz"}
    # processes run in network namespaces of their own
    pids = kube.pod_processes()
    assert pids["web"] and pids["idle"]
    assert os.readlink(f"/proc/{pids['web'][0]}/ns/net") != os.readlink("/proc/self/ns/net")
    # delete one, then the rest by label selector: DELETED events, 404 afterwards
    rv = api.list_namespaced_pod(ns, label_selector="t=paths").metadata.resource_version
    api.delete_namespaced_pod("web", ns)
    api.delete_collection_namespaced_pod(ns, label_selector="t=paths")
    api.delete_namespaced_service("web", ns)
    deleted = set()
    for ev in w.stream(api.list_namespaced_pod, ns, label_selector="t=paths", resource_version=rv, timeout_seconds=30):
        if ev["type"] == "DELETED":
            deleted.add(ev["object"].metadata.name)
        if deleted == {"web", "idle"}:
            w.stop()
    assert deleted == {"web", "idle"}
    with pytest.raises(ApiException) as gone:
        api.read_namespaced_pod("web", ns)
    assert gone.value.status == 404
    assert api.list_namespaced_service(ns).items == []
    assert kube.pod_processes() == {}


def test_standin_refuses_a_wrong_token(kube: KubeStandIn) -> None:
    cfg = client.Configuration(host=kube.url)
    cfg.api_key = {"authorization": "Bearer wrong"}
    with pytest.raises(ApiException) as err:
        client.CoreV1Api(client.ApiClient(cfg)).list_namespaced_pod("default")
    assert err.value.status == 401


def spec(image: str, **kw: object) -> KubePodSpec:
    base = {"image": image, "args": ["8000"], "port": 8000, "ready_timeout_s": 60, "retry_backoff_s": 0.1}
    return KubePodSpec(**{**base, **kw})  # type: ignore[arg-type]


def job_pods(api: client.CoreV1Api, job: str) -> list[str]:
    return [p.metadata.name for p in api.list_namespaced_pod("default", label_selector=f"rollart.io/job={job}").items]


def test_warm_pool_reached_by_pod_ip_healed_and_deleted(kube: KubeStandIn, api: client.CoreV1Api) -> None:
    conn = KubeConnection(kubeconfig=str(kube.kubeconfig))  # type: ignore[attr-defined]
    mgr = EnvPodManager(
        spec(
            SERVER,
            pool_size=2,
            labels={"team": "rl"},
            resources={"limits": {"cpu": "1"}},
            node_selector={"pool": "env"},
        ),
        "job-a",
        connection=conn,
    )
    assert mgr.namespace == "default"
    pods = mgr.start()
    assert len(pods) == 2 and len({p.ip for p in pods}) == 2
    for p in pods:
        assert json.loads(NO_PROXY.open(f"{p.url}/healthz", timeout=5).read())["pod"] == p.name
        obj = api.read_namespaced_pod(p.name, "default")
        assert obj.metadata.labels["rollart.io/job"] == "job-a" and obj.metadata.labels["team"] == "rl"
        assert obj.spec.node_selector == {"pool": "env"} and obj.spec.containers[0].resources.limits == {"cpu": "1"}
    # the warm pool: the least-used pod is handed out, the same pods serve episode after episode
    a, b = mgr.acquire(), mgr.acquire()
    assert {a.name, b.name} == {p.name for p in pods}
    mgr.release(a)
    assert mgr.acquire() is a
    # a pod that disappears is replaced
    api.delete_namespaced_pod(b.name, "default")  # terminating or gone: either way no longer usable
    assert mgr.heal() == [b.name]
    names = {p.name for p in mgr.pods}
    assert len(names) == 2 and b.name not in names and set(job_pods(api, "job-a")) == names
    mgr.close()
    assert job_pods(api, "job-a") == [] and kube.pod_processes() == {}


def test_never_ready_pod_times_out_naming_it(kube: KubeStandIn, api: client.CoreV1Api) -> None:
    mgr = EnvPodManager(spec(SLEEPER, ready_timeout_s=2, max_start_attempts=1), "job-b", api=api, namespace="default")
    with pytest.raises(EnvPodError) as err:
        mgr.start()
    msg = str(err.value)
    assert "not ready after 2 s" in msg and "rollart-env-job-b-" in msg and SLEEPER in msg and "GET /healthz" in msg
    assert job_pods(api, "job-b") == []  # the failed pod was deleted
    mgr.close()


def test_crash_loop_and_pull_backoff_reported_retried_then_fail(
    kube: KubeStandIn, api: client.CoreV1Api, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rollart.envservice.kubernetes")
    mgr = EnvPodManager(spec(CRASHER, crash_restarts=2, max_start_attempts=2), "job-c", api=api, namespace="default")
    with pytest.raises(EnvPodError) as err:
        mgr.start()
    msg = str(err.value)
    assert "failed 2 start attempt(s)" in msg and msg.count("CrashLoopBackOff") == 2 and msg.count(CRASHER) >= 3
    assert "restarted 2 times, last exit code 3" in msg and "env server: bad config" in msg
    warned = [r.getMessage() for r in caplog.records if "attempt 1/2 failed" in r.getMessage()]
    assert len(warned) == 1 and "CrashLoopBackOff" in warned[0]
    assert job_pods(api, "job-c") == []
    mgr.close()

    mgr = EnvPodManager(spec(UNPULLABLE, max_start_attempts=2), "job-d", api=api, namespace="default")
    with pytest.raises(EnvPodError) as err:
        mgr.start()
    msg = str(err.value)
    assert "failed 2 start attempt(s)" in msg and f"for image {UNPULLABLE}" in msg and "ErrImagePull" in msg
    assert job_pods(api, "job-d") == []
    mgr.close()


def test_pods_deleted_when_the_driver_exits_without_close(kube: KubeStandIn, api: client.CoreV1Api) -> None:
    code = (
        "import sys\n"
        "from rollart.envservice.kubernetes import EnvPodManager, KubeConnection, KubePodSpec\n"
        f"spec = KubePodSpec(image={SERVER!r}, args=['8000'], port=8000)\n"
        f"mgr = EnvPodManager(spec, 'job-e', connection=KubeConnection(kubeconfig={str(kube.kubeconfig)!r}))\n"  # type: ignore[attr-defined]
        "print(mgr.start()[0].name, flush=True)\n"
        "sys.exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("rollart-env-job-e-")
    assert job_pods(api, "job-e") == []


def test_in_cluster_and_kubeconfig_loading(tmp_path: Path, kube: KubeStandIn) -> None:
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    cfg = in_cluster_configuration(env, tmp_path)
    assert cfg.host == "https://10.0.0.1:443"
    assert cfg.auth_settings()["BearerToken"]["value"].lower() == "bearer sa-token"
    assert cfg.ssl_ca_cert == str(tmp_path / "ca.crt")
    with pytest.raises(Exception, match="Service host/port is not set"):
        in_cluster_configuration({}, tmp_path)
    with pytest.raises(EnvPodError, match="no kubeconfig at .*in_cluster: true"):
        load_api(KubeConnection(kubeconfig=str(tmp_path / "missing"), in_cluster=False))
    kc = kube.write_kubeconfig(tmp_path / "kc", namespace="envs")
    _, ns = load_api(KubeConnection(kubeconfig=str(kc)))
    assert ns == "envs"
    with pytest.raises(ValueError, match="rollart.io/job is set by rollart"):
        KubePodSpec(image="x", labels={"rollart.io/job": "j"})
    with pytest.raises(ValueError, match="unknown keys"):
        KubePodSpec(image="x", resources={"limit": {"cpu": "1"}})


def test_pods_run_restricted_behind_a_network_policy_with_the_token_in_a_secret(
    kube: KubeStandIn, api: client.CoreV1Api
) -> None:
    import base64

    from rollart.envservice.kubernetes import KubernetesServerPool

    pool = KubernetesServerPool("t", spec(SERVER, allow_from=["10.0.0.0/8"]), "job-g", api=api, namespace="default")
    pool.start()
    try:
        (pod,) = pool.manager.pods
        obj = api.read_namespaced_pod(pod.name, "default")
        psc, c = obj.spec.security_context, obj.spec.containers[0]
        assert (psc.run_as_non_root, psc.run_as_user, psc.seccomp_profile.type) == (True, 65534, "RuntimeDefault")
        csc = c.security_context
        assert (csc.allow_privilege_escalation, csc.privileged, csc.read_only_root_filesystem) == (False, False, True)
        assert csc.capabilities.drop == ["ALL"] and obj.spec.automount_service_account_token is False
        assert [m.mount_path for m in c.volume_mounts] == ["/tmp"]
        token = next(e for e in c.env if e.name == "ROLLART_ENV_TOKEN")
        assert token.value is None and token.value_from.secret_key_ref.name == pool.manager.object_name
        assert pool.token is not None and pool.token not in json.dumps(api.api_client.sanitize_for_serialization(obj))
        secret = api.read_namespaced_secret(pool.manager.object_name, "default")
        assert base64.b64decode(secret.data["token"]).decode() == pool.token
        net = client.NetworkingV1Api(api.api_client)
        (policy,) = net.list_namespaced_network_policy("default", label_selector="rollart.io/job=job-g").items
        assert policy.spec.pod_selector.match_labels == {
            "app.kubernetes.io/name": "rollart-env",
            "rollart.io/job": "job-g",
            "rollart.io/pool": pool.manager.object_name,  # this pool's pods: a job may have one per task
        }
        assert obj.metadata.labels["rollart.io/pool"] == pool.manager.object_name
        assert policy.spec.policy_types == ["Ingress", "Egress"] and not policy.spec.egress  # no egress at all
        (ingress,) = policy.spec.ingress
        assert [(p.protocol, p.port) for p in ingress.ports] == [("TCP", 8000)]
        assert [f.ip_block.cidr for f in ingress._from] == ["10.0.0.0/8"]
    finally:
        pool.stop()
    assert api.list_namespaced_secret("default", label_selector="rollart.io/job=job-g").items == []
    assert (
        client.NetworkingV1Api(api.api_client)
        .list_namespaced_network_policy("default", label_selector="rollart.io/job=job-g")
        .items
        == []
    )


ENV_SERVER = "rollart/env-server:dev"


async def test_code_sandbox_served_from_a_pod_over_the_session_protocol(
    kube: KubeStandIn, api: client.CoreV1Api
) -> None:
    from rollart.envs.code_sandbox import TASKS
    from rollart.envservice.client import RemoteEnv
    from rollart.envservice.kubernetes import create_pool
    from rollart.envservice.protocol import EnvOverrides

    kube.add_image(ENV_SERVER)  # no entrypoint: the backend's default command runs `rollart serve env NAME`
    kubecfg = str(kube.kubeconfig)  # type: ignore[attr-defined]
    entry = SimpleNamespace(servers=1, call_timeout_s=30.0, kubernetes={"image": ENV_SERVER, "port": 8200})
    entry.kubernetes["connection"] = {"kubeconfig": kubecfg}
    task = SimpleNamespace(index=0, name="code_sandbox", entry=entry, job_id="job f/1", label="envs[0]:code_sandbox")
    with pytest.raises(ValueError, match=r"envs\[0\]\.kubernetes: port: Input should be greater than or equal to 1"):
        create_pool(
            SimpleNamespace(**{**vars(task), "entry": SimpleNamespace(servers=1, kubernetes={"image": "x", "port": 0})})
        )
    pool = create_pool(task)  # started: its pods are ready
    try:
        (url,) = pool.urls
        assert ipaddress.ip_address(url.split("//")[1].split(":")[0]) in kube.subnet
        with pytest.raises(urllib.error.HTTPError) as refused:  # the pod's server answers its pool's token only
            NO_PROXY.open(urllib.request.Request(f"{url}/describe", data=b'{"env": "code_sandbox"}'), timeout=10)
        assert refused.value.code == 401
        env = RemoteEnv(pool, "code_sandbox", await pool.describe("code_sandbox", {}, EnvOverrides()))
        assert env.tag == "code_sandbox"
        obs, info = await env.reset(seed=1)
        assert "solution.py" in obs
        fixed = next(t.fixed for t in TASKS if t.name == info["task"])
        _, r_buggy, done, _, _ = await env.step("<run/>")
        assert r_buggy < 1 and not done
        _, r, done, _, _ = await env.step(f'<write file="solution.py">{fixed}</write><run/>')
        assert (r, done) == (1.0, True)
    finally:
        pool.stop()
    assert pool.urls == [] and job_pods(api, "job-f-1") == []


def test_agentic_pipeline_with_kubernetes_backend_envs_learns_as_with_local_envs(
    kube: KubeStandIn, api: client.CoreV1Api, tmp_path: Path
) -> None:
    kube.add_image(ENV_SERVER)
    script = Path(__file__).parent / "scripts" / "kube_pipeline_driver.py"
    args = [sys.executable, str(script), str(tmp_path / "run"), str(kube.kubeconfig), ENV_SERVER]  # type: ignore[attr-defined]
    done = subprocess.run(args, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT ") :])
    pools = {len(p["urls"]): p for p in out["pools"].values()}
    assert sorted(pools) == [1, 2]  # reverse in two env pods, FrozenLake in one
    for pool in pools.values():  # each reached at its own pod IP, every pod serving sessions
        assert all(ipaddress.ip_address(u.split("//")[1].split(":")[0]) in kube.subnet for u in pool["urls"])
        assert all(n > 0 for n in pool["sessions"].values())
    history = out["history"]
    assert [h["trajectories_failed"] for h in history] == [0] * 10
    assert all(set(h["reward_by_tag"]) == {"reverse-1", "FrozenLake"} for h in history)  # both tasks every step
    assert job_pods(api, "kube-e2e") == []  # the pipeline's shutdown deleted its pods
    # the reward rises as with local envs: a random policy scores ~0.05-0.1, a well-formed answer 0.5
    curve = [h["reward_by_tag"]["reverse-1"] for h in history]
    print("reward per step, kubernetes backend:", curve)
    assert sum(curve[-3:]) / 3 >= sum(curve[:3]) / 3 + 0.2 and sum(curve[-3:]) / 3 >= 0.35, curve
