"""soak: the chaos run for ``--minutes`` (30 by default; not in CI) with a random fault every
``--fault-every-s`` seconds (60); the resident memory (RSS) of the driver, every worker and the reward service
is sampled every ``--sample-s`` seconds (60; fewer for a short soak) and its slope per process is
reported in MB/min (flat is the goal), with the trajectory ledger (0 lost).

A worker restarted after a fault is a new process: its memory is a new series (``NAME:PID``); a slope
is fitted only to a series with at least three samples spanning a quarter of the run, after dropping
the first sample of each series (start-up: imports and the first step's allocations).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from rollart.benchmarks.chaos import (
    FAULT_KINDS,
    OPTIONAL_KINDS,
    add_weight_arguments,
    check_weight_arguments,
    run_chaos,
)

log = logging.getLogger("rollart.bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="how long the run goes on")
    p.add_argument("--fault-every-s", type=float, default=60.0, help="seconds between two random faults")
    p.add_argument(
        "--sample-s",
        type=float,
        default=None,
        help="seconds between memory samples (default: 60, or minutes*60/10 when that is shorter)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(FAULT_KINDS), help="comma-separated fault kinds to draw from")
    p.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="trace the driver's allocations (this many frames each; slows the driver) and report what grew "
        "from a quarter of the run to its end (tracemalloc.txt)",
    )
    p.add_argument(
        "--tracemalloc-train",
        type=int,
        default=0,
        metavar="FRAMES",
        help="also trace each train rank's allocations (slows training; needs --tracemalloc) and report what "
        "grew over the same span (tracemalloc_trainN.txt)",
    )
    add_weight_arguments(p)
    p.add_argument("--out", default="runs/bench/soak")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def slope(series: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(seconds, MB)`` samples, in MB per minute."""
    n = len(series)
    mt = sum(t for t, _ in series) / n
    mm = sum(m for _, m in series) / n
    var = sum((t - mt) ** 2 for t, _ in series)
    return 0.0 if var == 0 else 60.0 * sum((t - mt) * (m - mm) for t, m in series) / var


def slopes(rss: dict[str, list[tuple[float, float]]], span_s: float) -> dict[str, dict[str, float]]:
    """Per process series (start-up sample dropped): first and last MB, the slope in MB/min over the
    whole series and over its second half (``settled_mb_per_min``: after warm-up steps such as the
    allocator taking a new arena, which a whole-series fit spreads over the run)."""
    out = {}
    for name, series in sorted(rss.items()):
        s = [tuple(x) for x in series[1:]]
        if len(s) < 3 or s[-1][0] - s[0][0] < span_s / 4:
            continue
        late = [x for x in s if x[0] >= (s[0][0] + s[-1][0]) / 2]
        out[name] = {
            "first_mb": s[0][1],
            "last_mb": s[-1][1],
            "mb_per_min": slope(s),  # type: ignore[arg-type]
            "settled_mb_per_min": slope(late) if len(late) >= 3 else float("nan"),  # type: ignore[arg-type]
            "samples": len(s),
            "series_mb": [round(mb, 2) for _, mb in s],  # every sample, to read the shape, not only the slope
            "series_s": [round(t) for t, _ in s],  # when (seconds into the run, as the faults' ``t``)
        }
    return out


def mapping_growth(mappings: dict[str, list[tuple[float, dict[str, float]]]], top: int = 8) -> dict[str, Any]:
    """Per train rank sampled at least 3 times, the mappings whose resident memory changed most from its
    second sample (after start-up) to its last: ``{process: {mapping: [first MB, last MB]}}``."""
    out: dict[str, Any] = {}
    for name, series in sorted(mappings.items()):
        if len(series) < 3:
            continue
        first, last = series[1][1], series[-1][1]
        changed = sorted(set(first) | set(last), key=lambda k: -abs(last.get(k, 0.0) - first.get(k, 0.0)))
        out[name] = {k: [first.get(k, 0.0), last.get(k, 0.0)] for k in changed[:top]}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.testing import skip_reason, start_hosts, three_hosts

    reason = skip_reason()
    if reason:
        raise SystemExit(f"rollart bench soak needs namespace hosts: {reason}")
    if args.minutes <= 0 or args.fault_every_s <= 0:
        raise SystemExit("--minutes and --fault-every-s must be > 0")
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(FAULT_KINDS) - set(OPTIONAL_KINDS)
    if unknown:
        raise SystemExit(f"--kinds: unknown {sorted(unknown)}; choose from {FAULT_KINDS + list(OPTIONAL_KINDS)}")
    check_weight_arguments(args)
    sample_s = args.sample_s or min(60.0, args.minutes * 60.0 / 10)
    max_steps = 100_000
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--minutes", str(args.minutes), "--sample-s", str(sample_s), "--fault-every-s", str(args.fault_every_s)]
    if args.tracemalloc_train and not args.tracemalloc:
        raise SystemExit("--tracemalloc-train needs --tracemalloc (the driver's snapshot sets the span compared)")
    extra += ["--kinds", ",".join(kinds), "--tracemalloc", str(args.tracemalloc)]
    extra += ["--tracemalloc-train", str(args.tracemalloc_train)]
    with start_hosts(three_hosts(), start_timeout_s=300) as hosts:
        res = run_chaos(
            hosts,
            out / "run",
            steps=max_steps,
            seed=args.seed,
            kinds=kinds,
            plan={},
            extra=extra,
            timeout_s=args.minutes * 60 + 900,
            keep_failed=True,
            channel=args.channel,
            relay=args.relay,
        )
    led = res["ledger"]
    per_proc = slopes(res["rss"], args.minutes * 60.0)
    injected: dict[str, int] = {}
    for i in res["injected"]:
        injected[i["kind"]] = injected.get(i["kind"], 0) + 1
    result: dict[str, Any] = {
        "bench": "soak",
        "minutes": args.minutes,
        "weights": args.channel + (" (relay)" if args.relay else ""),
        "steps": res["steps"],
        "error": res.get("error"),  # None when the run went to its end
        "sample_s": sample_s,
        "trajectories lost": led["lost"],
        "trained twice": led["trained_twice"],
        "rewards invented": led["rewards_invented"] + res["rewards_mismatch"],
        "faults injected": ", ".join(f"{k} {n}" for k, n in sorted(injected.items())) or "none",
        "ledger": led,
        "faults": res["faults"],
        # each fault: its step, kind and the second of the run it came at (the memory samples' clock)
        "injected": res["injected"],
        "rss": per_proc,
        # where each train rank's memory went: its mappings that changed most (chaos.mappings_mb)
        "train mappings changed": mapping_growth(res.get("mappings", {})),
    }
    files = [str(out / "soak.json")]
    if res.get("allocation_growth"):
        result["driver allocations grown"] = res["allocation_growth"][:10]
        files.append(str(out / "run" / "tracemalloc.txt"))
    for rank, rows in res.get("train_allocation_growth", {}).items():
        result[f"train{rank} allocations grown"] = rows[:10]
        files.append(str(out / "run" / f"tracemalloc_train{rank}.txt"))
    for name, s in per_proc.items():
        result[f"rss {name}"] = (
            f"{s['first_mb']:.0f} -> {s['last_mb']:.0f} MB, {s['mb_per_min']:+.2f} MB/min "
            f"(second half {s['settled_mb_per_min']:+.2f})"
        )
    (out / "soak.json").write_text(
        json.dumps({**result, "run": {k: v for k, v in res.items() if k != "metrics"}}, indent=2, default=str)
    )
    result["files"] = files
    return result
