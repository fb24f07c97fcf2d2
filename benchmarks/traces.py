"""traces: what trajectory traces cost a run's step time, measured inside one run.

Two runs of the same job, one traced and one not, differ by more than tracing costs: on a shared or a
small machine the step time drifts by 10% and more between runs minutes apart (the 2-core CI-class
machine: pairs of 40-step quickstart runs differed by −6% to +17% with nothing changed). And within one
seeded run each step has its own cost (its batch, its sequence lengths), the same in every run. So this
bench runs the job with ``traces.enabled`` and switches the trace writer off and on in alternating blocks
of ``--block`` steps (the rollout's and the step loop's sink both), in ``--runs`` runs (2 by default)
whose blocks are swapped: a step traced in one run is untraced in the next. Both the steps' own costs and
the drift between runs then weigh equally on both sides. (With one run, blocks of 5 steps on the
quickstart: the traced blocks' rollout was 10-13 ms a step slower with tracing never switched on.) The
first step of each block is left out: in a synchronous job the next batch's rollout starts inside the
previous step, so that step is half of each. Reported: the mean and the median step time of the traced
and the untraced steps over all runs, their difference in percent, each run's figures, the driver main
thread's CPU per step on each side, and the trace file's size per 1,000 traced trajectories. The same
seeded batches are trained either way (tracing changes no result).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("rollart.bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="quickstart", help="the pipeline config: a YAML path or a shipped name")
    p.add_argument("--steps", type=int, default=100, help="steps of each run")
    p.add_argument("--runs", type=int, default=2, help="runs; each swaps the traced and untraced blocks of the last")
    p.add_argument("--block", type=int, default=5, help="steps per block; blocks alternate untraced / traced")
    p.add_argument("--skip", type=int, default=10, help="first steps of each run left out (start-up and warm-up)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set rollout.alpha=1",
    )
    p.add_argument("--out", default="runs/bench/traces", help="output folder (one run folder per run)")


def traced_steps(steps: int, block: int, skip: int, phase: int) -> dict[int, bool | None]:
    """Step index -> traced (True), untraced (False) or left out (None): blocks of ``block`` steps
    alternate, untraced first at ``phase`` 0 and traced first at phase 1; the first ``skip`` steps and the
    first step of each block are left out."""
    if block < 2:
        raise SystemExit(f"--block must be >= 2 (a block's first step is left out), got {block}")
    return {s: None if s < skip or s % block == 0 else (s // block + phase) % 2 == 1 for s in range(steps)}


def split(
    records: list[dict[str, Any]], plan: dict[int, bool | None], value: Callable[[dict[str, Any]], float]
) -> tuple[list[float], list[float]]:
    """``value`` of each traced and of each untraced step record of one run."""
    on = [value(r) for r in records if plan.get(r["step"] - 1) is True]
    off = [value(r) for r in records if plan.get(r["step"] - 1) is False]
    return on, off


def step_s(record: dict[str, Any]) -> float:
    return float(record["time"]["step_s"])


def driver_cpu_s(record: dict[str, Any]) -> float:
    return float(record["driver_cpu_s"])


def compare(on: list[float], off: list[float]) -> dict[str, Any]:
    """Mean and median step time of the traced and the untraced steps, and the differences in percent."""
    if not on or not off:
        raise SystemExit("too few steps for a traced and an untraced block: raise --steps")
    mean_on, mean_off = statistics.mean(on), statistics.mean(off)
    med_on, med_off = statistics.median(on), statistics.median(off)
    return {
        "steps_traced": len(on),
        "steps_untraced": len(off),
        "step_s_traced_mean": round(mean_on, 4),
        "step_s_untraced_mean": round(mean_off, 4),
        "overhead_mean_pct": round(100 * (mean_on / mean_off - 1), 2),
        "step_s_traced_median": round(med_on, 4),
        "step_s_untraced_median": round(med_off, 4),
        "overhead_median_pct": round(100 * (med_on / med_off - 1), 2),
    }


def trace_size(path: Path) -> dict[str, Any]:
    """The trace file's bytes, events and traced trajectories, and its size per 1,000 of them."""
    from rollart.tracking.traces import RUN, read_traces

    ids: set[str] = set()
    events = 0
    for event in read_traces(path):
        events += 1
        if event["traj_id"] != RUN:
            ids.add(event["traj_id"])
    size = path.stat().st_size
    return {
        "trace_bytes": size,
        "trace_events": events,
        "traced_trajectories": len(ids),
        "trace_mb_per_1000_trajectories": round(size / max(len(ids), 1) * 1000 / 2**20, 3),
    }


def _run_once(args: argparse.Namespace, phase: int, out_dir: Path) -> list[dict[str, Any]]:
    """One run of the job, its trace writer switched by blocks (``phase``: which come first)."""
    from rollart.benchmarks.common import run_pipeline_once
    from rollart.config import load_config, parse_sets

    overrides = {
        **parse_sets(args.set),
        "steps": args.steps,
        "checkpoint_every": 0,
        "output_dir": str(out_dir),
        "traces": {"enabled": True},
    }
    writers = []

    def switch_by_blocks(pipe: Any) -> None:
        writer, step_fn = pipe.traces, pipe._step
        assert writer is not None  # traces.enabled
        writers.append(writer)

        async def switched_step(step: int) -> dict[str, Any]:
            on = (step // args.block + phase) % 2 == 1
            pipe.traces = pipe.scheduler.traces = writer if on else None
            cpu = time.thread_time()
            record = await step_fn(step)
            record["driver_cpu_s"] = time.thread_time() - cpu  # the driver's main thread: rollout loop and step
            return record

        pipe._step = switched_step

    try:
        history, _ = run_pipeline_once(load_config(args.config, overrides), switch_by_blocks)
    finally:
        for writer in writers:  # the run's end closed only the sink its last block had on
            writer.close()
    return history


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.tracking.traces import TRACES

    if args.runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {args.runs}")
    on: list[float] = []
    off: list[float] = []
    per_run: list[dict[str, Any]] = []
    size: dict[str, Any] = {}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    final = None
    for i in range(args.runs):
        out_dir = Path(args.out) / f"run{i}"
        plan = traced_steps(args.steps, args.block, args.skip, i % 2)
        history = _run_once(args, i % 2, out_dir)
        run_on, run_off = split(history, plan, step_s)
        on += run_on
        off += run_off
        cpu_on, cpu_off = split(history, plan, driver_cpu_s)
        cpu["on"] += cpu_on
        cpu["off"] += cpu_off
        per_run.append({"phase": i % 2, **compare(run_on, run_off)})
        size = trace_size(out_dir / TRACES)
        final = history[-1].get("reward_mean") if history else None
        log.info("traces bench, run %d: %s", i, per_run[-1])
    result: dict[str, Any] = {
        "bench": "traces",
        "config": args.config,
        "overrides": list(args.set),
        "steps": args.steps,
        "runs": args.runs,
        "block": args.block,
        **compare(on, off),
        "driver_cpu_ms_traced": round(1e3 * statistics.mean(cpu["on"]), 2),
        "driver_cpu_ms_untraced": round(1e3 * statistics.mean(cpu["off"]), 2),
        "per_run": per_run,
        **size,
        "final_reward": final,
    }
    out = Path(args.out) / "bench_traces.json"
    out.write_text(json.dumps(result, indent=2))
    result["files"] = [str(out)]
    return result
