"""The ``kubernetes`` env backend's pods: env servers as pods, reached by pod IP (RollArt paper §2.2, §3.1).

:class:`EnvPodManager` keeps a warm pool of env-server pods for one job, built from a
:class:`KubePodSpec` (image, command, args, port, resources, node selector, labels):

* every pod carries the labels ``app.kubernetes.io/name=rollart-env``, ``rollart.io/job=<job id>``,
  ``rollart.io/pool=<its manager's name>`` and ``rollart.io/pod=<its name>``, plus the spec's own;
* a pod is ready when Kubernetes says so: its ``readinessProbe`` (``httpGet`` of ``readiness_path`` on
  ``port``, ``/healthz`` of the env server) passes and the ``Ready`` condition turns ``True``. The
  manager *watches* the pod until then, at most ``ready_timeout_s``; it is then reached at
  ``http://<podIP>:<port>``;
* a pod whose image cannot be pulled (``ErrImagePull``/``ImagePullBackOff``/``InvalidImageName``),
  whose container keeps crashing (``CrashLoopBackOff`` with ``restartCount >= crash_restarts``), that
  ends (``Failed``/``Succeeded``) or that is not ready in time is reported (a warning naming the pod,
  the reason, the image and, for a crash, the exit code and the end of its log), deleted, and a new pod
  is started after an exponential backoff with jitter (``retry_backoff_s`` · 2^attempt), up to
  ``max_start_attempts``; then :class:`EnvPodError` says what happened to each attempt;
* the pool is reused across episodes (:meth:`EnvPodManager.acquire` hands out the least-used ready pod,
  :meth:`EnvPodManager.release` gives it back); a pod found gone or unready is replaced
  (:meth:`EnvPodManager.heal`);
* :meth:`EnvPodManager.close` deletes every pod of the job by label selector and waits until they are
  gone, then the job's Secret and NetworkPolicy; it also runs at interpreter exit. A driver killed with
  SIGKILL leaves them behind: delete them with
  ``kubectl delete pods,secrets,networkpolicies -l rollart.io/job=<job id>``.

Security: every pod runs with a restrictive ``securityContext`` (non-root uid 65534, no privilege
escalation, every capability dropped, a read-only root file system with an ``emptyDir`` at ``/tmp``,
the runtime's default seccomp profile) and without a service-account token
(``automountServiceAccountToken: false``); ``security_context`` / ``container_security_context``
replace the defaults. A NetworkPolicy (``network_policy: true``, the default) selects the pool's pods:
ingress only to the server's port (from ``allow_from`` CIDRs, default any source), no egress at all
(``egress_to`` CIDRs open some). The pool's bearer token is a Secret of the pool (labelled with the
job), handed to the container as ``$ROLLART_ENV_TOKEN`` (``secretKeyRef``); the default command
serves with ``--token-env ROLLART_ENV_TOKEN``. A cluster whose network plugin does not enforce
NetworkPolicies (check yours) is protected by the token alone.

Configuration: :func:`load_api` uses a kubeconfig (``kubeconfig`` path, or ``$KUBECONFIG`` /
``~/.kube/config``, optional ``context``) or, inside a cluster (``KUBERNETES_SERVICE_HOST`` set, or
``in_cluster: true``), the pod's service account (token and CA under
``/var/run/secrets/kubernetes.io/serviceaccount/``; its ``namespace`` file is the default namespace).
"""

from __future__ import annotations

import base64
import logging
import os
import random
import re
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollart.cluster.serverless import RetryPolicy
from rollart.envs.base import EnvError
from rollart.envservice.client import DEFAULT_RETRY, ServerPool

# the client's models are used as plain objects here (their fields are all Optional in its annotations)
V1Pod = Any
CoreV1Api = Any

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
JOB_LABEL = "rollart.io/job"
POD_LABEL = "rollart.io/pod"
POOL_LABEL = "rollart.io/pool"  # the pods of one manager (a job may have several: one per task)
APP_LABEL = "app.kubernetes.io/name"
TOKEN_ENV = "ROLLART_ENV_TOKEN"  # the container's variable holding the pool's bearer token
RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 65534,
    "runAsGroup": 65534,
    "fsGroup": 65534,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONFIG_ERRORS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class EnvPodError(EnvError):
    """An env pod could not be started or became unusable; the message names the pod, reason and image."""

    def __init__(self, message: str, *, pod: str = "", reason: str = "", image: str = "") -> None:
        super().__init__(message)
        self.pod, self.reason, self.image = pod, reason, image


class KubeConnection(BaseModel):
    """How to reach the Kubernetes API: a kubeconfig, or the in-cluster service account."""

    model_config = ConfigDict(extra="forbid")

    kubeconfig: str | None = Field(default=None, description="kubeconfig path (default: $KUBECONFIG or ~/.kube/config)")
    context: str | None = None
    in_cluster: bool | None = Field(
        default=None, description="use the pod's service account; default: when KUBERNETES_SERVICE_HOST is set"
    )
    namespace: str | None = Field(default=None, description="default: the kubeconfig context's, in-cluster the pod's")


class KubePodSpec(BaseModel):
    """An env-server pod as written in a config (``envs: [{backend: kubernetes, kubernetes: {...}}]``)."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1)
    command: list[str] | None = None
    args: list[str] | None = None
    port: int = Field(default=8000, ge=1, le=65535)
    env: dict[str, str] = Field(default_factory=dict)
    resources: dict[str, dict[str, str]] = Field(
        default_factory=dict, description='e.g. {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {...}}'
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    pool_size: int = Field(default=1, ge=1)
    readiness_path: str = "/healthz"
    probe_period_s: int = Field(default=1, ge=1)
    ready_timeout_s: float = Field(default=120.0, gt=0)
    crash_restarts: int = Field(default=2, ge=1, description="restarts after which a crash loop is an error")
    max_start_attempts: int = Field(default=3, ge=1)
    retry_backoff_s: float = Field(default=2.0, ge=0)
    image_pull_policy: str | None = None
    security_context: dict[str, Any] | None = Field(
        default=None, description="the pod's securityContext (default: non-root 65534, RuntimeDefault seccomp)"
    )
    container_security_context: dict[str, Any] | None = Field(
        default=None, description="the container's (default: no privilege escalation, no capabilities, read-only root)"
    )
    runtime_class_name: str | None = Field(default=None, description="e.g. gvisor: a sandboxing container runtime")
    tmp_size: str = Field(default="256Mi", description="size limit of the emptyDir mounted at /tmp")
    network_policy: bool = Field(default=True, description="a NetworkPolicy: ingress to the port only, no egress")
    allow_from: list[str] = Field(default_factory=list, description="CIDRs that may reach the port (default: any)")
    egress_to: list[str] = Field(default_factory=list, description="CIDRs the pods may reach (default: none)")

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        bad = sorted(set(v) - {"requests", "limits"})
        if bad:
            raise ValueError(
                f"resources: unknown keys {bad}; use requests and limits, e.g. {{'limits': {{'cpu': '1'}}}}"
            )
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if k in (JOB_LABEL, POD_LABEL, POOL_LABEL):
                raise ValueError(f"labels: {k} is set by rollart (the job id / pod name / pool); remove it")
            if len(val) > 63 or not _LABEL_VALUE.match(val):
                raise ValueError(f"labels: {k}={val!r} is not a valid label value (<= 63 of [A-Za-z0-9-_.])")
        return v


def in_cluster_configuration(
    environ: dict[str, str] | None = None, account_dir: str | os.PathLike = SERVICE_ACCOUNT_DIR
) -> Any:
    """A client ``Configuration`` from the in-cluster service account (``KUBERNETES_SERVICE_HOST`` /
    ``_PORT`` and the token and CA files under ``account_dir``)."""
    from kubernetes import client
    from kubernetes.config.incluster_config import InClusterConfigLoader

    cfg = client.Configuration()
    d = Path(account_dir)
    InClusterConfigLoader(
        token_filename=str(d / "token"),
        cert_filename=str(d / "ca.crt"),
        environ=dict(os.environ if environ is None else environ),
    ).load_and_set(cfg)
    return cfg


def load_api(conn: KubeConnection | None = None) -> tuple[CoreV1Api, str]:
    """``(CoreV1Api, namespace)`` for ``conn`` (see the module docstring)."""
    from kubernetes import client, config

    conn = conn or KubeConnection()
    in_cluster = conn.in_cluster
    if in_cluster is None:
        in_cluster = conn.kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ
    if in_cluster:
        api = client.CoreV1Api(client.ApiClient(in_cluster_configuration()))
        ns_file = Path(SERVICE_ACCOUNT_DIR) / "namespace"
        namespace = conn.namespace or (ns_file.read_text().strip() if ns_file.exists() else "default")
        return api, namespace
    path = conn.kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or "~/.kube/config"
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise EnvPodError(
            f"kubernetes: no kubeconfig at {path}; set envs[].kubernetes.connection.kubeconfig (or $KUBECONFIG), "
            "or run inside the cluster (in_cluster: true)"
        )
    api_client = config.new_client_from_config(config_file=path, context=conn.context)
    namespace = conn.namespace or ""
    if not namespace:
        _, active = config.list_kube_config_contexts(config_file=path)
        if conn.context:
            active = next(
                (c for c in config.list_kube_config_contexts(config_file=path)[0] if c["name"] == conn.context), active
            )
        namespace = (active or {}).get("context", {}).get("namespace") or "default"
    return client.CoreV1Api(api_client), namespace


@dataclass
class EnvPod:
    """A ready env pod: its name, IP and the env server's URL."""

    name: str
    ip: str
    port: int
    in_use: int = 0
    attempts: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


def _ready(pod: V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


class EnvPodManager:
    """A warm pool of env-server pods for one job (see the module docstring)."""

    def __init__(
        self,
        spec: KubePodSpec,
        job_id: str,
        *,
        api: CoreV1Api | None = None,
        namespace: str | None = None,
        connection: KubeConnection | None = None,
        token: str | None = None,
    ) -> None:
        if not job_id or len(job_id) > 40 or not _LABEL_VALUE.match(job_id):
            raise ValueError(f"job_id {job_id!r}: use 1-40 of [A-Za-z0-9-_.] (it is a label value and a name part)")
        self.spec = spec
        self.job_id = job_id
        self.token = token
        base = re.sub(r"[^a-z0-9-]", "-", job_id.lower()).strip("-")[:30] or "job"
        # this pool's Secret and NetworkPolicy (and the value of its pods' pool label)
        self.object_name = f"rollart-env-{base}-{secrets.token_hex(3)}"
        self._guarded = False
        if api is None:
            api, default_ns = load_api(connection)
            namespace = namespace or default_ns
        self.api = api
        self.namespace = namespace or "default"
        self.selector = f"{JOB_LABEL}={job_id}"
        self.pods: list[EnvPod] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._finalizer = weakref.finalize(self, _delete_job_pods, api, self.namespace, self.selector)

    # --- pod objects ---------------------------------------------------------------------------------------
    def pod_manifest(self, name: str) -> dict[str, Any]:
        s = self.spec
        container: dict[str, Any] = {
            "name": "env",
            "image": s.image,
            "ports": [{"name": "http", "containerPort": s.port}],
            "env": [{"name": k, "value": v} for k, v in s.env.items()],
            "readinessProbe": {
                "httpGet": {"path": s.readiness_path, "port": s.port},
                "periodSeconds": s.probe_period_s,
                "timeoutSeconds": 1,
                "failureThreshold": 3,
            },
        }
        if s.command is not None:
            container["command"] = s.command
        if s.args is not None:
            container["args"] = s.args
        if s.resources:
            container["resources"] = s.resources
        if s.image_pull_policy:
            container["imagePullPolicy"] = s.image_pull_policy
        if self.token is not None:
            ref = {"secretKeyRef": {"name": self.object_name, "key": "token"}}
            container["env"].append({"name": TOKEN_ENV, "valueFrom": ref})
        container["securityContext"] = s.container_security_context or RESTRICTED_CONTAINER
        container["volumeMounts"] = [{"name": "tmp", "mountPath": "/tmp"}]
        spec: dict[str, Any] = {
            "restartPolicy": "Always",
            "containers": [container],
            "automountServiceAccountToken": False,
            "securityContext": s.security_context or RESTRICTED_POD,
            "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": s.tmp_size}}],
        }
        if s.runtime_class_name:
            spec["runtimeClassName"] = s.runtime_class_name
        if s.node_selector:
            spec["nodeSelector"] = s.node_selector
        labels = {**s.labels, **self.pool_labels(), POD_LABEL: name}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}

    def pool_labels(self) -> dict[str, str]:
        return {APP_LABEL: "rollart-env", JOB_LABEL: self.job_id, POOL_LABEL: self.object_name}

    def secret_manifest(self) -> dict[str, Any]:
        """The job's Secret holding the pool's bearer token."""
        assert self.token is not None
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": self.object_name, "labels": self.pool_labels()},
            "type": "Opaque",
            "data": {"token": base64.b64encode(self.token.encode()).decode()},
        }

    def network_policy_manifest(self) -> dict[str, Any]:
        """Ingress to the job's pods on the server's port only (from ``allow_from``), egress to
        ``egress_to`` only (none by default)."""
        s = self.spec
        ingress: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": s.port}]}
        if s.allow_from:
            ingress["from"] = [{"ipBlock": {"cidr": c}} for c in s.allow_from]
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": self.object_name, "labels": self.pool_labels()},
            "spec": {
                "podSelector": {"matchLabels": self.pool_labels()},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [ingress],
                "egress": [{"to": [{"ipBlock": {"cidr": c}} for c in s.egress_to]}] if s.egress_to else [],
            },
        }

    def _guard(self) -> None:
        """Create the job's Secret (the token) and NetworkPolicy once, before its first pod."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        with self._lock:
            if self._guarded:
                return
            try:
                if self.token is not None:
                    self.api.create_namespaced_secret(self.namespace, self.secret_manifest())
                if self.spec.network_policy:
                    net: Any = client.NetworkingV1Api(self.api.api_client)
                    net.create_namespaced_network_policy(self.namespace, self.network_policy_manifest())
            except ApiException as err:
                raise EnvPodError(
                    f"env pods of job {self.job_id}: cannot create its Secret/NetworkPolicy {self.object_name} "
                    f"({err.status} {err.reason}); the driver's account needs create on secrets and "
                    "networkpolicies, or set network_policy: false"
                ) from None
            self._guarded = True

    def _new_name(self) -> str:
        base = re.sub(r"[^a-z0-9-]", "-", self.job_id.lower()).strip("-")[:30] or "job"
        return f"rollart-env-{base}-{secrets.token_hex(3)}"

    # --- starting --------------------------------------------------------------------------------------------
    def start(self) -> list[EnvPod]:
        """Bring the pool up to ``pool_size`` ready pods (started concurrently); raise :class:`EnvPodError`
        when a slot fails ``max_start_attempts`` times."""
        self._guard()
        missing = self.spec.pool_size - len(self.pods)
        results: list[EnvPod | BaseException] = []
        threads = [threading.Thread(target=lambda: results.append(self._start_one_safe())) for _ in range(missing)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [r for r in results if isinstance(r, BaseException)]
        with self._lock:
            self.pods += [r for r in results if isinstance(r, EnvPod)]
        if errors:
            raise errors[0]
        return list(self.pods)

    def _start_one_safe(self) -> EnvPod | BaseException:
        try:
            return self.start_pod()
        except BaseException as err:  # returned to start(), which raises it in the caller's thread
            return err

    def start_pod(self) -> EnvPod:
        """Start one pod and wait until it is ready; retried as the module docstring says."""
        s = self.spec
        history: list[str] = []
        for attempt in range(s.max_start_attempts):
            if self._closing.is_set():
                raise EnvPodError(f"env pods of job {self.job_id}: the manager is closed")
            name = self._new_name()
            try:
                self.api.create_namespaced_pod(self.namespace, self.pod_manifest(name))
                ip = self.wait_ready(name)
                return EnvPod(name, ip, s.port, attempts=history)
            except EnvPodError as err:
                history.append(str(err))
                log.warning("env pod attempt %d/%d failed: %s", attempt + 1, s.max_start_attempts, err)
                self._delete(name)
                if attempt + 1 < s.max_start_attempts:
                    delay = s.retry_backoff_s * 2**attempt * random.uniform(0.5, 1.0)
                    if self._closing.wait(delay):
                        break
        tried = "\n  ".join(history)
        raise EnvPodError(
            f"env pod of job {self.job_id} (image {s.image}) failed {len(history)} start attempt(s):\n  {tried}",
            image=s.image,
            reason="StartFailed",
        )

    def wait_ready(self, name: str) -> str:
        """Watch pod ``name`` until it is Ready (its IP) or fails; raise :class:`EnvPodError` naming it."""
        from kubernetes import watch

        s = self.spec
        deadline = time.monotonic() + s.ready_timeout_s
        last: V1Pod | None = None
        w = watch.Watch()
        while not self._closing.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for ev in w.stream(
                self.api.list_namespaced_pod,
                self.namespace,
                label_selector=f"{POD_LABEL}={name}",
                timeout_seconds=max(1, int(left + 0.999)),
            ):
                pod = ev["object"]
                if ev["type"] == "DELETED":
                    raise EnvPodError(f"env pod {name} was deleted while starting", pod=name, image=s.image)
                last = pod
                self._check_failed(pod)
                if _ready(pod) and pod.status.pod_ip:
                    w.stop()
                    log.info("env pod %s ready at %s:%d", name, pod.status.pod_ip, s.port)
                    return str(pod.status.pod_ip)
                if time.monotonic() > deadline or self._closing.is_set():
                    w.stop()
                    break
        phase = last.status.phase if last is not None else "not seen"
        raise EnvPodError(
            f"env pod {name} (image {s.image}) not ready after {s.ready_timeout_s:g} s: phase {phase}, "
            f"{self._describe(last)}; its readinessProbe is GET {s.readiness_path} on port {s.port}",
            pod=name,
            reason="ReadyTimeout",
            image=s.image,
        )

    def _describe(self, pod: V1Pod | None) -> str:
        if pod is None or not pod.status.container_statuses:
            return "no container status"
        cs = pod.status.container_statuses[0]
        state = cs.state
        now = (
            f"waiting ({state.waiting.reason})"
            if state and state.waiting
            else "running"
            if state and state.running
            else "terminated"
        )
        return f"container {now}, ready={cs.ready}, restarts={cs.restart_count}"

    def _check_failed(self, pod: V1Pod) -> None:
        s, name = self.spec, pod.metadata.name
        if pod.status.phase in ("Failed", "Succeeded"):
            raise EnvPodError(
                f"env pod {name} (image {s.image}) ended with phase {pod.status.phase}: {self._describe(pod)}"
                f"{self._log_tail(name)}",
                pod=name,
                reason=pod.status.phase,
                image=s.image,
            )
        for cs in pod.status.container_statuses or []:
            waiting = cs.state.waiting if cs.state else None
            reason = waiting.reason if waiting else None
            message = (waiting.message if waiting else None) or ""
            if reason in IMAGE_ERRORS:
                raise EnvPodError(
                    f"env pod {name}: {reason} for image {cs.image}: {message} (check the image name "
                    "and the cluster's access to its registry)",
                    pod=name,
                    reason=str(reason),
                    image=cs.image,
                )
            if reason in CONFIG_ERRORS:
                raise EnvPodError(
                    f"env pod {name}: {reason} for image {cs.image}: {message}",
                    pod=name,
                    reason=str(reason),
                    image=cs.image,
                )
            if reason == "CrashLoopBackOff" and cs.restart_count >= s.crash_restarts:
                term = cs.last_state.terminated if cs.last_state else None
                code = f"exit code {term.exit_code}" if term else "exit code unknown"
                raise EnvPodError(
                    f"env pod {name}: CrashLoopBackOff, image {cs.image}, container restarted {cs.restart_count} "
                    f"times, last {code}{self._log_tail(name)}",
                    pod=name,
                    reason="CrashLoopBackOff",
                    image=cs.image,
                )

    def _log_tail(self, name: str, lines: int = 5) -> str:
        try:
            text = self.api.read_namespaced_pod_log(name, self.namespace, tail_lines=lines)
        except Exception:  # the log is a courtesy: the error is raised anyway
            return ""
        tail = "\n    ".join(str(text).strip().splitlines()[-lines:])
        return f"; last log lines:\n    {tail}" if tail else ""

    def _delete(self, name: str, timeout_s: float = 30.0) -> None:
        """Delete pod ``name`` and wait until it is gone (a failed pod holds no quota afterwards)."""
        _delete_job_pods(self.api, self.namespace, f"{POD_LABEL}={name}", timeout_s)

    # --- the warm pool ----------------------------------------------------------------------------------------
    def acquire(self) -> EnvPod:
        """The least-used ready pod of the pool (starting the pool first if it is empty)."""
        if not self.pods:
            self.start()
        with self._lock:
            pod = min(self.pods, key=lambda p: p.in_use)
            pod.in_use += 1
            return pod

    def release(self, pod: EnvPod) -> None:
        with self._lock:
            pod.in_use = max(0, pod.in_use - 1)

    def heal(self) -> list[str]:
        """Replace pool pods that are gone or no longer ready; return the names replaced."""
        listed = {
            p.metadata.name: p for p in self.api.list_namespaced_pod(self.namespace, label_selector=self.selector).items
        }
        gone = []
        for pod in list(self.pods):
            obj = listed.get(pod.name)
            if obj is None or obj.metadata.deletion_timestamp is not None or not _ready(obj):
                gone.append(pod.name)
                with self._lock:
                    self.pods.remove(pod)
                self._delete(pod.name)
        if gone:
            log.warning("env pods %s are gone or unready: replacing them", gone)
            self.start()
        return gone

    # --- the end ---------------------------------------------------------------------------------------------
    def close(self, timeout_s: float = 60.0) -> None:
        """Delete every pod of the job (label selector) and wait until none is listed. Idempotent."""
        self._closing.set()
        self._finalizer.detach()
        self.pods = []
        _delete_job_pods(self.api, self.namespace, self.selector, timeout_s)

    def __enter__(self) -> EnvPodManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _delete_job_pods(api: CoreV1Api, namespace: str, selector: str, timeout_s: float = 30.0) -> None:
    """Delete the pods matching ``selector`` and watch until none is left (at most ``timeout_s``); then the
    Secrets and NetworkPolicies of a job's selector."""
    try:
        _delete_pods(api, namespace, selector, timeout_s)
    finally:
        if selector.startswith(f"{JOB_LABEL}="):
            _delete_guards(api, namespace, selector)


def _delete_guards(api: CoreV1Api, namespace: str, selector: str) -> None:
    from kubernetes import client

    try:
        api.delete_collection_namespaced_secret(namespace, label_selector=selector)
        client.NetworkingV1Api(api.api_client).delete_collection_namespaced_network_policy(
            namespace, label_selector=selector
        )
    except Exception as err:  # at exit: the API may be gone; say what to clean up by hand
        log.warning(
            "could not delete the Secret/NetworkPolicy of %s: %s; run `kubectl delete secrets,networkpolicies -l %s`",
            selector,
            err,
            selector,
        )


def _delete_pods(api: CoreV1Api, namespace: str, selector: str, timeout_s: float) -> None:
    from kubernetes import watch

    try:
        api.delete_collection_namespaced_pod(namespace, label_selector=selector, grace_period_seconds=0)
        listed = api.list_namespaced_pod(namespace, label_selector=selector)
        left = {p.metadata.name for p in listed.items}
        if not left:
            return
        w = watch.Watch()
        for ev in w.stream(
            api.list_namespaced_pod,
            namespace,
            label_selector=selector,
            resource_version=listed.metadata.resource_version,
            timeout_seconds=max(1, int(timeout_s)),
        ):
            if ev["type"] == "DELETED":
                left.discard(ev["object"].metadata.name)
            if not left:
                w.stop()
        if left:
            log.warning("env pods %s of %s still listed %g s after delete", sorted(left), selector, timeout_s)
    except Exception as err:  # at exit: the API may be gone; say what to clean up by hand
        log.warning("could not delete env pods (%s): %s; run `kubectl delete pods -l %s`", selector, err, selector)


class KubernetesServerPool(ServerPool):
    """The ``kubernetes`` backend's :class:`~rollart.envservice.client.ServerPool`: the env servers of one
    task are the warm pods of an :class:`EnvPodManager`; sessions are spread over their pod IPs."""

    def __init__(
        self,
        name: str,
        spec: KubePodSpec,
        job_id: str,
        *,
        api: CoreV1Api | None = None,
        namespace: str | None = None,
        connection: KubeConnection | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        super().__init__(name, retry=retry, token=secrets.token_urlsafe(32))
        self.manager = EnvPodManager(
            spec, job_id, api=api, namespace=namespace, connection=connection, token=self.token
        )

    def _sync(self) -> None:
        want = {p.url for p in self.manager.pods}
        for url in self.urls:
            if url not in want:
                self.remove(url)
        for url in sorted(want):
            self.add(url)

    def start(self) -> None:
        self.manager.start()
        self._sync()

    def heal(self) -> list[str]:
        """Replace the pods that are gone, unready or whose server was marked down; the names replaced."""
        replaced = []
        for pod in list(self.manager.pods):
            if pod.url in self.down:
                self.manager.pods.remove(pod)
                self.manager._delete(pod.name)
                replaced.append(pod.name)
        replaced += self.manager.heal()
        if len(self.manager.pods) < self.manager.spec.pool_size:
            self.manager.start()
        self._sync()
        return replaced

    def stop(self) -> None:
        self.manager.close()
        self._sync()


def create_pool(task: Any) -> KubernetesServerPool:
    """The ``kubernetes`` backend of ``envs:`` entries (looked up by :mod:`rollart.envservice.backends`):
    ``task.entry.kubernetes`` is a :class:`KubePodSpec` mapping plus an optional ``connection``
    (:class:`KubeConnection`); ``task.entry.servers`` pods are started (and waited for) before it returns.
    Without ``command``/``args`` a pod runs ``rollart serve env NAME --host 0.0.0.0 --port PORT --token-env
    ROLLART_ENV_TOKEN`` (the pod's own network namespace; the NetworkPolicy and the token guard it)."""
    from pydantic import ValidationError

    field_name = f"envs[{task.index}].kubernetes"
    raw = dict(getattr(task.entry, "kubernetes", None) or {})
    if "pool_size" in raw:
        raise ValueError(f"{field_name}.pool_size: the number of pods is envs[{task.index}].servers; set that instead")
    try:
        conn = KubeConnection.model_validate(raw.pop("connection", None) or {})
        spec = KubePodSpec.model_validate({**raw, "pool_size": getattr(task.entry, "servers", 1)})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise ValueError(f"{field_name}: {problems}") from None
    if spec.command is None and spec.args is None:
        timeout = getattr(task.entry, "call_timeout_s", None)
        args = [task.name, "--host", "0.0.0.0", "--port", str(spec.port), "--token-env", TOKEN_ENV]
        if timeout is not None:
            args += ["--call-timeout-s", str(timeout)]
        spec = spec.model_copy(update={"command": ["rollart", "serve", "env"], "args": args})
    job = re.sub(r"[^A-Za-z0-9_.-]", "-", str(task.job_id))[:40].strip("-_.") or "job"
    pool = KubernetesServerPool(task.label if hasattr(task, "label") else task.name, spec, job, connection=conn)
    pool.start()
    return pool
