"""``rollart submit | jobs | logs | stop``: jobs on a shared Ray cluster, through Ray Jobs.

``rollart submit CONFIG`` sends ``rollart run CONFIG`` to the cluster's job agent with the config's
folder as the working directory (plus ``--module`` folders as ``py_modules``). The job's driver then
waits in the cluster's admission queue for its pools (:mod:`rollart.resource_manager.admission`), keeps
to ``--quota``, and is ordered by ``--priority`` then submit time. The Ray Jobs address is ``--address``,
else ``$RAY_JOBS_ADDRESS``, else port 8265 of the host that ``$RAY_ADDRESS`` names. ``rollart jobs`` reads
the queue states (pending/queued/running/finished/failed/stopped) from the cluster registry when
``$RAY_ADDRESS`` is set (``pending``: the driver has not joined the admission queue yet), and the Ray
Jobs status otherwise.

Where a submitted job's outputs go: Ray runs the job in a temporary copy of the config's folder, removed
when the job ends, so a relative ``output_dir`` is placed under ``$ROLLART_JOBS_DIR/<job id>/`` on the
driver's host instead (default ``~/rollart-jobs/<job id>/``; ``submit --jobs-dir`` sets it for one job);
an absolute one is kept. The driver records the folder in the cluster registry, and ``rollart jobs`` and
``rollart logs`` show it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DASHBOARD_PORT = 8265
SUBMITTED_JOB_ENV = "ROLLART_SUBMITTED_JOB"  # set by `rollart submit` in the job's environment: its id
JOBS_DIR_ENV = "ROLLART_JOBS_DIR"  # the folder submitted jobs write into (on the driver's host)
DEFAULT_JOBS_DIR = "~/rollart-jobs"


def jobs_dir() -> Path:
    """Where submitted jobs keep their outputs on this host: ``$ROLLART_JOBS_DIR``, else ``~/rollart-jobs``."""
    return Path(os.environ.get(JOBS_DIR_ENV) or DEFAULT_JOBS_DIR).expanduser().resolve()


def job_output_dir(out_dir: Path, environ: dict[str, str] | None = None) -> Path | None:
    """The persistent folder of a submitted job's relative ``out_dir``: ``jobs_dir()/JOB/out_dir``. None for
    a run that was not submitted, or an absolute ``out_dir`` (kept as given)."""
    env = os.environ if environ is None else environ
    job = env.get(SUBMITTED_JOB_ENV)
    if not job or out_dir.is_absolute():
        return None
    return jobs_dir() / job / out_dir


RAY_STATE = {
    "PENDING": "pending",
    "RUNNING": "running",
    "SUCCEEDED": "finished",
    "FAILED": "failed",
    "STOPPED": "stopped",
}


JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def submit_entrypoint(python: str, config_name: str, job_id: str, sets: list[str]) -> str:
    """The command line Ray Jobs runs for ``rollart submit``. Ray runs it through a shell, so every
    argument is quoted (:func:`shlex.join`): a value with ``$(...)``, backquotes, ``;`` or quotes reaches
    ``rollart run`` as it was typed and runs nothing. ``python`` may be several words (``uv run python``)."""
    try:
        interpreter = shlex.split(python)
    except ValueError as err:
        raise ValueError(f"--python {python!r}: {err}") from None
    if not interpreter:
        raise ValueError("--python: give the cluster's Python, e.g. --python python3")
    argv = [*interpreter, "-m", "rollart.cli", "run", config_name, "--set", f"cluster.job_id={job_id}"]
    for item in sets:
        argv += ["--set", item]
    return shlex.join(argv)


def jobs_address(explicit: str | None) -> str:
    """The Ray Jobs (dashboard) address: ``--address``, ``$RAY_JOBS_ADDRESS``, or the head of ``$RAY_ADDRESS``."""
    address = explicit or os.environ.get("RAY_JOBS_ADDRESS")
    if address:
        return address if "://" in address else f"http://{address}"
    ray_address = os.environ.get("RAY_ADDRESS")
    if ray_address and ray_address not in ("auto", "local"):
        host = ray_address.split("://")[-1].rsplit(":", 1)[0]
        return f"http://{host}:{DASHBOARD_PORT}"
    raise SystemExit("no Ray Jobs address: pass --address http://HEAD:8265, or set RAY_JOBS_ADDRESS or RAY_ADDRESS")


def _client(address: str | None) -> Any:
    from ray.job_submission import JobSubmissionClient

    from rollart.resource_manager.launcher import _token_auth_for_joining

    _token_auth_for_joining()
    return JobSubmissionClient(jobs_address(address))


def _with_registry(fn: Any) -> Any:
    """Run ``fn(registry)`` through a short-lived driver of ``$RAY_ADDRESS``'s cluster; None without one."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        return None
    import ray

    from rollart.resource_manager.launcher import _token_auth_for_joining
    from rollart.resource_manager.registry import ClusterRegistry

    _token_auth_for_joining()
    os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    ray.init(address=address, namespace="rollart-jobs", log_to_driver=False, logging_level=logging.WARNING)
    try:
        return fn(ClusterRegistry())
    finally:
        ray.shutdown()


def cmd_submit(args: argparse.Namespace) -> int:
    from rollart.config import ConfigError, load_config, parse_sets
    from rollart.resource_manager.admission import Admission, check_quota, parse_quota
    from rollart.resource_manager.launcher import new_job_id
    from rollart.resource_manager.specs import ResourceSpecError, parse_pools

    try:
        quota = parse_quota(args.quota)
    except ValueError as err:
        log.error("%s", err)
        return 2
    config = Path(args.config)
    if not config.is_file():
        log.error("rollart submit: %s is not a file; give the pipeline YAML to run on the cluster", config)
        return 2
    try:  # the config's own checks and the quota, here, before anything reaches the cluster
        cfg = load_config(str(config), parse_sets(args.set))
        asks: dict[str, float] = {}
        users: dict[str, list[str]] = {}
        for spec in parse_pools(cfg.pools).values():
            for g in spec.groups:
                asks[g.hardware] = asks.get(g.hardware, 0.0) + g.amount
                users.setdefault(g.hardware, []).append(spec.name)
        check_quota(asks, users, quota)
    except (ConfigError, ResourceSpecError) as err:
        log.error("%s", err)
        return 2
    job_id = args.name or new_job_id()
    if JOB_NAME.fullmatch(job_id) is None:
        log.error(
            "rollart submit --name %r: use 1-64 characters from [A-Za-z0-9_.-], starting with a letter or digit", job_id
        )
        return 2
    admission = Admission(quota=quota, priority=args.priority, submitted_at=time.time())
    try:
        entrypoint = submit_entrypoint(args.python, config.name, job_id, args.set)
    except ValueError as err:
        log.error("rollart submit %s", err)
        return 2
    env_vars = {
        **admission.env(),
        SUBMITTED_JOB_ENV: job_id,  # a relative output_dir goes under the jobs folder of the driver's host
        **({JOBS_DIR_ENV: args.jobs_dir} if args.jobs_dir else {}),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        # `rollart stop` ends the run as Ctrl-C does: the step in progress is cancelled, rewards in flight
        # are answered and counted, ledger.json and the registry are written, then the driver exits
        "RAY_JOB_STOP_SIGNAL": "SIGINT",
        "RAY_JOB_STOP_WAIT_TIME_S": os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "120"),
    }
    runtime_env: dict[str, Any] = {"working_dir": str(config.resolve().parent), "env_vars": env_vars}
    if args.module:
        runtime_env["py_modules"] = [str(Path(m).resolve()) for m in args.module]
    client = _client(args.address)
    submission = client.submit_job(
        entrypoint=entrypoint,
        submission_id=job_id,
        runtime_env=runtime_env,
        metadata={"rollart_job": job_id, "priority": str(args.priority), "quota": json.dumps(quota)},
    )
    log.info("submitted %s: %s", submission, entrypoint)
    where = Path(cfg.out_dir)
    log.info(
        "its outputs: %s on the driver's host (rollart jobs and rollart logs show the folder once it starts)",
        where
        if where.is_absolute()
        else f"{args.jobs_dir or '$' + JOBS_DIR_ENV + ' (default ' + DEFAULT_JOBS_DIR + ')'}/{job_id}/{where}",
    )
    sys.stdout.write(submission + "\n")
    return 0


def list_jobs(address: str | None) -> list[dict[str, Any]]:
    """Every rollart job the cluster's Ray Jobs knows, with its queue state from the registry."""
    client = _client(address)
    ray_jobs = {
        j.submission_id: j for j in client.list_jobs() if j.submission_id and (j.metadata or {}).get("rollart_job")
    }

    def read(registry: Any) -> dict[str, dict[str, Any]]:
        from rollart.resource_manager.admission import reap_dead_jobs

        reap_dead_jobs(registry)
        return {r["job_id"]: r for r in registry.jobs()}

    registry_rows = _with_registry(read)  # None without $RAY_ADDRESS: Ray's states only
    rows = registry_rows or {}
    out = []
    for sid, j in sorted(ray_jobs.items(), key=lambda kv: kv[1].start_time or 0):
        row = rows.get(sid, {})
        status = str(getattr(j.status, "value", j.status))
        state = RAY_STATE.get(status, status.lower())
        if state in ("pending", "running") and row.get("state"):  # the driver runs: the registry says
            state = row["state"]  # whether it is queued, admitted, or done with its resources and exiting
        elif state == "running" and registry_rows is not None:
            state = "pending"  # the driver runs but has not joined the admission queue yet
        out.append(
            {
                "job": sid,
                "state": state,
                "ray_status": status,
                "priority": int(j.metadata.get("priority", 0)),
                "quota": json.loads(j.metadata.get("quota", "{}")),
                "asks": row.get("asks"),
                "pools": row.get("elastic"),  # each elastic pool's size now: devices, max_devices, joining, draining
                "submitted_at": (j.start_time or 0) / 1000.0,
                "admitted_at": row.get("admitted_at"),
                "ended_at": row.get("ended_at") or ((j.end_time or 0) / 1000.0 or None),
                "output_dir": row.get("output_dir"),
                "driver_ip": row.get("driver_ip"),
                "message": j.message,
            }
        )
    return out


def cmd_jobs(args: argparse.Namespace) -> int:
    rows = list_jobs(args.address)
    if args.json:
        sys.stdout.write(json.dumps(rows, default=str) + "\n")
        return 0
    from rich.console import Console

    from rollart.cli.tables import Column, col, full_time, print_table, short_time

    short = [
        Column("job", col("job")),
        Column("state", col("state")),
        Column("prio", col("priority")),
        Column("asks", col("asks", _amounts), flex=True),
        Column("submitted", col("submitted_at", short_time)),
        Column("output", lambda r: output_location(r, short=True), flex=True),
    ]
    if any(r.get("pools") for r in rows):  # elastic pools: their size now, of their maximum
        short.insert(4, Column("pools", pool_sizes, flex=True))
    wide = [
        Column("quota", col("quota", _amounts)),
        *([] if any(r.get("pools") for r in rows) else [Column("pools", pool_sizes)]),
        Column("ended", col("ended_at", full_time)),
        Column("ray_status", col("ray_status")),
        Column("output_dir", output_location),
        Column("message", col("message")),
    ]
    print_table(Console(), "rollart jobs", rows, short, wide, show_wide=args.wide)
    return 0


def _amounts(value: Any) -> str:
    """``{"H800": 2, "CPU": 4}`` as ``H800:2 CPU:4``."""
    if not isinstance(value, dict):
        return "" if value is None else str(value)
    return " ".join(f"{k}:{v:g}" if isinstance(v, (int, float)) else f"{k}:{v}" for k, v in value.items())


def pool_sizes(row: dict[str, Any]) -> str:
    """Each elastic pool's devices now and its maximum (``rollout 3/8``; ``+1 joining``, ``-1 draining``; with an
    autopilot its target: ``(autopilot 4)``, ``(manual 2; --auto hands back)``)."""
    parts = []
    for pool, size in sorted((row.get("pools") or {}).items()):
        text = f"{pool} {size.get('devices')}/{size.get('max_devices')}"
        if size.get("joining"):
            text += f" +{size['joining']} joining"
        if size.get("draining"):
            text += f" -{size['draining']} draining"
        pilot = size.get("autopilot")
        if pilot is not None:  # elastic.autoscale: whose target the pool follows
            if pilot.get("manual") is not None:
                text += f" (manual {pilot['manual']}; --auto hands back)"
            elif pilot.get("yielding"):
                text += f" (autopilot {pilot.get('target')}, yielding to a queued job)"
            else:
                text += f" (autopilot {pilot.get('target')})"
        parts.append(text)
    return ", ".join(parts)


def output_location(row: dict[str, Any], short: bool = False) -> str:
    """``HOST:FOLDER`` of a job's outputs, as its driver recorded them; a note while it has not started
    (``short``: just ``(not started)``)."""
    folder = row.get("output_dir")
    if not folder:
        if short:
            return "(not started)"
        return "(not started: under $ROLLART_JOBS_DIR or ~/rollart-jobs on the driver's host)"
    return f"{row['driver_ip']}:{folder}" if row.get("driver_ip") else str(folder)


def cmd_logs(args: argparse.Namespace) -> int:
    client = _client(args.address)
    rows = _with_registry(lambda registry: registry.jobs(args.job)) or []
    if rows:  # where its files are, on stderr (stdout stays the driver's output)
        sys.stderr.write(f"rollart job {args.job}: outputs in {output_location(rows[0])}\n")
    if not args.follow:
        sys.stdout.write(client.get_job_logs(args.job))
        return 0

    async def follow() -> None:
        async for chunk in client.tail_job_logs(args.job):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    asyncio.run(follow())
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """Stop the job's driver (its placement groups and actors go with it), wait until Ray says it ended,
    then mark it stopped in the registry so the queue moves on."""
    client = _client(args.address)
    client.stop_job(args.job)
    deadline = time.monotonic() + args.timeout
    while not client.get_job_status(args.job).is_terminal():
        if time.monotonic() > deadline:
            log.error("job %s did not end within %.0fs after the stop request", args.job, args.timeout)
            return 1
        time.sleep(0.5)
    _with_registry(lambda registry: registry.end_job(args.job, state="stopped") if registry.jobs(args.job) else None)
    log.info("stopped %s", args.job)
    return 0


def add_job_parsers(sub: Any) -> None:
    address_help = "Ray Jobs address (default $RAY_JOBS_ADDRESS, else http://<host of $RAY_ADDRESS>:8265)"
    p = sub.add_parser("submit", help="submit a pipeline config as a job to a shared Ray cluster")
    p.add_argument("config", help="pipeline YAML; its folder becomes the job's working directory")
    p.add_argument("--quota", default=None, help="most devices per hardware type, e.g. H800=2,H20=4")
    p.add_argument("--priority", type=int, default=0, help="higher is admitted first (then submit time)")
    p.add_argument("--name", default=None, help="job id (default rollart-<random>); also the Ray job id")
    p.add_argument("--address", default=None, help=address_help)
    p.add_argument(
        "--module",
        action="append",
        default=[],
        help="a folder of your modules to ship with the job (py_modules); repeatable",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted for nested keys); repeatable",
    )
    p.add_argument("--python", default="python", help="the Python on the cluster that runs rollart")
    p.add_argument(
        "--jobs-dir",
        default=None,
        help="folder on the driver's host for the job's outputs (a relative output_dir goes under "
        "JOBS_DIR/JOB); default: $ROLLART_JOBS_DIR of the cluster, else ~/rollart-jobs",
    )
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", help="the shared cluster's rollart jobs and their states")
    p.add_argument("--address", default=None, help=address_help)
    p.add_argument("--json", action="store_true", help="print JSON (every field)")
    p.add_argument(
        "--wide", action="store_true", help="every column (long cells wrap); by default the short ones, one line each"
    )
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("logs", help="a submitted job's driver output")
    p.add_argument("job", help="the job id (the --name of rollart submit)")
    p.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--address", default=None, help=address_help)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="stop a submitted job and free its resources")
    p.add_argument("job", help="the job id (the --name of rollart submit)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds to wait for the job to end")
    p.add_argument("--address", default=None, help=address_help)
    p.set_defaults(func=cmd_stop)
