"""quickstart: does the README's job learn reverse-3 for every seed? Runs ``pipelines/quickstart.yaml``
once per seed (sequentially, a fresh local Ray each) and reports per seed the first step at which the
reward, smoothed as the mean over the last ``--window`` steps (20 by default), reaches ``--threshold``
(0.9), the final smoothed reward and the wall time; JSON, a table and a PNG of the reward curves.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("rollart.bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="pipelines/quickstart.yaml", help="the pipeline YAML to repeat")
    p.add_argument("--seeds", type=int, default=5, help="how many seeds (first-seed, first-seed + 1, ...)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--threshold", type=float, default=0.9, help="the smoothed reward that counts as learnt")
    p.add_argument("--window", type=int, default=20, help="steps in the trailing mean of the reward")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value for every seed, e.g. --set steps=300",
    )
    p.add_argument("--out", default="runs/bench/quickstart", help="output folder (one run folder per seed)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def smoothed(rewards: Sequence[float], window: int) -> list[float]:
    """Trailing mean: entry ``i`` is the mean of ``rewards[max(0, i - window + 1) : i + 1]``."""
    out, total = [], 0.0
    for i, r in enumerate(rewards):
        total += r
        if i >= window:
            total -= rewards[i - window]
        out.append(total / min(i + 1, window))
    return out


def summarise(rewards: Sequence[float], *, window: int, threshold: float) -> dict[str, Any]:
    """Steps to ``threshold`` (first step whose trailing mean reaches it; None if never) and the final
    trailing mean of one run's per-step mean rewards."""
    smooth = smoothed(rewards, window)
    first = next((i for i, r in enumerate(smooth) if r >= threshold), None)
    return {
        "steps_to_threshold": first,
        "final_reward": smooth[-1] if smooth else None,
        "first_reward": rewards[0] if rewards else None,
        "steps": len(rewards),
    }


def _run_seed(args: argparse.Namespace, seed: int) -> tuple[list[float], float]:
    from rollart.benchmarks.common import run_pipeline_once
    from rollart.config import load_config, parse_sets

    overrides = {**parse_sets(args.set), "seed": seed, "output_dir": str(Path(args.out) / f"seed{seed}")}
    history, seconds = run_pipeline_once(load_config(args.config, overrides))  # a fresh local Ray per seed
    return [float(h["reward_mean"]) for h in history], seconds


def _plot(path: Path, curves: dict[int, list[float]], window: int, threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (seed, rewards) in enumerate(curves.items()):
        color = f"C{i % 10}"
        ax.plot(rewards, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(smoothed(rewards, window), color=color, label=f"seed {seed}")
    ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward (faint: per step; solid: mean of last {window})")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right")
    ax.set_title("rollart bench quickstart: reverse-3, one curve per seed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.seeds < 1 or args.window < 1:
        raise SystemExit(f"--seeds and --window must be >= 1, got {args.seeds} and {args.window}")
    curves: dict[int, list[float]] = {}
    per_seed: dict[str, dict[str, Any]] = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        rewards, wall = _run_seed(args, seed)
        curves[seed] = rewards
        per_seed[str(seed)] = {**summarise(rewards, window=args.window, threshold=args.threshold), "wall_s": wall}
        log.info("seed %d: %s", seed, per_seed[str(seed)])
    reached = [s["steps_to_threshold"] for s in per_seed.values() if s["steps_to_threshold"] is not None]
    result: dict[str, Any] = {
        "bench": "quickstart",
        "config": args.config,
        "overrides": list(args.set),
        "threshold": args.threshold,
        "window": args.window,
        "seeds_reaching_threshold": f"{len(reached)}/{len(per_seed)}",
        "per_seed": per_seed,
    }
    for seed, s in per_seed.items():  # flat rows for the table
        to = s["steps_to_threshold"]
        result[f"seed {seed}"] = (
            f"{'never' if to is None else f'step {to}'} to {args.threshold:g}, "
            f"final {s['final_reward']:.3f}, {s['wall_s']:.0f} s"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _plot(out / "quickstart.png", curves, args.window, args.threshold)
    (out / "quickstart.json").write_text(
        json.dumps({**result, "rewards": {str(k): v for k, v in curves.items()}}, indent=2)
    )
    result["files"] = [str(out / "quickstart.json"), str(out / "quickstart.png")]
    return result
