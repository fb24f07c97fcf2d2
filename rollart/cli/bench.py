"""``rollart bench NAME [...]``: the benchmarks of :mod:`rollart.benchmarks`, found through its registry.
Only the bench that runs is imported (benches import torch and Ray)."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


def cmd_bench(args: argparse.Namespace) -> int:
    result = args.bench_run(args)
    failed = bool(result.get("error"))  # a bench that reports what it measured up to a failure
    if getattr(args, "json", False):
        print(json.dumps(result, default=str))
        return int(failed)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rollart bench {args.bench}", show_header=False)
    for key, value in result.items():
        if isinstance(value, float):
            table.add_row(key, f"{value:.4g}")
        elif isinstance(value, (int, str)):
            table.add_row(key, str(value))
        elif key == "files":
            table.add_row(key, "\n".join(value))
    Console().print(table)
    return int(failed)


def _selected_bench(argv: Sequence[str]) -> str | None:
    """The bench named on the command line (``rollart [-v] bench NAME ...``), if any."""
    args = [a for a in argv if not a.startswith("-")]
    return args[1] if len(args) >= 2 and args[0] == "bench" else None


def add_bench_parser(sub: Any, argv: Sequence[str]) -> None:
    """One sub-parser per bench; only the bench named in ``argv`` is imported."""
    from rollart.benchmarks import BENCHES, bench_module, bench_summary, load_bench

    bench = sub.add_parser(
        "bench",
        help="benchmarks (measured speed-ups next to their bounds; JSON and charts under runs/bench)",
        description="Benchmarks: each prints what it measured next to the bound of the same model, and writes "
        "JSON (and a chart with the plot extra) under runs/bench/. `rollart bench NAME --help` lists its options.",
    )
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    wanted = _selected_bench(argv)
    describe = "bench" in argv  # per-bench help only where it can be shown
    for name in BENCHES:
        if name != wanted:
            bench_sub.add_parser(name, help=bench_summary(name) if describe else None)
            continue
        try:
            mod = load_bench(name)
        except ImportError as err:
            log.error("rollart bench %s needs %s, which failed to import: %s", name, bench_module(name), err)
            raise SystemExit(2) from None
        summary = bench_summary(name)
        p = bench_sub.add_parser(name, help=summary, description=f"rollart bench {name}: {summary}.")
        mod.add_arguments(p)
        if not any(a.dest == "json" for a in p._actions):
            p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(func=cmd_bench, bench_run=mod.run)
