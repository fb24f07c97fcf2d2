"""SampleBuffer: complete trajectory groups with their version stamps (seed 004 §5.3, seed 000 §4.3).

A group is the unit of a batch (GRPO normalises within it). ``get_batch`` blocks until ``n`` groups
that satisfy the asynchronous bound are in: a group begun under version ``s`` is usable at version
``v`` while ``v - s <= alpha``. Older groups are evicted and handed to ``on_stale`` so their prompts
go back to the queue — nothing is lost. The buffer's size is bounded by the scheduler's admission
control (seed 001: ``accepted + running <= (alpha + version + 1) * batch``), not by dropping data.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

from rollart.rollout.types import GroupId, Trajectory


class RolloutError(RuntimeError):
    """The rollout stopped on an error (its ``__cause__``); no batch can come any more."""


class Group(list[Trajectory]):
    """The kept trajectories of one round (a list), with the round's typed id ``gid``."""

    def __init__(self, trajectories: Iterable[Trajectory], gid: GroupId):
        super().__init__(trajectories)
        self.gid = gid

    def __reduce__(self) -> tuple:  # pickles (Ray) as the list and its id
        return (Group, (list(self), self.gid))


class SampleBuffer:
    def __init__(self, on_stale: Callable[[Group], None] | None = None):
        self._groups: deque[Group] = deque()
        self._cond = asyncio.Condition()
        self._on_stale = on_stale
        self.evicted_stale = 0
        self._error: BaseException | None = None

    def __len__(self) -> int:
        return len(self._groups)

    def groups(self) -> list[Group]:
        """The groups waiting to be trained on (a copy), oldest first."""
        return list(self._groups)

    @staticmethod
    def start_version(group: Group) -> int:
        return min(t.start_version for t in group)

    async def put(self, group: Group) -> None:
        async with self._cond:
            self._groups.append(group)
            self._cond.notify_all()

    def _evict_stale(self, version: int, alpha: int) -> None:
        keep: deque[Group] = deque()
        for g in self._groups:
            if version - self.start_version(g) > alpha:
                self.evicted_stale += 1
                if self._on_stale is not None:
                    self._on_stale(g)
            else:
                keep.append(g)
        self._groups = keep

    async def fail(self, err: BaseException) -> None:
        """The producer stopped on ``err``: waiting and later ``get_batch`` calls raise it."""
        async with self._cond:
            self._error = err
            self._cond.notify_all()

    async def get_batch(self, n: int, version: int, alpha: int) -> list[Group]:
        """The ``n`` oldest usable groups (FIFO), waiting for them; stale ones are evicted first.
        Raises ``RolloutError`` (with the cause) once the producer failed."""
        async with self._cond:
            while True:
                if self._error is not None:
                    raise RolloutError(f"rollout stopped: {type(self._error).__name__}: {self._error}") from self._error
                self._evict_stale(version, alpha)
                if len(self._groups) >= n:
                    return [self._groups.popleft() for _ in range(n)]
                await self._cond.wait()

    async def notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()
