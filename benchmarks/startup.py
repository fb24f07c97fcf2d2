"""startup: the time from ``rollart run`` to the first trained step, as a user meets it, in phases.

Runs the real command (``python -m rollart.cli run CONFIG --set steps=1``, each with a fresh local Ray)
``--repeats`` times and reads the phases from the ``startup.json`` each run writes once its first step
is done (:mod:`rollart.pipeline.startup`): imports and config, Ray start, pools, worker start (each
worker's process and its imports), model load, pipeline setup, first rollout and first train step. The
total is the time from the bench launching the command to the first step; the phases add up to it.

Beside each run (just before it, so both see the same load) a bare Ray program runs: a fresh process
that starts a local Ray with Ray's defaults and one actor, and waits for the actor's answer. Its time is
what any Ray program pays before its first call, and it slows down with the machine's load as the run
does: the tracked figures are the run's time to the first step and its CPU seconds (every process of
the run, summed) over the bare program's, the median of the per-pair ratios. The load average is
reported at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rollart.bench")

# A bare Ray program: a local Ray with Ray's defaults (on 127.0.0.1, no dashboard) and one actor.
BARE_RAY = """
import json, os, sys, time
import ray
began = time.time()
ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
ready = time.time()

@ray.remote
class Probe:
    def ping(self):
        return os.getpid()

ray.get(Probe.remote().ping.remote())
print(json.dumps({"ray_init_began": began, "ray_ready": ready, "actor_answered": time.time()}))
ray.shutdown()
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="quickstart", help="the pipeline config: a YAML path or a shipped name")
    p.add_argument("--repeats", type=int, default=3, help="runs of the command (each beside a bare Ray program)")
    p.add_argument("--steps", type=int, default=1, help="steps per run (the phases end at the first)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value for every run, e.g. --set engine.kind=vllm",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a run or a bare program may take")
    p.add_argument("--out", default="runs/bench/startup", help="output folder (one run folder per repeat)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


class _TreeCpu:
    """The CPU seconds of a process and all its descendants (the run's Ray processes and workers
    included), sampled while it runs; a process that ended keeps its last sample."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.seen: dict[tuple[int, float], float] = {}  # (pid, its start time) -> CPU seconds

    def sample(self) -> float:
        import psutil

        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for proc in procs:
            try:
                cpu = proc.cpu_times()
                self.seen[(proc.pid, proc.create_time())] = cpu.user + cpu.system
            except psutil.Error:  # ended between the listing and the reading
                continue
        return sum(self.seen.values())


def _watch(
    cmd: list[str], until: Path | None, timeout: float, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``cmd``; its result, its launch time and the CPU seconds of its process tree when ``until``
    appeared (or when it ended)."""
    launched = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    tree, cpu = _TreeCpu(proc.pid), 0.0
    deadline = launched + timeout
    while proc.poll() is None and time.time() < deadline:
        cpu = tree.sample()
        if until is not None and until.exists():
            break
        time.sleep(0.2)
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    if until is None:
        cpu = max(cpu, tree.sample())
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), launched, cpu


def bare_ray(timeout: float) -> dict[str, float]:
    """One bare Ray program: seconds from its launch to Ray up and to its actor's answer, and its CPU."""
    # Ray keeps 127.0.0.1 with its single-machine switch on (read when ray is imported)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    done, launched, cpu = _watch([sys.executable, "-c", BARE_RAY], None, timeout, env)
    if done.returncode != 0:
        raise RuntimeError(f"the bare Ray program failed (exit {done.returncode}): {done.stderr[-2000:]}")
    t = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "ray_start_s": t["ray_ready"] - launched,
        "total_s": t["actor_answered"] - launched,
        "cpu_s": cpu,
    }


def command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The ``rollart run`` of one repeat: ``args.config`` for ``args.steps`` steps into ``run_dir``, with
    the user's ``--set`` overrides last (they win)."""
    cmd = [sys.executable, "-m", "rollart.cli", "run", args.config, "--overwrite", "--set", f"steps={args.steps}"]
    return cmd + ["--set", f"output_dir={run_dir}", *[x for s in args.set for x in ("--set", s)]]


def run_once(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One ``rollart run``: its phases (from its ``startup.json``), total and CPU seconds to the first step."""
    from rollart.pipeline.startup import FILE, PHASES

    cmd = command(args, run_dir)
    record = run_dir / FILE
    if record.exists():
        record.unlink()
    done, launched, cpu = _watch(cmd, record, args.timeout)
    if not record.exists():
        raise RuntimeError(f"`{' '.join(cmd)}` wrote no {FILE} (exit {done.returncode}): {done.stderr[-3000:]}")
    data = json.loads(record.read_text())
    phases = dict(data["phases_s"])
    # the command's own start: from the launch to the process (the interpreter's exec) counts as imports
    launch_s = max(0.0, data["process_started"] - launched)
    phases[PHASES[0]] += launch_s
    return {
        "phases_s": phases,
        "time_to_first_step_s": launch_s + data["time_to_first_step_s"],
        "cpu_s": cpu,
        "workers": data["workers"],
    }


def _plot(path: Path, runs: list[dict[str, Any]], bare: list[dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rollart.pipeline.startup import PHASES

    fig, ax = plt.subplots(figsize=(8, 0.6 * (2 * len(runs)) + 1.6))
    labels: list[str] = []
    for i, (run, ref) in enumerate(zip(runs, bare, strict=True)):
        y = 2 * i
        left = 0.0
        for j, phase in enumerate(PHASES):
            width = run["phases_s"][phase]
            ax.barh(y, width, left=left, color=f"C{j}", label=phase.replace("_", " ") if i == 0 else None)
            left += width
        ax.barh(y + 1, ref["total_s"], color="#999999", label="bare ray.init + one actor" if i == 0 else None)
        labels += [f"run {i + 1}", f"bare Ray {i + 1}"]
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the command")
    ax.set_title("rollart bench startup: the command to the first trained step")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.pipeline.startup import PHASES

    if args.repeats < 1 or args.steps < 1:
        raise SystemExit(f"--repeats and --steps must be >= 1, got {args.repeats} and {args.steps}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    bare: list[dict[str, float]] = []
    for i in range(args.repeats):
        bare.append(bare_ray(args.timeout))
        runs.append(run_once(args, out / f"run{i + 1}"))
        log.info(
            "repeat %d: first step %.1f s after the command (bare Ray + actor %.1f s), CPU %.1f s (bare %.1f s)",
            i + 1,
            runs[-1]["time_to_first_step_s"],
            bare[-1]["total_s"],
            runs[-1]["cpu_s"],
            bare[-1]["cpu_s"],
        )
    med = statistics.median
    result: dict[str, Any] = {
        "bench": "startup",
        "config": args.config,
        "overrides": [f"steps={args.steps}", *args.set],
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "load_average_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_average_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "time_to_first_step_s": med(r["time_to_first_step_s"] for r in runs),
        "cpu_s": med(r["cpu_s"] for r in runs),
        "bare_ray_start_s": med(b["ray_start_s"] for b in bare),
        "bare_ray_actor_s": med(b["total_s"] for b in bare),
        "bare_cpu_s": med(b["cpu_s"] for b in bare),
        "first_step_over_bare": med(r["time_to_first_step_s"] / b["total_s"] for r, b in zip(runs, bare, strict=True)),
        "cpu_over_bare": med(r["cpu_s"] / max(b["cpu_s"], 1e-3) for r, b in zip(runs, bare, strict=True)),
    }
    for phase in PHASES:  # the median of each phase (medians need not add up; each run's phases do)
        result[f"{phase}_s"] = med(r["phases_s"][phase] for r in runs)
    (out / "startup.json").write_text(json.dumps({**result, "runs": runs, "bare": bare}, indent=2))
    result["files"] = [str(out / "startup.json")]
    try:
        _plot(out / "startup.png", runs, bare)
        result["files"].append(str(out / "startup.png"))
    except ImportError:
        log.info("startup.png skipped: matplotlib is not installed (pip install 'rollart[plot]')")
    result["runs"] = runs
    result["bare"] = bare
    return result
