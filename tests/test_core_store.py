"""The metadata store outlives the driver: a restarted driver and `rollart status` read it back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.resource_manager import MetadataStore

SCRIPT = Path(__file__).parent / "scripts" / "driver_records_state.py"


def run_driver(store: Path, job: str) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(store), job],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def status(store: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "rollart.cli", "status", "--store", str(store), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.timeout(600)
def test_store_is_read_back_after_the_driver_restarts(tmp_path):
    store = tmp_path / "meta.sqlite"
    first = run_driver(store, "job-a")

    state = status(store)
    (job,) = state["jobs"]
    assert job["job_id"] == "job-a" and job["driver_pid"] == first["pid"] and job["driver_alive"] is False
    pools = sorted((p["pool"], p["group_index"], p["hardware"], p["devices"]) for p in state["pools"])
    assert pools == [("rollout", 0, "H800", 1), ("rollout", 1, "H20", 2)]
    bindings = sorted(
        (b["cluster"], b["rank"], b["hardware"], b["node_id"], tuple(b["slot_ids"]), tuple(b["device_ids"]))
        for b in state["bindings"]
    )
    assert bindings == sorted(
        ("gen", p["rank"], p["hardware"], p["node_id"], tuple(p["slot_ids"]), tuple(p["device_ids"]))
        for p in first["placement"]
    )
    (endpoint,) = state["endpoints"]
    assert (endpoint["cluster"], endpoint["method"], endpoint["url"], endpoint["retries"]) == (
        "reward",
        "compute_rewards",
        "http://127.0.0.1:9/rewards/math",
        2,
    )

    second = run_driver(store, "job-a")  # the restarted driver of the same job
    db = MetadataStore(store)
    assert [j["driver_pid"] for j in db.jobs("job-a")] == [second["pid"]]
    assert len(db.pools("job-a")) == 2 and len(db.bindings("job-a")) == 3
    assert db.jobs("job-b") == []
