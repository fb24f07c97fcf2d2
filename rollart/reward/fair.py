"""Fair slots: a fixed number of workers shared by tenants, so that one tenant's flood cannot take them all.

:class:`FairSlots` hands out ``capacity`` slots (the threads of a reward function's pool, the env
server's threads). A tenant holds at most ``per_tenant`` of them at once (by default all but one, so
one slot is always free for the others), and a freed slot goes to the waiting tenant that holds the
fewest (ties: the one whose oldest waiter has waited longest); a tenant's own waiters are served in
order. So a request of 16 slow trajectories takes at most ``per_tenant`` workers, and another tenant's
cheap trajectory runs at once on the slot kept free, or on the next slot freed.

A slot is held for as long as the work really runs: work in a thread releases its slot when the
thread's call returns (:meth:`FairSlots.release_soon`, from any thread), also after its request timed
out, so work that outlives its request is counted against the tenant that caused it until it ends.
Everything else runs on the event loop that created the waiters.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Tenant:
    held: int = 0
    waiters: deque[tuple[int, asyncio.Future[None]]] = field(default_factory=deque)


class FairSlots:
    """``capacity`` slots; ``per_tenant``: the most one tenant holds at once (None: ``capacity - 1``,
    at least 1)."""

    def __init__(self, capacity: int, per_tenant: int | None = None):
        if capacity < 1:
            raise ValueError(f"FairSlots: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.per_tenant = min(capacity, per_tenant if per_tenant is not None else max(1, capacity - 1))
        if self.per_tenant < 1:
            raise ValueError(f"FairSlots: per_tenant must be >= 1, got {per_tenant}")
        self.free = capacity
        self._tenants: dict[str, _Tenant] = {}
        self._order = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def acquire(self, tenant: str) -> None:
        """Wait for a slot of ``tenant``'s (cancelling the wait gives up the place in the queue)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        state = self._tenants.setdefault(tenant, _Tenant())
        fut: asyncio.Future[None] = loop.create_future()
        state.waiters.append((next(self._order), fut))
        self._dispatch()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: give the slot back
                self.release(tenant)
            else:
                state.waiters = deque(w for w in state.waiters if w[1] is not fut)
                self._forget(tenant)
                self._dispatch()
            raise

    def release(self, tenant: str) -> None:
        """Give back a slot of ``tenant``'s (on the event loop)."""
        state = self._tenants[tenant]
        state.held -= 1
        self.free += 1
        self._forget(tenant)
        self._dispatch()

    def release_soon(self, tenant: str) -> None:
        """:meth:`release` from any thread (a worker thread whose call returned)."""
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self.release, tenant)

    def held(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.held if state is not None else 0

    def waiting(self) -> int:
        """Acquisitions waiting for a slot, over all tenants."""
        return sum(len(s.waiters) for s in self._tenants.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{tenant: {"held": n, "waiting": m}}`` of the tenants holding or waiting for a slot."""
        return {t: {"held": s.held, "waiting": len(s.waiters)} for t, s in self._tenants.items()}

    def _forget(self, tenant: str) -> None:
        state = self._tenants.get(tenant)
        if state is not None and state.held == 0 and not state.waiters:
            del self._tenants[tenant]

    def _dispatch(self) -> None:
        while self.free > 0:
            ready = [
                (s.held, s.waiters[0][0], name)
                for name, s in self._tenants.items()
                if s.waiters and s.held < self.per_tenant
            ]
            if not ready:
                return
            _, _, name = min(ready)
            state = self._tenants[name]
            _, fut = state.waiters.popleft()
            if fut.done():  # cancelled while queued: its acquire cleans up
                continue
            state.held += 1
            self.free -= 1
            fut.set_result(None)
