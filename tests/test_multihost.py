"""rollart on a three-host Ray cluster built from network namespaces (rollart.testing.hosts).

Hosts (the ``hosts3`` fixture): head 10.201.0.1 (H800 x2), b 10.201.0.2 (H800 x2), c 10.201.0.3 (H20 x2).
Every driver runs inside a host with ``RAY_ADDRESS`` naming the head; no test uses 127.0.0.1 across hosts.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).parent / "scripts" / "multihost_driver.py")
H800_HOSTS = {"10.201.0.1", "10.201.0.2"}
H20_HOST = "10.201.0.3"

pytestmark = pytest.mark.timeout(600)


def test_workers_sit_on_the_hosts_of_their_hardware(hosts3, tmp_path):
    out = hosts3.run_driver([SCRIPT, "placement", str(tmp_path / "meta.sqlite"), "mh-placement"]).check().result
    train, rollout = out["train"], out["rollout"]
    assert [w["hardware"] for w in train] == ["H800", "H800"]
    assert {w["node_ip"] for w in train} <= H800_HOSTS and len({w["node_ip"] for w in train}) == 1  # one PACKed group
    assert [w["hardware"] for w in rollout] == ["H800", "H800", "H20", "H20"]
    for w in rollout:
        assert (w["node_ip"] == H20_HOST) if w["hardware"] == "H20" else (w["node_ip"] in H800_HOSTS), w
    # what each worker itself reports agrees with what the Cluster recorded
    assert out["train_seen"] == [w["node_ip"] for w in train]
    assert out["rollout_seen"] == [w["node_ip"] for w in rollout]

    # the cluster-wide registry: `rollart status` on host b (not where the driver ran) lists the job
    status = hosts3.run_driver(["-m", "rollart.cli", "status", "--json", "--job", "mh-placement"], host="b").check()
    state = json.loads(status.stdout)
    assert state["cluster"] == hosts3.address
    (job,) = state["jobs"]
    assert (job["job_id"], job["driver_ip"]) == ("mh-placement", "10.201.0.1") and job["ended_at"] is not None
    assert sorted((p["pool"], p["group_index"], p["hardware"]) for p in state["pools"]) == [
        ("rollout", 0, "H800"),
        ("rollout", 1, "H20"),
        ("train", 0, "H800"),
    ]
    recorded = {(b["cluster"], b["rank"]): b["node_ip"] for b in state["bindings"]}
    assert recorded == {
        **{("train_probe", w["rank"]): w["node_ip"] for w in train},
        **{("rollout_probe", w["rank"]): w["node_ip"] for w in rollout},
    }


def test_two_ddp_ranks_on_two_hosts_take_the_step_of_one_rank_on_the_whole_batch(hosts3, tmp_path):
    from rollart.models import build_tiny

    model = str(build_tiny(tmp_path / "tiny", hidden_size=32, num_layers=1, intermediate_size=64, seed=1))
    out = hosts3.run_driver([SCRIPT, "ddp", str(tmp_path / "meta.sqlite"), model]).check().result
    assert out["backends"] == ["gloo", "gloo"]
    ip0, ip1 = out["ips"]
    assert ip0 in H800_HOSTS and ip1 == H20_HOST  # rank 0 on head or b, rank 1 on c
    assert out["ifnames"] == ["eth0", "eth0"]  # the interface carrying each host's IP, not lo
    assert out["rows"] == [4.0, 3.0]
    s0, s1 = out["dp_sums"]
    assert s0 == pytest.approx(s1, rel=1e-6)
    assert s0 == pytest.approx(out["one_sum"], rel=1e-5)


def test_killing_a_host_surfaces_as_an_error_naming_the_host_the_cluster_and_the_rank(hosts3, tmp_path):
    driver = hosts3.popen(
        "head",
        [hosts3_python(), SCRIPT, "kill", str(tmp_path / "meta.sqlite")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("READY "), line + driver.stderr.read()[-4000:]
        ready = json.loads(line[len("READY ") :])
        assert ready["seen"] == [H20_HOST]
        assert hosts3.kill_host("c")  # every process of host c: its raylet, the probe actor
        driver.stdin.write("go\n")
        driver.stdin.flush()
        stdout, stderr = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        hosts3.restart_host("c")  # the module's later tests get all three hosts back
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert driver.returncode == 0 and lines, stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    assert res["type"] == "WorkerDiedError"
    assert (res["node_ip"], res["rank"], res["cluster"]) == (H20_HOST, 0, "probe_c")
    assert f"probe_c[rank 0] on H20 died (host {H20_HOST}, Ray cluster {hosts3.address})" in res["error"]
    assert res["ray_cluster"] == hosts3.address and hosts3.address in res["error"]


def hosts3_python() -> str:
    import sys

    return sys.executable
