"""``ClusterFuture``: the result of a ``blocking=False`` Cluster call (or of any async-method call).

``.result(timeout)`` blocks; ``await future`` suspends the caller's event loop. Either way the
per-rank results are gathered in rank order and passed through the call's collect function; a dead
worker surfaces as :class:`WorkerDiedError` naming the cluster, rank and hardware.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import ray
from ray import ObjectRefGenerator
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

T = TypeVar("T")

ACTOR_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)


class _Skipped:
    """What ``on_dead`` returns to drop a dead rank from the call (its result is left out)."""

    def __repr__(self) -> str:
        return "SKIPPED"


SKIPPED: Any = _Skipped()


def _streamed(items: list[ray.ObjectRef], get: Callable[[ray.ObjectRef], Any]) -> list[ray.ObjectRef]:
    """The item refs of a streamed call (see ``rollart.cluster.worker``): all but the last, which marks
    its end; ``get`` of that last one raises what ended the call early."""
    if not items:
        raise RuntimeError("a streamed call ended without its end marker")
    get(items[-1])
    return items[:-1]


class ClusterFuture(Generic[T]):
    """Pending per-rank calls. ``on_dead(rank, err)`` converts a dead-actor error (and may reroute:
    returning a new ``ObjectRef`` retries the call there; returning ``SKIPPED`` leaves the rank's
    result out of the collected answer)."""

    def __init__(
        self,
        calls: list[tuple[int, ray.ObjectRef]],
        collect: Callable[[list[Any]], T],
        on_dead: Callable[[int, BaseException], ray.ObjectRef | tuple[int, ray.ObjectRef]],
    ):
        self._calls = calls
        self._collect = collect
        self._on_dead = on_dead
        # calls sent again to another rank after theirs died: (dead rank, its error, Unix time, new rank)
        self.reroutes: list[tuple[int, BaseException, float, int]] = []
        # told ``(dead rank, new rank)`` when a call is sent again (the LLMProxy's cost ledger)
        self.on_reroute: Callable[[int, int], None] | None = None

    @property
    def refs(self) -> list[ray.ObjectRef]:
        """One per call: its result's ref, or for a streamed call the ref that is ready when it ended."""
        return [ref.completed() if isinstance(ref, ObjectRefGenerator) else ref for _, ref in self._calls]

    @property
    def ranks(self) -> list[int]:
        return [rank for rank, _ in self._calls]

    def done(self) -> bool:
        ready, _ = ray.wait(self.refs, num_returns=len(self._calls), timeout=0)
        return len(ready) == len(self._calls)

    def _get_one(self, rank: int, ref: Any, timeout: float | None) -> Any:
        while True:
            try:
                if isinstance(ref, ObjectRefGenerator):
                    return _streamed(list(ref), ray.get)
                return ray.get(ref, timeout=timeout)
            except ACTOR_GONE as err:
                nxt = self._retry(rank, err)
                if nxt is SKIPPED:
                    return SKIPPED
                rank, ref = nxt

    def _retry(self, rank: int, err: BaseException) -> Any:
        nxt = self._on_dead(rank, err)  # raises WorkerDiedError when it cannot reroute
        if nxt is SKIPPED:
            return SKIPPED
        nxt = nxt if isinstance(nxt, tuple) else (rank, nxt)
        self.reroutes.append((rank, err, time.time(), nxt[0]))
        if self.on_reroute is not None:
            self.on_reroute(rank, nxt[0])
        return nxt

    def _finish(self, values: list[Any]) -> T:
        return self._collect([v for v in values if v is not SKIPPED])

    def result(self, timeout: float | None = None) -> T:
        return self._finish([self._get_one(rank, ref, timeout) for rank, ref in self._calls])

    async def _await_one(self, rank: int, ref: Any) -> Any:
        while True:
            try:
                if isinstance(ref, ObjectRefGenerator):
                    items = [item async for item in ref]
                    if items:
                        await items[-1]  # raises what ended the call early
                    return _streamed(items, lambda r: None)
                return await ref
            except ACTOR_GONE as err:
                nxt = self._retry(rank, err)
                if nxt is SKIPPED:
                    return SKIPPED
                rank, ref = nxt

    async def _await_all(self) -> T:
        values = await asyncio.gather(*(self._await_one(rank, ref) for rank, ref in self._calls))
        return self._finish(list(values))

    def __await__(self) -> Generator[Any, None, T]:
        return self._await_all().__await__()
