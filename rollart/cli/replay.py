"""``rollart replay RUN_DIR --to STEP [--from STEP|CKPT] [--out DIR] [--set train.KEY=VALUE ...] [--json]``:
train a run's recorded batches again (``record_batches: true``) and write the checkpoint it reaches; with
the run's own config it is compared with the run's ``checkpoint/step-N`` when the run kept it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cmd_replay(args: argparse.Namespace) -> int:
    from rollart.config import ConfigError, parse_sets
    from rollart.pipeline.replay import ReplayError, compare_checkpoints, replay
    from rollart.training.checkpoint_io import META_FILE, step_dir

    sets = parse_sets(args.set)

    def progress(step: int, metrics: dict[str, Any]) -> None:
        log.info(
            "replayed step %d: loss %.6g, grad_norm %.6g", step, metrics.get("loss", 0.0), metrics.get("grad_norm", 0.0)
        )

    try:
        result = replay(args.run_dir, args.to, out=args.out, sets=sets, start=args.start, on_step=progress)
    except (ReplayError, ConfigError) as err:
        log.error("rollart replay: %s", err)
        return 2
    summary: dict[str, Any] = {
        "out": str(result.out),
        "from_step": result.start_step,
        "to": result.to,
        "version": result.version,
        "sets": sets,
        "loss": result.metrics[-1].get("loss") if result.metrics else None,
    }
    run_ckpt = step_dir(Path(args.run_dir) / "checkpoint", args.to)
    if (run_ckpt / META_FILE).is_file():
        diffs = compare_checkpoints(run_ckpt, result.out)
        summary["run_checkpoint"] = str(run_ckpt)
        summary["max_abs_diff"] = max(diffs.values()) if diffs else 0.0
    if args.json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return 0
    lines = [
        f"replayed steps {result.start_step + 1}..{result.to} of {args.run_dir}"
        + (f" with {' '.join(args.set)}" if args.set else ""),
        f"checkpoint: {result.out} (policy version {result.version})",
    ]
    if "max_abs_diff" in summary:
        lines.append(f"vs the run's {run_ckpt}: max abs difference {summary['max_abs_diff']:.6g}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def add_replay_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="train a run's recorded batches again (record_batches: true) and write the checkpoint it reaches",
    )
    p.add_argument("run_dir", help="the run's output folder (output_dir of its config, e.g. runs/quickstart)")
    p.add_argument("--to", type=int, required=True, metavar="STEP", help="the last step to train (counted from 1)")
    p.add_argument(
        "--from",
        dest="start",
        default=None,
        metavar="STEP|CKPT",
        help="start from the run's checkpoint after STEP steps (or a checkpoint folder); default: the initial weights",
    )
    p.add_argument(
        "--out", default=None, metavar="DIR", help="checkpoint folder to write (default: RUN_DIR/replay/step-N)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a trainer key of the run (e.g. --set train.lr=0.002, --set train.loss=cispo); repeatable",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(func=cmd_replay)
