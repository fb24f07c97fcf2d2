"""The cost ledger: what each trajectory cost in inference workers' time, env time and reward time.

:class:`BusyMeter` measures, per inference worker, the seconds it was busy (at least one request of the
LLMProxy in flight on it) and splits them among the requests in flight: over any interval in which ``n``
requests are in flight on a worker, each of them is charged ``1/n`` of the interval (processor sharing:
batched decoding serves the requests together, so none of them owns the worker). The shares of a
worker's requests therefore sum to its busy time, exactly. A worker's share times its accelerator
devices (0 for a CPU worker) is the request's device-seconds. A request moved to another worker after a
death is charged on both: the time on the dead one up to the death, then the time on the new one.

The LLMProxy charges a request's shares to the :class:`TrajectoryCost` its caller gave
(``LLMProxy.generate(..., cost=traj.cost)``); the shares of requests without one (evaluation, the policy
endpoint's streams) are counted as ``unattributed``. The EnvManager adds the env's and the reward's
seconds. Summing is :func:`cost_by`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field


class TrajectoryCost(BaseModel):
    """What one trajectory (one life: an episode) cost.

    ``worker_s``: per inference pool, its share of the pool's workers' busy seconds (the rule above);
    ``device_s``: the same weighted by each worker's accelerator devices (CPU workers count 0);
    ``env_s``: the env's reset and steps, wall-clock; ``reward_s``: the reward call, wall-clock;
    ``generate_calls``: worker calls it made (a migrated call counts once per worker)."""

    worker_s: dict[str, float] = Field(default_factory=dict)
    device_s: dict[str, float] = Field(default_factory=dict)
    env_s: float = 0.0
    reward_s: float = 0.0
    generate_calls: int = 0

    def fields(self) -> dict[str, Any]:
        """The trace's ``cost`` event fields."""
        return {
            "worker_s": {p: round(v, 6) for p, v in self.worker_s.items()},
            "device_s": {p: round(v, 6) for p, v in self.device_s.items()},
            "env_s": round(self.env_s, 6),
            "reward_s": round(self.reward_s, 6),
            "generate_calls": self.generate_calls,
        }


def cost_by(items: Iterable[tuple[str, TrajectoryCost]]) -> dict[str, dict[str, Any]]:
    """Sums of ``(key, cost)`` pairs per key: trajectories, ``worker_s`` and ``device_s`` per pool and in
    all, ``env_s``, ``reward_s``."""
    out: dict[str, dict[str, Any]] = {}
    for key, c in items:
        if key not in out:
            out[key] = empty_row()
        row = out[key]
        row["trajectories"] += 1
        for field in ("worker_s", "device_s"):
            for pool, v in getattr(c, field).items():
                row[field][pool] = row[field].get(pool, 0.0) + v
        row["device_s_total"] += sum(c.device_s.values())
        row["env_s"] += c.env_s
        row["reward_s"] += c.reward_s
    return out


def empty_row() -> dict[str, Any]:
    """A :func:`cost_by` row of no trajectory."""
    return {"trajectories": 0, "worker_s": {}, "device_s": {}, "device_s_total": 0.0, "env_s": 0.0, "reward_s": 0.0}


@dataclass
class _Worker:
    devices: int
    inflight: int = 0
    since: float = 0.0  # when ``share`` and ``busy_s`` were last brought up to date
    share: float = 0.0  # seconds a request in flight all along would have been charged so far
    busy_s: float = 0.0  # seconds with at least one request in flight
    busy_device_s: float = 0.0


class BusyMeter:
    """Per worker (rank) of one pool: its busy seconds, and each request's share of them.

    Every method is called from one thread (the LLMProxy's event loop). ``devices_of(rank)``: the
    worker's accelerator devices (read when the worker is first seen)."""

    def __init__(self, pool: str, devices_of: Callable[[int], int], clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.devices_of = devices_of
        self.clock = clock
        self._workers: dict[int, _Worker] = {}
        self._open: dict[str, tuple[int, float]] = {}  # request id -> (rank, the worker's share when it began)
        self._owed: dict[str, list[float]] = {}  # request id -> [worker_s, device_s, calls] not yet settled
        self.unattributed_s = 0.0
        self.unattributed_device_s = 0.0

    def _worker(self, rank: int, now: float) -> _Worker:
        w = self._workers.get(rank)
        if w is None:
            try:
                devices = int(self.devices_of(rank))
            except IndexError:  # a worker of an elastic pool that is gone
                devices = 0
            w = self._workers[rank] = _Worker(devices, since=now)
        elif w.inflight:
            dt = now - w.since
            w.share += dt / w.inflight
            w.busy_s += dt
            w.busy_device_s += dt * w.devices
        w.since = now
        return w

    def begin(self, request_id: str, rank: int) -> None:
        """``request_id`` is in flight on worker ``rank`` from now."""
        if request_id in self._open:
            self.end(request_id)
        w = self._worker(rank, self.clock())
        w.inflight += 1
        self._open[request_id] = (rank, w.share)

    def end(self, request_id: str) -> None:
        """``request_id`` left its worker (answered, failed, or the worker died): its share is owed to it."""
        opened = self._open.pop(request_id, None)
        if opened is None:
            return
        rank, mark = opened
        w = self._worker(rank, self.clock())
        w.inflight -= 1
        share = w.share - mark
        owed = self._owed.setdefault(request_id, [0.0, 0.0, 0])
        owed[0] += share
        owed[1] += share * w.devices
        owed[2] += 1

    def move(self, request_id: str, rank: int) -> None:
        """The request's worker died and the call went to ``rank``."""
        self.end(request_id)
        self.begin(request_id, rank)

    def settle(self, request_id: str, cost: TrajectoryCost | None) -> None:
        """Charge what ``request_id`` is owed to ``cost`` (``None``: counted as unattributed)."""
        self.end(request_id)
        owed = self._owed.pop(request_id, None)
        if owed is None:
            return
        if cost is None:
            self.unattributed_s += owed[0]
            self.unattributed_device_s += owed[1]
            return
        cost.worker_s[self.pool] = cost.worker_s.get(self.pool, 0.0) + owed[0]
        cost.device_s[self.pool] = cost.device_s.get(self.pool, 0.0) + owed[1]
        cost.generate_calls += int(owed[2])

    def busy(self) -> dict[str, Any]:
        """The pool's busy seconds so far (up to now, requests in flight included): ``worker_s``,
        ``device_s``, per rank ``by_rank``, and what no trajectory was charged (``unattributed_*``)."""
        now = self.clock()
        by_rank = {}
        for rank in sorted(self._workers):
            w = self._worker(rank, now)
            by_rank[rank] = {"worker_s": w.busy_s, "device_s": w.busy_device_s, "devices": w.devices}
        return {
            "pool": self.pool,
            "worker_s": sum(r["worker_s"] for r in by_rank.values()),
            "device_s": sum(r["device_s"] for r in by_rank.values()),
            "unattributed_worker_s": self.unattributed_s,
            "unattributed_device_s": self.unattributed_device_s,
            "by_rank": by_rank,
        }
