"""Jobs sharing one cluster: ``rollart submit/jobs/logs/stop``, the admission queue and quotas.

The cluster (namespace hosts, dashboard on): ``head`` 10.201.0.1 with H800 x2, ``b`` 10.201.0.2 with
H20 x2. Each job asks one H800 (train) and one H20 (rollout): two fit, the third waits. All three score
their trajectories on one reward service (``rollart serve rewards`` on the head host), each as its own
tenant (the job id).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollart.resource_manager.admission import Admission, admissible, check_quota, parse_quota, queue_order
from rollart.resource_manager.specs import ResourceSpecError

CONFIG = """\
# one H800 trainer, one H20 rollout worker, a tiny model: runs until stopped (or --set steps=N)
name: shared
pools:
  train: {hardware: H800, devices: 1}
  rollout: {hardware: H20, devices: 1}
envs:
  - {name: reverse, groups: 2, kwargs: {length: 3}}
rollout: {num_env_groups: 2, group_size: 2, batch_groups: 2, alpha: 0}
sampling: {temperature: 1.0, max_new_tokens: 3, seed: 0}
engine: {kind: torch}
reward: {url: "http://10.201.0.1:8100/rewards/reverse", retries: 3}
train: {lr: 0.001}
steps: 100000
checkpoint_every: 0
output_dir: runs/{name}
"""


def _row(job, state, asks, priority=0, at=0.0):
    return {"job_id": job, "state": state, "asks": asks, "priority": priority, "submitted_at": at}


def test_queue_admits_by_priority_then_arrival_and_never_overtakes():
    totals = {"H800": 2.0, "H20": 2.0}
    rows = [
        _row("run", "running", {"H800": 1, "H20": 1}),
        _row("late-high", "queued", {"H800": 1}, priority=5, at=3.0),
        _row("early", "queued", {"H800": 1, "H20": 1}, at=1.0),
        _row("later", "queued", {"H20": 1}, at=2.0),
        _row("gone", "failed", {"H800": 2, "H20": 2}),
    ]
    assert [r["job_id"] for r in queue_order(rows)] == ["late-high", "early", "later"]
    # late-high takes the last H800; early does not fit, so later (which would) waits behind it
    assert admissible(rows, totals) == ["late-high"]
    assert admissible([_row("a", "queued", {"H800": 1}), _row("b", "queued", {"H800": 1}, at=1)], totals) == ["a", "b"]


def test_quota_errors_name_the_pools_and_the_flag():
    assert parse_quota("H800=2, H20=4") == {"H800": 2.0, "H20": 4.0}
    with pytest.raises(ValueError, match="HARDWARE=COUNT"):
        parse_quota("H800")
    with pytest.raises(ResourceSpecError, match=r"pools \['train', 'rollout'\] ask for 3 H800.*--quota H800=N"):
        check_quota({"H800": 3.0}, {"H800": ["train", "rollout"]}, {"H800": 2.0})
    check_quota({"H800": 2.0, "H20": 9.0}, {}, {"H800": 2.0})  # no quota for H20: no limit
    env = Admission(quota={"H800": 1.0}, priority=3, submitted_at=12.5).env()
    assert Admission.from_env(env) == Admission(quota={"H800": 1.0}, priority=3, submitted_at=12.5)
    assert Admission.from_env({}) is None


def test_submit_refuses_a_config_over_its_quota_before_reaching_the_cluster(tmp_path, caplog):
    from rollart.cli import main

    config = tmp_path / "shared.yaml"
    config.write_text(CONFIG)
    # the address leads nowhere: the quota check fails first, on this machine
    assert main(["submit", str(config), "--quota", "H800=0", "--address", "http://127.0.0.1:9"]) == 2
    assert "pools ['train'] ask for 1 H800 but the job's quota is 0" in caplog.text
    assert main(["submit", str(config), "--quota", "H800"]) == 2
    assert "--quota 'H800': write HARDWARE=COUNT" in caplog.text


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from rollart.testing import HostSpec, skip_reason, start_hosts

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("job")
    (folder / "shared.yaml").write_text(CONFIG)
    specs = [HostSpec("head", {"H800": 2}, num_cpus=2), HostSpec("b", {"H20": 2}, num_cpus=2)]
    with start_hosts(specs, dashboard=True) as cluster:
        # the shared reward service, on the head host's own address (a port of that host's namespace)
        log = (folder / "rewards.log").open("w")
        server = cluster.popen(
            "head",
            [sys.executable, "-m", "rollart.cli", "serve", "rewards", "rollart.envs.rewards:reverse"]
            + ["--host", "10.201.0.1", "--port", "8100"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        cluster.run_python(
            "import time, httpx\n"
            "deadline = time.monotonic() + 120\n"
            "while True:\n"
            "    try:\n"
            "        httpx.get('http://10.201.0.1:8100/healthz', timeout=2).raise_for_status(); break\n"
            "    except httpx.HTTPError:\n"
            "        if time.monotonic() > deadline: raise\n"
            "        time.sleep(0.5)\n"
        ).check()
        try:
            yield cluster, folder / "shared.yaml"
        finally:
            server.terminate()
            server.wait(timeout=30)
            log.close()


def _cli(cluster, *args, check=True):
    res = cluster.run_driver(["-m", "rollart.cli", *args], timeout=240)
    return res.check() if check else res


def _jobs(cluster):
    return {r["job"]: r for r in json.loads(_cli(cluster, "jobs", "--json").stdout.strip().splitlines()[-1])}


def _wait(cluster, what, done, timeout_s=300.0):
    """Poll ``rollart jobs`` until ``done(jobs)``; fail with the last listing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = _jobs(cluster)
        if done(jobs):
            return jobs
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached within {timeout_s:.0f}s; rollart jobs says {jobs}")
        time.sleep(1.0)  # polling a remote state; the assertion is on the state, not the time


def _states(jobs):
    return sorted(r["state"] for r in jobs.values())


def _wait_for_a_step(metrics: Path, timeout_s: float = 300) -> None:
    """Until the job's ``metrics.jsonl`` has a step (polling the file; the assertion is on its content)."""
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, f"{metrics.parent.name} trained no step within {timeout_s:.0f} s"
        time.sleep(1.0)


def test_three_jobs_two_run_the_third_waits_until_one_ends_quotas_hold_and_stop_frees(shared):
    cluster, config = shared
    names = ["shared-a", "shared-b", "shared-c"]
    procs = [
        cluster.popen(
            "head",
            [sys.executable, "-m", "rollart.cli", "submit", str(config), "--name", n, "--quota", "H800=1,H20=1"]
            + ["--python", sys.executable, "--set", f"output_dir={config.parent / 'out' / n}"]
            + (["--set", "steps=3"] if n == "shared-c" else []),  # c ends by itself, a and b run until stopped
            stdout=-1,
            stderr=-1,
            text=True,
        )
        for n in names
    ]
    for p in procs:  # all three submitted at once
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    jobs = _wait(cluster, "two running, one queued", lambda j: _states(j) == ["queued", "running", "running"])
    (waiter,) = [n for n in names if jobs[n]["state"] == "queued"]
    running = [n for n in names if n != waiter]
    assert all(jobs[n]["quota"] == {"H800": 1.0, "H20": 1.0} for n in names)
    assert "queued at position 1" in _cli(cluster, "logs", waiter).stdout

    # every actor of each running job sits on a host of its hardware, within the job's quota
    deadline = time.monotonic() + 300  # a loaded machine takes minutes to start a trainer
    while True:
        state = json.loads(_cli(cluster, "status", "--json").stdout)
        bound = {job: [b for b in state["bindings"] if b["job_id"] == job] for job in running}  # c may be done
        if all(len(rows) >= 2 for rows in bound.values()) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for job, rows in bound.items():
        devices: dict[str, set] = {}  # colocated workers share their owner's devices
        for b in rows:
            devices.setdefault(b["hardware"], set()).add((b["node_id"], tuple(b["slot_ids"])))
            assert b["node_ip"] == {"H800": "10.201.0.1", "H20": "10.201.0.2"}[b["hardware"]], b
        assert {hw: len(d) for hw, d in devices.items()} == {"H800": 1, "H20": 1}, (job, rows)

    # one job ends (c finishes its 3 steps, or, if c is the waiter, a running job is stopped): the waiter
    # is admitted after that
    ended = "shared-c" if waiter != "shared-c" else running[0]
    if ended != "shared-c":  # stopped once it has trained a step, as the others below: it has scored rewards
        _wait_for_a_step(config.parent / "out" / ended / "metrics.jsonl")
        _cli(cluster, "stop", ended)
    # admitted: running, or already finished (shared-c's 3 steps can end between two polls of a loaded machine)
    jobs = _wait(
        cluster,
        f"{waiter} admitted after {ended} ended",
        lambda j: j[waiter]["admitted_at"] is not None and j[waiter]["state"] in ("running", "finished"),
    )
    assert jobs[ended]["state"] == ("finished" if ended == "shared-c" else "stopped")
    assert jobs[waiter]["admitted_at"] >= jobs[ended]["ended_at"]
    jobs = _wait(cluster, "shared-c finished", lambda j: j["shared-c"]["state"] == "finished")
    long_running = sorted(n for n in names if jobs[n]["state"] == "running")
    assert long_running == [n for n in ("shared-a", "shared-b") if n != ended]

    # each long-running job has trained a step (so it has scored rewards) before it is stopped
    for n in long_running:
        _wait_for_a_step(config.parent / "out" / n / "metrics.jsonl")
    stops = [
        cluster.popen("head", [sys.executable, "-m", "rollart.cli", "stop", job], stdout=-1, stderr=-1, text=True)
        for job in long_running
    ]
    for p in stops:
        assert p.wait(timeout=240) == 0, p.stderr.read()[-3000:]
    states = {n: r["state"] for n, r in _jobs(cluster).items()}
    assert states == {"shared-a": "stopped", "shared-b": "stopped", "shared-c": "finished"}
    free = cluster.run_python(
        "import json, time, ray\nray.init()\n"
        "from rollart.resource_manager.capacity import read_capacity\n"
        "deadline = time.monotonic() + 60\n"
        "while True:\n"
        "    cap = {hw: (c.available, c.total) for hw, c in read_capacity().items() if hw != 'CPU'}\n"
        "    if all(a == t for a, t in cap.values()) or time.monotonic() > deadline: break\n"
        "    time.sleep(0.5)\n"
        "print('RESULT ' + json.dumps(cap))\n"
    )
    assert free.check().result == {"H800": [2.0, 2.0], "H20": [2.0, 2.0]}

    # one reward service served the three jobs: its per-tenant count equals what each job sent, all of it
    # (a stopped run ends as with Ctrl-C: its rewards in flight are answered and counted in ledger.json)
    metrics = (
        cluster.run_python(
            "import json, httpx\n"
            "print('RESULT ' + json.dumps(httpx.get('http://10.201.0.1:8100/metrics', timeout=10).text))\n"
        )
        .check()
        .result
    )
    served = {
        m["tenant"]: float(m["n"])
        for m in re.finditer(
            r'rollart_reward_trajectories_total\{function="reverse",tenant="(?P<tenant>[^"]+)"\} (?P<n>\S+)', metrics
        )
    }
    for n in names:  # a job that wrote no ledger: its driver's own account of how it ended
        assert (config.parent / "out" / n / "ledger.json").is_file(), _cli(cluster, "logs", n).stdout[-4000:]
    sent = {n: json.loads((config.parent / "out" / n / "ledger.json").read_text())["reward_service"] for n in names}
    assert {n: c["tenant"] for n, c in sent.items()} == {n: n for n in names}
    assert all(c["trajectories"] > 0 and c["failed"] == 0 for c in sent.values()), sent
    assert served == {n: float(c["trajectories"]) for n, c in sent.items()}, (served, sent)


def test_a_submitted_job_with_a_relative_output_dir_keeps_its_outputs_where_jobs_and_logs_say(shared, tmp_path):
    """The config's own `output_dir: runs/{name}` (relative): Ray runs the job in a temporary copy of the
    config's folder, so the driver puts the run under the jobs folder of its host (`--jobs-dir`, else
    $ROLLART_JOBS_DIR or ~/rollart-jobs) and records it; `rollart jobs` and `rollart logs` show it."""
    cluster, config = shared
    jobs_dir = tmp_path / "jobs"
    res = cluster.run_driver(
        ["-m", "rollart.cli", "submit", str(config), "--name", "rel-out", "--python", sys.executable]
        + ["--jobs-dir", str(jobs_dir), "--set", "steps=2", "--set", "checkpoint_every=1"],
        timeout=240,
    ).check()
    assert f"its outputs: {jobs_dir}/rel-out/runs/shared on the driver's host" in res.stderr
    jobs = _wait(cluster, "rel-out finished", lambda j: j.get("rel-out", {}).get("state") in ("finished", "failed"))
    run = jobs_dir / "rel-out" / "runs" / "shared"
    logs = _cli(cluster, "logs", "rel-out")
    assert jobs["rel-out"]["state"] == "finished", logs.stdout[-4000:]
    assert jobs["rel-out"]["output_dir"] == str(run) and jobs["rel-out"]["driver_ip"] == "10.201.0.1"
    assert f"outputs in 10.201.0.1:{run}" in logs.stderr
    assert f"output folder: {run}" in logs.stdout  # the driver's own log says it too
    # the run's files outlive the job (Ray removed its working-directory copy)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert (run / "checkpoint" / "step-00000002" / "model.safetensors").is_file() and (run / "ledger.json").is_file()
    table = cluster.run_driver(["-m", "rollart.cli", "jobs"], env={"COLUMNS": "400"}, timeout=240).check().stdout
    [row] = [line for line in table.splitlines() if "rel-out" in line]
    assert f"10.201.0.1:{run}" in row and "finished" in row
