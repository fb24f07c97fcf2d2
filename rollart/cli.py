"""The ``rollart`` command: ``--version``, ``status``, ``run``, ``submit``/``jobs``/``logs``/``stop``, ``serve``,
``bench``, ``export``.

Subcommands live in the modules that own them; this file only mounts them, importing each lazily so
``rollart --version`` and ``rollart status`` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import rollart

log = logging.getLogger(__name__)
# bench name -> module with add_arguments(parser) and run(args) -> dict
BENCHES: dict[str, str] = {
    "reward-service": "rollart.benchmarks.reward_service",
    "shared-reward": "rollart.benchmarks.shared_reward",
    "engine": "rollart.benchmarks.engine_throughput",
    "env-async": "rollart.benchmarks.env_async",
    "redundant-env": "rollart.benchmarks.redundant_env",
    "env-service": "rollart.benchmarks.env_service",
    "queue-scheduling": "rollart.benchmarks.queue_scheduling",
    "affinity": "rollart.benchmarks.affinity",
    "prompt-replication": "rollart.benchmarks.prompt_replication",
    "async-train": "rollart.benchmarks.async_train",
    "weight-sync": "rollart.benchmarks.weight_sync",
    "quickstart": "rollart.benchmarks.quickstart",
    "throughput": "rollart.benchmarks.throughput",
    "chaos": "rollart.benchmarks.chaos",
    "soak": "rollart.benchmarks.soak",
}


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cluster_state(address: str, job: str | None) -> dict[str, Any]:
    """The Ray cluster's registry (every host's and driver's jobs), read through a short-lived driver."""
    import ray

    from rollart.resource_manager.launcher import _token_auth_for_joining
    from rollart.resource_manager.registry import ClusterRegistry

    _token_auth_for_joining()
    os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    ray.init(address=address, namespace="rollart-status", log_to_driver=False, logging_level=logging.WARNING)
    try:
        state: dict[str, Any] = {"cluster": address, **ClusterRegistry().snapshot(job)}
    finally:
        ray.shutdown()
    for j in state["jobs"]:  # a driver on another host: its pid cannot be checked from here
        j["driver_alive"] = None if j["ended_at"] is None else False
    return state


def cmd_status(args: argparse.Namespace) -> int:
    """Print jobs, pools, worker bindings and endpoints: the Ray cluster's registry when ``RAY_ADDRESS`` is
    set (every host's jobs), else the local metadata store (``--local`` forces the store)."""
    address = os.environ.get("RAY_ADDRESS")
    if address and not args.local and args.store is None:
        state = _cluster_state(address, args.job)
        where = f"Ray cluster: {address}"
    else:
        from rollart.resource_manager.store import MetadataStore

        store = MetadataStore(args.store)
        state = {
            "store": str(store.path),
            "jobs": store.jobs(args.job),
            "pools": store.pools(args.job),
            "bindings": store.bindings(args.job),
            "endpoints": store.endpoints(args.job),
            "runs": store.runs(args.job),
        }
        for job in state["jobs"]:
            job["driver_alive"] = job["ended_at"] is None and _pid_alive(job["driver_pid"])
        where = f"metadata store: {store.path}"
    if args.json:
        print(json.dumps(state, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(where)
    for title, rows, cols in (
        ("jobs", state["jobs"], ["job_id", "state", "driver_pid", "driver_alive", "ray_address", "ended_at"]),
        ("pools", state["pools"], ["job_id", "pool", "group_index", "hardware", "devices", "cpus", "state"]),
        (
            "workers",
            state["bindings"],
            ["job_id", "cluster", "rank", "pool", "hardware", "node_ip", "node_id", "device_ids", "state"],
        ),
        ("endpoints", state["endpoints"], ["job_id", "cluster", "method", "url", "timeout_s", "retries"]),
        (
            "runs",
            state.get("runs", []),
            ["job_id", "attempt", "driver_pid", "started_at", "ended_at", "status", "cause"],
        ),
    ):
        table = Table(title=title)
        for c in cols:
            table.add_column(c)
        for r in rows:
            table.add_row(*[str(r.get(c))[:16] if c == "node_id" else str(r.get(c)) for c in cols])
        console.print(table)
    return 0


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


def _module_summary(module: str) -> str | None:
    """The first docstring line of ``module``, read from its source without importing it."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except ImportError:
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    return doc.strip().splitlines()[0] if doc else None


def _selected_bench(argv: Sequence[str]) -> str | None:
    """The bench named on the command line (``rollart [-v] bench NAME ...``), if any."""
    args = [a for a in argv if not a.startswith("-")]
    return args[1] if len(args) >= 2 and args[0] == "bench" else None


def _add_bench(sub: Any, argv: Sequence[str]) -> None:
    """One sub-parser per bench; only the bench that runs is imported (benches import torch and Ray)."""
    bench = sub.add_parser("bench", help="benchmarks that reproduce the seed figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    wanted = _selected_bench(argv)
    describe = "bench" in argv  # per-bench help only where it can be shown
    for name, module in BENCHES.items():
        if name != wanted:
            bench_sub.add_parser(name, help=_module_summary(module) if describe else None)
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as err:
            log.error("rollart bench %s needs %s, which failed to import: %s", name, module, err)
            raise SystemExit(2) from None
        p = bench_sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0] if mod.__doc__ else None)
        mod.add_arguments(p)
        if not any(a.dest == "json" for a in p._actions):
            p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(func=cmd_bench, bench_run=mod.run)


def _optional(module: str, attr: str) -> Callable[[Any], None] | None:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``rollart`` parser. Subcommand modules are imported when they run; of the benches only the
    one named in ``argv`` is imported."""
    parser = argparse.ArgumentParser(prog="rollart", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"rollart {rollart.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command")

    status = sub.add_parser("status", help="pools, workers and endpoints from the metadata store")
    status.add_argument(
        "--store", default=None, help="metadata store file (default $ROLLART_METADATA_DB or ~/.rollart/metadata.sqlite)"
    )
    status.add_argument("--job", default=None, help="only this job id")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--local", action="store_true", help="read the local metadata store even when RAY_ADDRESS names a cluster"
    )
    status.set_defaults(func=cmd_status)

    for module, attr in (
        ("rollart.pipeline_cli", "add_run_parser"),
        ("rollart.reward.cli", "add_serve_parser"),
        ("rollart.export_cli", "add_export_parser"),
        ("rollart.jobs_cli", "add_job_parsers"),
        ("rollart.advise_cli", "add_advise_parser"),
    ):
        add = _optional(module, attr)
        if add is not None:
            add(sub)
    _add_bench(sub, list(sys.argv[1:] if argv is None else argv))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
