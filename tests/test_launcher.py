"""The launcher starts a fresh local Ray unless RAY_ADDRESS names a cluster to join."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import ray

from rollart.resource_manager import launcher

DRIVER = (
    "import json, ray\n"
    "from rollart.resource_manager.launcher import ensure_ray\n"
    "ensure_ray({'H800': 2, 'CPU': 1}, job_id='stale-test')\n"
    "print('RESULT ' + json.dumps(ray.cluster_resources().get('accelerator_type:H800')))\n"
    "ray.shutdown()\n"
)


def run_local_driver(code: str, **env_extra: str) -> object:
    """Run ``code`` in a fresh Python as a user's driver would start (no RAY_ADDRESS, none of Ray's
    single-machine switch the test set-up exports); the JSON of its last ``RESULT`` line."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=280,
        env=env | env_extra,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


LOOPBACK_DRIVER = """
import json, os, psutil, ray, subprocess, sys
from rollart.resource_manager.net import node_ip
from rollart.resource_manager.launcher import ensure_ray
ensure_ray({'H800': 1}, job_id='loopback-test')
ours = [p for p in psutil.Process().children() if p.name() in ('gcs_server', 'raylet')]
procs = ours + [c for p in ours for c in p.children(recursive=True)]
listening = sorted({(p.name(), c.laddr.ip) for p in procs for c in p.net_connections(kind='inet')
                    if c.status == psutil.CONN_LISTEN})
result = {
    'nodes': [n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']],
    'worker': ray.get(ray.remote(num_cpus=0)(node_ip).remote()),
    'started': sorted(p.name() for p in ours),
    'listening': listening,
}
# another driver on this machine (`rollart submit`, `rollart jobs`, a test's job) joins with RAY_ADDRESS
joined = subprocess.run(
    [sys.executable, '-c', 'import ray; ray.init(); print(ray.cluster_resources().get("accelerator_type:H800"))'],
    env={**os.environ, 'RAY_ADDRESS': ray.get_runtime_context().gcs_address},
    capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
)
result['second_driver'] = [joined.returncode, joined.stdout.strip(), joined.stderr[-1500:]]
print('RESULT ' + json.dumps(result))
ray.shutdown()
"""


@pytest.mark.timeout(300)
def test_the_local_ray_listens_on_loopback_only():
    """``rollart run`` on one machine: the local Ray (and every address rollart derives from its node IP:
    Mooncake segments, env and reward servers) is on 127.0.0.1, never on the machine's network address,
    even in a process that imported ray before rollart set Ray's single-machine switch. A second driver on
    the machine joins it with RAY_ADDRESS (what the local start leaves in the environment lets it in)."""
    r = run_local_driver(LOOPBACK_DRIVER)
    assert r["second_driver"][:2] == [0, "1.0"], r["second_driver"]
    assert r["nodes"] == ["127.0.0.1"] and r["worker"] == "127.0.0.1", r
    assert r["started"] == ["gcs_server", "raylet"], r
    assert r["listening"] and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip in r["listening"]), r


@pytest.mark.timeout(300)
def test_a_stale_ray_current_cluster_file_does_not_stop_a_local_start():
    # Ray's temp dir follows TMPDIR: a private one whose ray_current_cluster names a cluster that is gone
    tmp = tempfile.mkdtemp(prefix="rlst", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    try:
        os.makedirs(os.path.join(tmp, "ray"))
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:9")  # the discard port: no GCS there
        assert run_local_driver(DRIVER, TMPDIR=tmp) == 2.0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_joining_a_cluster_uses_token_auth_and_never_sets_the_single_host_flag(monkeypatch, tmp_path):
    token = tmp_path / "token"
    token.write_text("x" * 32)
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append((kw, dict(os.environ))))
    monkeypatch.setenv("RAY_ADDRESS", "10.201.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    # set, then unset: monkeypatch puts back only what it changed, and ensure_ray sets RAY_AUTH_MODE; left
    # in this process, a later local start (the session's Ray) would be refused by its own GCS
    for name in ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert launcher.ensure_ray({"H800": 2}, job_id="j") == "j"
    ((kw, env),) = calls
    assert kw["address"] == "10.201.0.1:6379" and "num_cpus" not in kw
    assert env["RAY_AUTH_MODE"] == "token"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env


def test_an_explicit_auth_mode_is_kept_when_joining(monkeypatch, tmp_path):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setenv("RAY_ADDRESS", "10.201.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    launcher.ensure_ray({}, job_id="j")
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


def test_the_local_start_is_explicit(monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "detect_gpus", lambda: launcher.DetectedGpus())  # a machine without GPUs
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    launcher.ensure_ray({"H20": 1, "CPU": 2}, job_id="j")
    (kw,) = calls
    assert kw["address"] == "local" and kw["num_gpus"] == 0
    assert kw["resources"] == {"accelerator_type:H20": 1.0, "rollart_logical:H20": 1.0}
