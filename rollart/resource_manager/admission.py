"""Admission of jobs on a shared Ray cluster: quotas, and a queue ordered by priority then arrival.

A job started by ``rollart submit`` carries its admission settings in its environment
(``ROLLART_ADMISSION=queue``, ``ROLLART_QUOTA`` as JSON ``{"H800": 2}``, ``ROLLART_PRIORITY``,
``ROLLART_SUBMITTED_AT``). Its driver waits here, in the :class:`~rollart.resource_manager.ResourceManager`,
before any placement group or actor exists:

1. the pools are checked against the quota (no hardware type above it) and the cluster's totals (a job
   that can never fit fails now instead of waiting forever), with errors naming the field;
2. under the registry's admission lock (a GCS KV key written only if absent, so two drivers never
   admit at once), the job's row in the cluster registry (:mod:`rollart.resource_manager.registry`)
   becomes ``queued`` with what it asks per hardware type (the first time: until then ``rollart jobs``
   lists the job as ``pending``);
3. under the same lock hold, and on every poll after it, the driver marks the rows of dead Ray jobs ``failed`` (their placement groups went
   with their driver), then walks the queue by (priority descending, submit time): each job that fits
   what running jobs leave free is admitted, the first that does not fit stops the walk (no job
   overtakes a waiting one of higher rank). If this job is admitted its row becomes ``running``;
   otherwise it logs once where it stands and polls again.

Free resources are the cluster's totals minus what running jobs' rows ask, not Ray's momentary free
counts: a job admitted a moment ago has not placed its groups yet, a finished one's may still be
going away (placement then waits for them, ``ready_timeout_s``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollart.resource_manager.specs import ResourceSpecError

log = logging.getLogger(__name__)

LOCK = "admission"
ACTIVE = ("running",)
ENDED = ("finished", "failed", "stopped")


def parse_quota(text: str | None) -> dict[str, float]:
    """``"H800=2,H20=4"`` -> ``{"H800": 2.0, "H20": 4.0}``; errors say what to write."""
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        hw, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not hw.strip() or value < 0:
            raise ValueError(f"--quota {item!r}: write HARDWARE=COUNT[,HARDWARE=COUNT...], e.g. --quota H800=2,H20=4")
        out[hw.strip()] = value
    return out


@dataclass
class Admission:
    """A submitted job's admission settings: quota per hardware type (absent = no limit), priority."""

    quota: dict[str, float] = field(default_factory=dict)
    priority: int = 0
    submitted_at: float | None = None
    poll_s: float = 1.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Admission | None:
        env = os.environ if env is None else env
        if env.get("ROLLART_ADMISSION") != "queue":
            return None
        at = env.get("ROLLART_SUBMITTED_AT")
        return cls(
            quota={k: float(v) for k, v in json.loads(env.get("ROLLART_QUOTA") or "{}").items()},
            priority=int(env.get("ROLLART_PRIORITY") or 0),
            submitted_at=float(at) if at else None,
        )

    def env(self) -> dict[str, str]:
        """The environment that makes a driver wait for admission with these settings."""
        out = {
            "ROLLART_ADMISSION": "queue",
            "ROLLART_QUOTA": json.dumps(self.quota),
            "ROLLART_PRIORITY": str(self.priority),
        }
        if self.submitted_at is not None:
            out["ROLLART_SUBMITTED_AT"] = repr(self.submitted_at)
        return out


def check_quota(asks: Mapping[str, float], users: Mapping[str, list[str]], quota: Mapping[str, float]) -> None:
    """Raise naming the pools and the field when the job asks more of a hardware type than its quota."""
    for hw, need in asks.items():
        if hw in quota and need > quota[hw] + 1e-9:
            raise ResourceSpecError(
                f"pools {users.get(hw, [])} ask for {need:g} {hw} but the job's quota is {quota[hw]:g}; lower "
                f"pools.<name>.devices (or cpus) or submit with a larger --quota {hw}=N"
            )


def check_fits_ever(asks: Mapping[str, float], totals: Mapping[str, float]) -> None:
    for hw, need in asks.items():
        if need > totals.get(hw, 0.0) + 1e-9:
            raise ResourceSpecError(
                f"the job asks for {need:g} {hw} but the whole cluster has {totals.get(hw, 0.0):g}: it would "
                f"wait forever; lower pools.<name>.devices or add {hw} hardware"
            )


def queue_order(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Queued rows by priority (highest first), then submit time, then job id."""
    queued = [r for r in rows if r.get("state") == "queued"]
    return sorted(queued, key=lambda r: (-int(r.get("priority") or 0), float(r.get("submitted_at") or 0), r["job_id"]))


def admissible(rows: list[dict[str, Any]], totals: Mapping[str, float]) -> list[str]:
    """The queued jobs to admit now, in queue order: each while it fits what running jobs leave free;
    the first that does not fit ends the walk."""
    free = dict(totals)
    for r in rows:
        if r.get("state") in ACTIVE:
            for hw, n in (r.get("asks") or {}).items():
                free[hw] = free.get(hw, 0.0) - float(n)
    out = []
    for r in queue_order(rows):
        asks = {hw: float(n) for hw, n in (r.get("asks") or {}).items()}
        if any(n > free.get(hw, 0.0) + 1e-9 for hw, n in asks.items()):
            break
        for hw, n in asks.items():
            free[hw] = free.get(hw, 0.0) - n
        out.append(r["job_id"])
    return out


def reap_dead_jobs(registry: Any) -> list[str]:
    """Mark queued/running rows whose Ray job is dead as ``failed`` and release their pools; return them.
    (Their placement groups and actors went with their driver.)"""
    from ray._private import state

    dead = {j["JobID"] for j in state.jobs() if j.get("IsDead")}
    reaped = []
    for row in registry.jobs():
        if row.get("state") in ("queued", "running") and row.get("ray_job_id") in dead:
            registry.end_job(row["job_id"], state="failed")
            reaped.append(row["job_id"])
    if reaped:
        log.info("jobs %s: their drivers are gone; marked ended and their resources released", reaped)
    return reaped


def wait_for_admission(
    registry: Any, job_id: str, asks: Mapping[str, float], users: Mapping[str, list[str]], admission: Admission
) -> None:
    """Queue ``job_id`` in the registry and return once it is admitted (see the module docstring)."""
    import ray

    from rollart.resource_manager.capacity import read_capacity

    check_quota(asks, users, admission.quota)
    totals = {hw: cap.total for hw, cap in read_capacity().items()}
    check_fits_ever(asks, totals)
    row = {
        "state": "queued",
        "asks": dict(asks),
        "quota": admission.quota,
        "priority": admission.priority,
        "submitted_at": admission.submitted_at or time.time(),
        "ray_job_id": ray.get_runtime_context().get_job_id(),
        "ended_at": None,
    }
    said = None
    queued = False
    while True:
        if registry.try_lock(LOCK, job_id):
            try:
                if not queued:  # the row is written under the lock that also decides its first admission:
                    registry.update_job(job_id, **row)  # a job admitted at once is never seen as queued
                    queued = True
                reap_dead_jobs(registry)
                rows = registry.jobs()
                if job_id in admissible(rows, totals):
                    registry.update_job(job_id, state="running", admitted_at=time.time())
                    log.info("job %s admitted (asks %s, quota %s)", job_id, dict(asks), admission.quota or "none")
                    return
            finally:
                registry.unlock(LOCK, job_id)
            order = [r["job_id"] for r in queue_order(rows)]
            running = sorted(r["job_id"] for r in rows if r.get("state") in ACTIVE)
            where = (order.index(job_id) + 1 if job_id in order else 0, tuple(running))
            if where != said:
                log.info(
                    "job %s queued at position %d (priority %d): waits for %s to free up; running: %s",
                    job_id,
                    where[0],
                    admission.priority,
                    dict(asks),
                    ", ".join(running) or "none",
                )
                said = where
        time.sleep(admission.poll_s)
