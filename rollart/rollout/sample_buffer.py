"""SampleBuffer: complete trajectory groups with their version stamps (RollArt paper §5.3, ROLL Flash §4.3).

A group is the unit of a batch (GRPO normalises within it). ``get_batch`` blocks until ``n`` groups
that satisfy the asynchronous bound are in: a group begun under version ``s`` is usable at version
``v`` while ``v - s <= alpha``. Older groups are evicted and handed to ``on_stale`` so their prompts
go back to the queue — nothing is lost. The buffer's size is bounded by the scheduler's admission
control (SkyRL's fully-async docs: ``accepted + running <= (alpha + version + 1) * batch``), not by dropping data.

Per-task quotas (RollArt paper §7.1, a "domain batch size"): with ``quotas = {task: groups}`` a batch holds
exactly ``quotas[task]`` groups of each task, the oldest usable ones of that task; the groups of a
task that finishes faster than its share wait in the buffer for a later batch (still under the
asynchronous bound: evicted and replayed once too old). Without quotas a batch is the ``n`` oldest
usable groups (FIFO).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

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


TaskFn = Callable[[Group], str]


def select_batch(
    groups: Sequence[Group], n: int, quotas: Mapping[str, int] | None = None, task_of: TaskFn | None = None
) -> list[int] | None:
    """Positions in ``groups`` (oldest first) of the batch, or None while it cannot be filled: the first
    ``n`` groups, or with ``quotas`` the first ``quotas[t]`` groups of every task ``t`` (``task_of``
    names a group's task; groups of other tasks are never taken)."""
    if not quotas:
        return list(range(n)) if len(groups) >= n else None
    if task_of is None:
        raise ValueError("select_batch: quotas need task_of, the function naming a group's task")
    taken: Counter[str] = Counter()
    out: list[int] = []
    for i, grp in enumerate(groups):
        task = task_of(grp)
        if taken[task] < quotas.get(task, 0):
            taken[task] += 1
            out.append(i)
    return out if all(taken[t] >= q for t, q in quotas.items()) else None


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

    def try_take(
        self,
        n: int,
        version: int,
        alpha: int,
        quotas: Mapping[str, int] | None = None,
        task_of: TaskFn | None = None,
    ) -> list[Group] | None:
        """Evict the stale groups, then take the batch of :func:`select_batch` (oldest first), or
        None (nothing taken) while it cannot be filled."""
        self._evict_stale(version, alpha)
        picked = select_batch(self._groups, n, quotas, task_of)
        if picked is None:
            return None
        chosen = set(picked)
        batch = [self._groups[i] for i in picked]
        self._groups = deque(g for i, g in enumerate(self._groups) if i not in chosen)
        return batch

    async def get_batch(
        self,
        n: int,
        version: int,
        alpha: int,
        quotas: Mapping[str, int] | None = None,
        task_of: TaskFn | None = None,
    ) -> list[Group]:
        """The ``n`` oldest usable groups (FIFO) — with ``quotas`` the oldest ``quotas[t]`` of every task
        ``t`` — waiting for them; stale ones are evicted first. Raises ``RolloutError`` (with the
        cause) once the producer failed."""
        async with self._cond:
            while True:
                if self._error is not None:
                    raise RolloutError(f"rollout stopped: {type(self._error).__name__}: {self._error}") from self._error
                batch = self.try_take(n, version, alpha, quotas, task_of)
                if batch is not None:
                    return batch
                await self._cond.wait()

    async def notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()
