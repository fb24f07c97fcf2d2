"""Start-up: a run records its start-up phases (``RUN_DIR/startup.json``) in order and complete, its
clusters start together, a concurrent start that fails (a worker that cannot start, a pool that cannot
be placed) leaves nothing running and names what failed; ``rollart bench startup``'s command, argument
checks and result (fast, on recorded runs; no timing asserted)."""

import argparse
import json
import os
import shlex
import subprocess
import sys

import psutil
import pytest
import ray
from test_pipeline import small_config

import rollart as ra
from rollart.cluster import start_together
from rollart.pipeline.startup import FILE, MARKS, PHASES, StartupTimeline, phases_of
from rollart.pipelines.agentic import AgenticPipeline
from rollart.resource_manager import manager as manager_mod
from rollart.resource_manager.specs import ResourceSpecError

pytestmark = pytest.mark.timeout(600)


def test_a_run_records_its_startup_phases_in_order_and_complete(ray_local, tmp_path):
    cfg = small_config(tmp_path, steps=2, checkpoint_every=0)
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        pipe.run()
    finally:
        pipe.shutdown()
    data = json.loads((tmp_path / "run" / FILE).read_text())
    marks = [data["marks_s"][m] for m in MARKS]
    assert None not in marks and marks == sorted(marks) and marks[0] == 0.0
    assert list(data["phases_s"]) == list(PHASES) and all(s >= 0 for s in data["phases_s"].values())
    assert sum(data["phases_s"].values()) == pytest.approx(data["time_to_first_step_s"], abs=1e-3)
    assert data["time_to_first_step_s"] == pytest.approx(marks[-1], abs=1e-3)
    # every worker of both clusters, each in the order of its own start
    assert {n: len(ws) for n, ws in data["workers"].items()} == {"actor_infer": 1, "actor_train": 1}
    for ws in data["workers"].values():
        for w in ws:
            assert (
                w["requested"]
                <= w["init_began"]
                <= w["init_done"]
                <= w["answered"]
                <= data["marks_s"]["clusters_ready"]
            )
    # the clusters start together: the trainer is asked for before the inference worker has answered
    assert data["workers"]["actor_train"][0]["requested"] < data["workers"]["actor_infer"][0]["answered"]


class Answers(ra.Worker):
    def __init__(self) -> None:
        pass

    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        import os

        return os.getpid()


class FailsToStart(ra.Worker):
    def __init__(self) -> None:
        raise ValueError("no such model: /nonexistent")


def test_clusters_started_together_all_stop_when_one_fails_to_start(make_rm):
    rm = make_rm({"good": {"hardware": "CPU", "cpus": 1}, "bad": {"hardware": "CPU", "cpus": 1}})
    built: list[ra.Cluster] = []

    def good() -> ra.Cluster:
        built.append(ra.Cluster("good_cluster", Answers, rm, pool="good", wait=False))
        return built[-1]

    def wait_for_good_pid() -> ra.Cluster:  # the first cluster's worker runs before the second fails
        built[0].wait_ready()
        built.append(ra.Cluster("bad_cluster", FailsToStart, rm, pool="bad", wait=False))
        return built[-1]

    with pytest.raises(RuntimeError, match=r"(?s)bad_cluster\[rank 0\] on CPU failed to start.*no such model"):
        start_together([good, wait_for_good_pid])
    pid = built[0].pids()[0]
    assert pid > 0
    try:  # the good cluster's worker is ended, not left running
        psutil.Process(pid).wait(timeout=60)
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert rm.bindings == {}  # both pools free again
    with pytest.raises(RuntimeError, match="is still starting"):  # a cluster not waited for refuses calls
        ra.Cluster("pending", Answers, rm, pool="good", wait=False).pid()


def test_a_pool_that_cannot_be_placed_is_named_and_nothing_stays_reserved(ray_local, store_path, monkeypatch):
    """The pools are reserved together; one whose devices are taken between the capacity check and the
    reservation fails with a ResourceSpecError naming it, and the other pool's placement group goes."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    real = manager_mod.read_capacity
    blockers = []

    def read_then_take_the_h20s():
        capacity = real()
        blockers.append(placement_group([capacity["H20"].bundle(int(capacity["H20"].available))]))
        ray.get(blockers[-1].ready(), timeout=60)
        return capacity

    monkeypatch.setattr(manager_mod, "read_capacity", read_then_take_the_h20s)
    try:
        with pytest.raises(ResourceSpecError, match=r"^pools\.rollout could not be placed within 3s") as err:
            manager_mod.ResourceManager(
                {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "H20", "devices": 2}},
                job_id="startup-unplaceable",
                store=store_path,
                ready_timeout_s=3,
            )
        assert "pools.train" not in str(err.value)
    finally:
        for pg in blockers:
            remove_placement_group(pg)
    states = [
        t["state"] for t in placement_group_table().values() if t["name"].startswith("rollart/startup-unplaceable/")
    ]
    assert all(s == "REMOVED" for s in states)  # none pending or holding devices
    # the hardware is free again: every H20 and the CPUs can be placed once nothing else takes them
    capacity = real()
    probe = placement_group([capacity["H20"].bundle(int(capacity["H20"].total)), {"CPU": 1.0}])
    try:
        ray.get(probe.ready(), timeout=60)
    finally:
        remove_placement_group(probe)


# ---------------------------------------------------------------------- rollart bench startup (fast)
def _bench_args(tmp_path, *argv):
    from rollart.benchmarks import startup as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return bench, p.parse_args([*argv, "--out", str(tmp_path / "bench")])


def test_bench_startup_runs_the_command_with_the_users_overrides_last(tmp_path):
    bench, args = _bench_args(tmp_path, "--config", "my.yaml", "--steps", "2", "--set", "steps=5", "--set", "a.b=1")
    cmd = bench.command(args, tmp_path / "r1")
    assert cmd[1:5] == ["-m", "rollart.cli", "run", "my.yaml"]
    sets = [cmd[i + 1] for i, x in enumerate(cmd) if x == "--set"]
    assert sets == ["steps=2", f"output_dir={tmp_path / 'r1'}", "steps=5", "a.b=1"]
    for bad in (["--repeats", "0"], ["--steps", "0"]):
        _, args = _bench_args(tmp_path, *bad)
        with pytest.raises(SystemExit, match="must be >= 1"):
            bench.run(args)


def test_bench_startup_result_has_every_phase_and_the_ratios_to_bare_ray(tmp_path, monkeypatch):
    """Three recorded runs (their startup.json, as a run writes it) beside three bare Ray programs: the
    result has each phase's median, the medians of the per-pair ratios, the load and its files."""
    bench, args = _bench_args(tmp_path, "--repeats", "3")
    totals = iter([10.0, 12.0, 30.0])
    bares = iter([5.0, 4.0, 10.0])

    def recorded_run(args, run_dir):
        timeline = StartupTimeline()
        t0, total = timeline.marks["process_started"], next(totals)
        for i, mark in enumerate(MARKS[1:], start=1):
            timeline.mark(mark, t0 + total * i / (len(MARKS) - 1))
        run_dir.mkdir(parents=True)
        timeline.write(run_dir)
        data = json.loads((run_dir / FILE).read_text())
        return {"phases_s": data["phases_s"], "time_to_first_step_s": total, "cpu_s": total / 2, "workers": {}}

    monkeypatch.setattr(bench, "run_once", recorded_run)
    monkeypatch.setattr(bench, "bare_ray", lambda timeout: {"ray_start_s": 1.0, "total_s": next(bares), "cpu_s": 2.0})
    result = bench.run(args)
    assert result["time_to_first_step_s"] == 12.0 and result["bare_ray_actor_s"] == 5.0
    assert result["first_step_over_bare"] == pytest.approx(3.0)  # median of 2.0, 3.0, 3.0
    assert result["cpu_over_bare"] == pytest.approx(3.0)  # median of 2.5, 3.0, 7.5
    assert {f"{p}_s" for p in PHASES} <= set(result) and len(result["runs"]) == 3
    assert result["first_train_step_s"] == pytest.approx(12.0 / 8, abs=1e-3)
    assert len(result["load_average_before"].split()) == 3
    saved = json.loads((tmp_path / "bench" / "startup.json").read_text())
    assert saved["time_to_first_step_s"] == 12.0 and len(saved["bare"]) == 3


def test_phases_of_overlapping_marks_are_zero_and_add_up():
    marks = dict.fromkeys(MARKS, 0.0) | {"ray_ready": 2.0, "pools_reserved": 1.5, "first_step": 5.0}
    phases = phases_of(marks)
    assert phases["ray_start"] == 2.0 and phases["pools"] == 0.0 and sum(phases.values()) == 5.0


def test_the_config_is_checked_without_importing_torch_and_its_errors_still_name_the_field(tmp_path):
    """``rollart run`` checks the whole config (losses, advantages and aggregations against their
    functions' signatures included) before Ray starts, and torch imports beside Ray's start: checking a
    config must not import torch, also when a check fails. The loss functions still work (torch loads at
    their first call)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from rollart.config import ConfigError, load_config\n"
        "cfg = load_config('quickstart', {'train.loss': 'decoupled_ppo', 'train.loss_agg': 'seq-mean-token-mean'})\n"
        "assert cfg.train.loss == 'decoupled_ppo'\n"
        "assert load_config('quickstart', {'train.loss_params': {'eps': 0.1}}).train.loss_params == {'eps': 0.1}\n"
        "try:\n"
        "    load_config('quickstart', {'train.loss_params': {'clip_rnage': 0.2}})\n"
        "except ConfigError as err:\n"
        "    print('ERROR', err)\n"
        "print('TORCH', 'torch' in sys.modules)\n"
        "from rollart.algorithms.losses import resolve_loss\n"
        "import torch\n"
        "loss, _ = resolve_loss('ppo')(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), "
        "proximal_logprobs=torch.zeros(1, 2), behaviour_logprobs=None)\n"
        "print('LOSS', tuple(loss.shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TORCH False" in out.stdout, out.stdout
    assert "ERROR" in out.stdout and "clip_rnage" in out.stdout and "train.loss_params" in out.stdout, out.stdout
    assert "LOSS (1, 2)" in out.stdout, out.stdout


def test_a_lazy_module_imports_at_first_use_and_then_is_the_module_itself():
    from rollart.plugins import LazyModule

    namespace: dict = {}
    namespace["json"] = LazyModule("json", namespace)
    assert namespace["json"].dumps([1]) == "[1]"
    import json as real

    assert namespace["json"] is real


CLOCK_PROBE = """
import json, sys, time
from rollart.cli import main
from rollart.cli import run as run_cli
from rollart.cluster.worker import process_start_time
seen = {}
def started(cfg, **kwargs):
    from rollart.pipeline.startup import StartupTimeline
    seen["timeline"] = StartupTimeline().marks["process_started"]
    raise KeyboardInterrupt
run_cli.build_pipeline = started
code = main(["run", "quickstart", "--set", "output_dir=" + sys.argv[1]])
from rollart.pipeline.startup import StartupTimeline
after = StartupTimeline().marks["process_started"]  # the command is over: a pipeline built now counts as before
print(json.dumps({"code": code, "timeline": seen["timeline"], "process": process_start_time(), "now": time.time(),
                  "after": after}))
"""


def test_the_start_up_clock_starts_with_the_command_not_with_a_shell_it_replaced(tmp_path):
    """`bash -c '... && rollart run ...'` runs the last command in the shell's own process (exec): the
    process began before the work before it did. The timeline counts from the rollart command's start."""
    probe = f"exec {shlex.quote(sys.executable)} -c {shlex.quote(CLOCK_PROBE)} {shlex.quote(str(tmp_path / 'run'))}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        ["bash", "-c", f"sleep 3 && {probe}"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 130, proc.stderr[-2000:]
    assert out["process"] <= out["now"] - 3  # the process is the shell's, which began before the sleep
    assert out["timeline"] >= out["process"] + 3  # the timeline began after it: with the command
    assert abs(out["after"] - out["process"]) < 1  # the same start (computed twice from /proc)
