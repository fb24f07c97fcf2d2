"""``rollart scale JOB --pool POOL --devices N``: set the size of a running job's elastic pool.

The request goes into the Ray cluster's registry (``$RAY_ADDRESS``); the job's driver reads it on its next
poll (``elastic.poll_s``) and grows the pool toward ``N`` devices as matching ones come free, or drains
workers (the last joined first: no new request is routed to them, their requests in flight finish or
continue on other workers) and gives their devices back to the cluster and to queued ``rollart submit``
jobs. ``--wait SECONDS`` waits until the pool holds ``N`` devices. With ``elastic.autoscale`` the target
holds (the autopilot stands aside) until ``rollart scale JOB --pool POOL --auto`` hands the pool back. The pool must be elastic (a group with
``max_devices``) and ``N`` within its range; both are checked here, before anything is asked.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger(__name__)


def scale_problem(row: dict[str, Any] | None, job: str, pool: str, devices: int | None) -> str | None:
    """Why ``rollart scale`` cannot ask for this (None: it can), from the job's registry row; ``devices``
    None is ``--auto`` (hand the pool back to its autopilot)."""
    if row is None:
        return f"rollart scale: no job {job!r} in the cluster's registry; `rollart jobs` lists them"
    if row.get("ended_at") or row.get("state") in ("finished", "failed", "stopped"):
        return f"rollart scale: job {job!r} is {row.get('state') or 'ended'}; only a running job's pool can change"
    pools = row.get("elastic") or {}
    if pool not in pools:
        known = ", ".join(sorted(pools)) or "none"
        return (
            f"rollart scale --pool {pool}: pool {pool!r} of job {job!r} is not elastic (elastic pools: {known}); "
            "give a group of the pool max_devices in the job's config"
        )
    size = pools[pool]
    if devices is None:
        if "autopilot" not in size:
            return (
                f"rollart scale --auto: pool {pool!r} of job {job!r} has no autopilot; set elastic.autoscale in the "
                "job's config, or give the pool a size with --devices"
            )
        return None
    if devices < 1 or devices > int(size["max_devices"]):
        return f"rollart scale --devices {devices}: pool {pool!r} holds 1..{size['max_devices']} devices (max_devices)"
    return None


def cmd_scale(args: argparse.Namespace) -> int:
    if not os.environ.get("RAY_ADDRESS"):
        log.error("rollart scale: set RAY_ADDRESS to the cluster the job runs on (its registry carries the request)")
        return 2
    from rollart.cli.jobs import _with_registry

    def ask(registry: Any) -> int:
        rows = registry.jobs(args.job)
        row = rows[0] if rows else None
        problem = scale_problem(row, args.job, args.pool, args.devices)
        if problem is not None:
            log.error("%s", problem)
            return 2
        registry.request_scale(args.job, args.pool, args.devices)
        if args.devices is None:
            log.info("asked job %s to hand pool %s back to its autopilot", args.job, args.pool)
            return 0
        log.info("asked job %s to hold %d devices in pool %s", args.job, args.devices, args.pool)
        deadline = time.monotonic() + args.wait
        while args.wait > 0:
            size = ((registry.jobs(args.job) or [{}])[0].get("elastic") or {}).get(args.pool, {})
            if size.get("devices") == args.devices and not size.get("joining") and not size.get("draining"):
                sys.stdout.write(f"{args.pool}: {size['devices']}/{size['max_devices']} devices\n")
                return 0
            if time.monotonic() > deadline:
                log.error(
                    "pool %s of job %s holds %s devices after %.0fs (asked %d); it goes on trying",
                    args.pool,
                    args.job,
                    size.get("devices"),
                    args.wait,
                    args.devices,
                )
                return 1
            time.sleep(0.5)  # the driver applies the request on its own poll
        return 0

    return int(_with_registry(ask) or 0)


def add_scale_parser(sub: Any) -> None:
    p = sub.add_parser(
        "scale",
        help="set the size of a running job's elastic pool (grow into free devices, or drain and give them back)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("job", help="the job id (`rollart jobs` lists them)")
    p.add_argument("--pool", default="rollout", help="the elastic pool (a group with max_devices)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--devices", type=int, help="the devices the pool should hold (with elastic.autoscale: held until --auto)"
    )
    size.add_argument(
        "--auto",
        dest="devices",
        action="store_const",
        const=None,
        help="hand the pool back to its autopilot (elastic.autoscale) after a --devices target",
    )
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait until the pool holds them (0: return)")
    p.set_defaults(func=cmd_scale)
