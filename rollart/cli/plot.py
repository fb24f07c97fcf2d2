"""``rollart plot RUN_DIR``: draw ``RUN_DIR/metrics.png`` again from the run's ``metrics.jsonl`` (after
installing the ``plot`` extra, for a run that ran without it, or after it was resumed elsewhere)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cmd_plot(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        log.error("rollart plot: %s holds no metrics.jsonl; give a run's output folder, e.g. runs/quickstart", run_dir)
        return 2
    if importlib.util.find_spec("matplotlib") is None:
        log.error(
            "rollart plot: drawing needs matplotlib; install the plot extra (pip install -c constraints/cpu.txt "
            "-e '.[plot]' in a clone, or pip install 'rollart[plot]'), then run this again"
        )
        return 2
    from rollart.pipeline.records import MetricsFile

    file = MetricsFile(run_dir)
    records = file.read()
    if not records:
        log.error("rollart plot: %s has no step records yet", metrics)
        return 2
    path = file.plot(records, args.title or run_dir.resolve().name)
    sys.stdout.write(json.dumps({"plot": str(path), "steps": len(records)}) + "\n")
    return 0


def add_plot_parser(sub: Any) -> None:
    p = sub.add_parser("plot", help="draw a run's metrics.png again from its metrics.jsonl")
    p.add_argument("run_dir", help="the run's output folder (output_dir of its config, e.g. runs/quickstart)")
    p.add_argument("--title", default=None, help="the chart's title (default: the folder's name)")
    p.set_defaults(func=cmd_plot)
