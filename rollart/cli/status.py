"""``rollart status [--store FILE] [--job ID] [--json] [--local]``: jobs, pools, worker bindings and
endpoints, from the Ray cluster's registry or the local metadata store; the GPUs Ray detects on this
machine (what a local ``rollart run`` declares), or each node's GPUs and logical devices."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollart.cli.tables import Column

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


def _job_state(job: dict[str, Any]) -> str:
    """A job's state as a word: the recorded one, else running / ended from its times and driver."""
    if job.get("state"):
        return str(job["state"])
    if job.get("ended_at"):
        return "ended"
    return "running" if job.get("driver_alive") is not False else "driver gone"


def _alive(value: Any) -> str:
    return "yes" if value is True else "no" if value is False else "unknown (another host)"


def _ids(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(d) for d in value) or "-"
    return "" if value is None else str(value)


def _node(row: dict[str, Any]) -> str:
    """A worker's node: its IP (the cluster registry has it), else the start of its Ray node id."""
    return str(row.get("node_ip") or (row.get("node_id") or "")[:8])


def _size(row: dict[str, Any]) -> str:
    """A pool group's size: ``4 CPUs``, ``2`` devices, or ``2/8`` (elastic: now / at most), with the autopilot's
    target where one sizes the pool (``2/8 (autopilot 4)``, ``2/8 (manual 2)``)."""
    if row.get("devices") is None:
        cpus = row.get("cpus")
        return "" if cpus is None else f"{float(cpus):g} CPU" + ("s" if float(cpus) != 1 else "")
    size = f"{row['devices']}/{row['max_devices']}" if row.get("max_devices") else str(row["devices"])
    pilot = row.get("autopilot")
    if row.get("max_devices") and isinstance(pilot, dict):
        size += f" (manual {pilot['manual']})" if pilot.get("manual") is not None else f" (autopilot {pilot['target']})"
    return size


def _with_autopilots(state: dict[str, Any]) -> None:
    """Each elastic pool row gets its job's autopilot (the job's registry row publishes it), if any."""
    elastic = {j.get("job_id"): j.get("elastic") or {} for j in state.get("jobs", [])}
    for row in state.get("pools", []):
        pilot = (elastic.get(row.get("job_id")) or {}).get(row.get("pool"), {}).get("autopilot")
        if pilot is not None:
            row["autopilot"] = pilot


def _print_tables(state: dict[str, Any], where: str, wide: bool = False) -> None:
    """The state as tables of short columns (``wide``: every column), readable at 80 columns."""
    from rich.console import Console

    from rollart.cli.tables import Column, col, print_table

    console = Console(soft_wrap=True)  # a long line is the terminal's to wrap; table rows fit (cli.tables)
    console.print(where)
    _with_autopilots(state)
    _print_machines(console, state)
    job = Column("job", col("job_id"))
    tables = [
        _jobs_table(state["jobs"], job),
        _pools_table(state["pools"], job),
        _workers_table(state["bindings"], job),
        _endpoints_table(state["endpoints"], job),
        _runs_table(state.get("runs", []), job),
    ]
    for title, rows, short, more in tables:
        print_table(console, title, rows, short, more, show_wide=wide)


def _print_machines(console: Any, state: dict[str, Any]) -> None:
    """The GPUs Ray detects on this machine, or each node's GPUs and logical devices."""
    if "gpus" in state:
        console.print(f"GPUs on this machine (Ray's detection, declared by a local run): {state['gpus']['detected']}")
    for node in state.get("nodes", []):
        gpu_types = f" ({', '.join(node['gpu_types'])})" if node["gpu_types"] else ""
        logical = ", ".join(f"{t} x{n:g}" for t, n in node["logical"].items()) or "none"
        console.print(f"node {node['node_ip']}: {node['gpus']:g} GPU{gpu_types}; logical devices: {logical}")


# a table: its title, its rows, its short columns and the columns --wide adds
_Table = tuple[str, list[dict[str, Any]], list["Column"], list["Column"]]


def _jobs_table(rows: list[dict[str, Any]], job: Column) -> _Table:
    from rollart.cli.tables import Column, col, full_time, short_path, short_time

    short = [
        job,
        Column("name", col("name"), flex=True),
        Column("state", _job_state),
        Column("started", col("started_at", short_time)),
        Column("folder", col("output_dir", short_path), flex=True),
    ]
    more = [
        Column("driver_pid", col("driver_pid")),
        Column("driver_alive", col("driver_alive", _alive)),
        Column("ray_address", col("ray_address")),
        Column("ended", col("ended_at", full_time)),
        Column("output_dir", col("output_dir")),
    ]
    return "jobs", rows, short, more


def _pools_table(rows: list[dict[str, Any]], job: Column) -> _Table:
    from rollart.cli.tables import Column, col

    short = [
        job,
        Column("pool", col("pool")),
        Column("hardware", col("hardware")),
        Column("size", _size),
        Column("state", col("state")),
    ]
    more = [
        Column("group", col("group_index")),
        Column("devices", col("devices")),
        Column("max_devices", col("max_devices")),
    ]
    return "pools", rows, short, more


def _workers_table(rows: list[dict[str, Any]], job: Column) -> _Table:
    from rollart.cli.tables import Column, col

    short = [
        job,
        Column("cluster", col("cluster"), flex=True),
        Column("rank", col("rank")),
        Column("hardware", col("hardware")),
        Column("node", _node, flex=True),
        Column("gpus", col("device_ids", _ids)),
        Column("state", col("state")),
    ]
    more = [Column("pool", col("pool")), Column("node_id", col("node_id")), Column("slots", col("slot_ids", _ids))]
    return "workers", rows, short, more


def _endpoints_table(rows: list[dict[str, Any]], job: Column) -> _Table:
    from rollart.cli.tables import Column, col

    short = [
        job,
        Column("cluster", col("cluster"), flex=True),
        Column("method", col("method")),
        Column("url", col("url"), flex=True),
    ]
    return "endpoints", rows, short, [Column("timeout_s", col("timeout_s")), Column("retries", col("retries"))]


def _runs_table(rows: list[dict[str, Any]], job: Column) -> _Table:
    from rollart.cli.tables import Column, col, short_time

    short = [
        job,
        Column("#", col("attempt")),
        Column("started", col("started_at", short_time)),
        Column("ended", col("ended_at", short_time)),
        Column("status", col("status")),
        Column("cause", col("cause"), flex=True),
    ]
    return "runs", rows, short, [Column("driver_pid", col("driver_pid"))]


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
    _print_tables(state, where, wide=args.wide)
    return 0


def add_status_parser(sub: Any) -> None:
    status = sub.add_parser(
        "status",
        help="jobs (name, state, folder), pools, workers and endpoints (of the Ray cluster with RAY_ADDRESS, "
        "else this machine's)",
    )
    status.add_argument(
        "--store", default=None, help="metadata store file (default $ROLLART_METADATA_DB or ~/.rollart/metadata.sqlite)"
    )
    status.add_argument("--job", default=None, help="only this job id (default: every job)")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables (every field)")
    status.add_argument(
        "--wide", action="store_true", help="every column (long cells wrap); by default the short ones, one line each"
    )
    status.add_argument(
        "--local", action="store_true", help="read the local metadata store even when RAY_ADDRESS names a cluster"
    )
    status.set_defaults(func=cmd_status)
