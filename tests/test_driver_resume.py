"""``kill -9`` of a ``rollart run`` driver on a shared Ray cluster, then ``rollart run CONFIG --resume``.

The cluster (namespace hosts) outlives the driver: ``head`` 10.201.0.1 with H800 x1 (train), ``b``
10.201.0.2 with H20 x1 (rollout). The driver runs inside the head host.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 6

CONFIG = """\
name: resume
cluster: {{metadata_store: {store}}}
pools:
  train: {{hardware: H800, devices: 1}}
  rollout: {{hardware: H20, devices: 1}}
envs:
  - {{name: reverse, groups: 2, kwargs: {{length: 3}}}}
rollout: {{num_env_groups: 2, group_size: 2, batch_groups: 2, alpha: 0}}
sampling: {{temperature: 1.0, max_new_tokens: 3, seed: 0}}
engine: {{kind: torch}}
train: {{lr: 0.001}}
steps: {steps}
checkpoint_every: 1
output_dir: {out}
"""

STATE = """\
import json, time, ray
from ray.util.state import list_actors, list_placement_groups
ray.init()
job = {job!r}
deadline = time.monotonic() + 120
while True:
    actors = [a for a in list_actors(limit=10000) if a.ray_namespace == job]
    jobs = {{a.job_id for a in actors}}
    pgs = [p for p in list_placement_groups(limit=10000) if p.creator_job_id in jobs]
    total, avail = ray.cluster_resources(), ray.available_resources()
    hw = {{k: (avail.get(k, 0.0), v) for k, v in total.items() if k.startswith("accelerator_type:")}}
    done = all(a.state == "DEAD" for a in actors) and all(p.state == "REMOVED" for p in pgs) \\
        and all(a == t for a, t in hw.values())
    if done or time.monotonic() > deadline:
        break
    time.sleep(0.5)  # polling the cluster's state; the assertions are on the state
print("RESULT " + json.dumps({{
    "actors": sorted({{(a.class_name, a.state) for a in actors}}),
    "detached": [a.class_name for a in actors if a.is_detached],
    "pgs": sorted(p.state for p in pgs),
    "hw": hw,
}}))
"""


def _steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def _complete_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if (p / "meta.json").exists())


@pytest.fixture(scope="module")
def cluster():
    from rollart.testing import HostSpec, skip_reason, start_hosts

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    specs = [HostSpec("head", {"H800": 1}, num_cpus=2), HostSpec("b", {"H20": 1}, num_cpus=2)]
    with start_hosts(specs, dashboard=True) as c:  # the state API is served by the dashboard
        yield c


def test_kill_9_of_the_driver_frees_the_cluster_and_resume_continues_from_the_checkpoint(cluster, tmp_path):
    out, store = tmp_path / "run", tmp_path / "meta.sqlite"
    config = tmp_path / "resume.yaml"
    config.write_text(CONFIG.format(store=json.dumps(str(store)), steps=STEPS, out=json.dumps(str(out))))
    metrics, ckpt = out / "metrics.jsonl", out / "checkpoint"

    log1 = (tmp_path / "driver1.log").open("w")
    driver = cluster.popen(
        "head", [sys.executable, "-m", "rollart.cli", "run", str(config)], stdout=log1, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 150
        while not (len(_steps(metrics)) >= 2 and _complete_checkpoints(ckpt)):
            if driver.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"no 2 steps + a checkpoint (rc={driver.poll()}):\n" + (tmp_path / "driver1.log").read_text()
                )
            time.sleep(0.2)  # polling files the driver writes
        # `ip netns exec` execs: the Popen pid is the driver's python itself
        assert Path(f"/proc/{driver.pid}/cmdline").read_bytes().split(b"\0")[1:4] == [b"-m", b"rollart.cli", b"run"]
        driver.send_signal(signal.SIGKILL)
        assert driver.wait(timeout=30) == -signal.SIGKILL
    finally:
        if driver.poll() is None:
            driver.kill()
        log1.close()
    done_before = _steps(metrics)
    job = (out / "job_id").read_text().strip()

    state = cluster.run_python(STATE.format(job=job), timeout=180).check().result
    assert state["actors"], state  # the job had actors in its namespace, and every one is dead
    assert all(s == "DEAD" for _, s in state["actors"]), state
    assert state["pgs"] and all(s == "REMOVED" for s in state["pgs"]), state  # the pools' groups
    assert state["detached"] == [], state
    assert state["hw"] and all(a == t for a, t in state["hw"].values()), state

    from rollart.training.checkpoint_io import latest_checkpoint

    latest = latest_checkpoint(ckpt)  # step-N: the checkpoint taken after step N (steps count from 1)
    assert latest is not None and latest.is_dir()
    resumed = cluster.run_driver(["-m", "rollart.cli", "run", str(config), "--resume"], timeout=240).check()
    start = int(latest.name.removeprefix("step-"))
    # the resumed attempt trains from the step after the checkpoint (nothing before it again) to the end
    assert f"after step {start} " in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    # one record per step: what the killed driver logged past its checkpoint was dropped and redone
    assert _steps(metrics) == list(range(1, STEPS + 1)), (done_before, start, _steps(metrics))

    status = cluster.run_driver(["-m", "rollart.cli", "status", "--local", "--store", str(store), "--json"]).check()
    runs = json.loads(status.stdout)["runs"]
    assert [(r["attempt"], r["status"]) for r in runs if r["job_id"] == job] == [(1, "driver_lost"), (2, "finished")]


def test_a_resume_drops_the_metrics_a_killed_driver_logged_past_its_checkpoint(tmp_path):
    from rollart.pipeline.records import MetricsFile

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "reward_mean": 0.1 * s}) + "\n" for s in range(1, 5)))
    MetricsFile(tmp_path).drop_from(2)
    assert _steps(metrics) == [1, 2]
    (tmp_path / "empty").mkdir()
    MetricsFile(tmp_path / "empty").drop_from(2)
    assert not (tmp_path / "empty" / "metrics.jsonl").exists()
