"""``rollart status [--store FILE] [--job ID] [--json] [--local]``: jobs, pools, worker bindings and
endpoints, from the Ray cluster's registry or the local metadata store; the GPUs Ray detects on this
machine (what a local ``rollart run`` declares), or each node's GPUs and logical devices."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


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

    from rollart.resource_manager.launcher import _token_auth_for_joining, node_hardware
    from rollart.resource_manager.registry import ClusterRegistry

    _token_auth_for_joining()
    os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    ray.init(address=address, namespace="rollart-status", log_to_driver=False, logging_level=logging.WARNING)
    try:
        state: dict[str, Any] = {"cluster": address, "nodes": node_hardware(), **ClusterRegistry().snapshot(job)}
    finally:
        ray.shutdown()
    for j in state["jobs"]:  # a driver on another host: its pid cannot be checked from here
        j["driver_alive"] = None if j["ended_at"] is None else False
    return state


def _local_state(store_path: str | None, job: str | None) -> tuple[dict[str, Any], str]:
    from rollart.resource_manager.launcher import detect_gpus
    from rollart.resource_manager.store import MetadataStore

    store = MetadataStore(store_path)
    gpus = detect_gpus()  # what a local `rollart run` here declares
    state: dict[str, Any] = {
        "store": str(store.path),
        "gpus": {"count": gpus.count, "accelerator_type": gpus.accelerator_type, "detected": gpus.describe()},
        "jobs": store.jobs(job),
        "pools": store.pools(job),
        "bindings": store.bindings(job),
        "endpoints": store.endpoints(job),
        "runs": store.runs(job),
    }
    for j in state["jobs"]:
        j["driver_alive"] = j["ended_at"] is None and _pid_alive(j["driver_pid"])
    return state, f"metadata store: {store.path}"


def _when(value: Any) -> str:
    """An epoch time as local date and time; '' for none."""
    import datetime

    if value in (None, ""):
        return ""
    try:
        return datetime.datetime.fromtimestamp(float(value)).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError, OverflowError):
        return str(value)


def _job_state(job: dict[str, Any]) -> str:
    """A job's state as a word: the recorded one, else running / ended from its times and driver."""
    if job.get("state"):
        return str(job["state"])
    if job.get("ended_at"):
        return "ended"
    return "running" if job.get("driver_alive") is not False else "driver gone"


def _cell(column: str, row: dict[str, Any]) -> str:
    value = _job_state(row) if column == "state" and "driver_pid" in row else row.get(column)
    if column.endswith("_at"):
        return _when(value)
    if column == "node_id" and value:
        return str(value)[:16]
    if column == "driver_alive":
        return "yes" if value is True else "no" if value is False else "unknown (another host)"
    if column == "device_ids" and isinstance(value, list):
        return ",".join(str(d) for d in value) or "-"
    return "" if value is None else str(value)


def _print_tables(state: dict[str, Any], where: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(where)
    if "gpus" in state:
        console.print(f"GPUs on this machine (Ray's detection, declared by a local run): {state['gpus']['detected']}")
    for node in state.get("nodes", []):
        gpu_types = f" ({', '.join(node['gpu_types'])})" if node["gpu_types"] else ""
        logical = ", ".join(f"{t} x{n:g}" for t, n in node["logical"].items()) or "none"
        console.print(f"node {node['node_ip']}: {node['gpus']:g} GPU{gpu_types}; logical devices: {logical}")
    for title, rows, cols in (
        ("jobs", state["jobs"], ["job_id", "state", "driver_pid", "driver_alive", "ray_address", "ended_at"]),
        (
            "pools",
            state["pools"],
            ["job_id", "pool", "group_index", "hardware", "devices", "max_devices", "cpus", "state"],
        ),
        (
            "workers",
            state["bindings"],
            ["job_id", "cluster", "rank", "pool", "hardware", "node_ip", "node_id", "slot_ids", "device_ids", "state"],
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
            table.add_column(c, overflow="fold")
        for r in rows:
            table.add_row(*[_cell(c, r) for c in cols])
        console.print(table)


def cmd_status(args: argparse.Namespace) -> int:
    """Print jobs, pools, worker bindings and endpoints: the Ray cluster's registry when ``RAY_ADDRESS`` is
    set (every host's jobs), else the local metadata store (``--local`` forces the store)."""
    address = os.environ.get("RAY_ADDRESS")
    if address and not args.local and args.store is None:
        state = _cluster_state(address, args.job)
        where = f"Ray cluster: {address}"
    else:
        state, where = _local_state(args.store, args.job)
    if args.json:
        print(json.dumps(state, indent=2, default=str))
        return 0
    _print_tables(state, where)
    return 0


def add_status_parser(sub: Any) -> None:
    status = sub.add_parser(
        "status",
        help="jobs, pools, workers and endpoints (of the Ray cluster with RAY_ADDRESS, else this machine's)",
    )
    status.add_argument(
        "--store", default=None, help="metadata store file (default $ROLLART_METADATA_DB or ~/.rollart/metadata.sqlite)"
    )
    status.add_argument("--job", default=None, help="only this job id (default: every job)")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument(
        "--local", action="store_true", help="read the local metadata store even when RAY_ADDRESS names a cluster"
    )
    status.set_defaults(func=cmd_status)
