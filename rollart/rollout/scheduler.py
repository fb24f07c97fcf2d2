"""Rollout scheduling over EnvManager groups: env-level asynchrony, redundant env rollouts, dynamic
filtering and the admission control of the asynchronous bound (ROLL Flash §4.3, §5.1–5.2; SkyRL's fully-async docs).

``num_env_groups`` groups of ``group_size`` EnvManagers each run rounds on their own, never waiting
for other groups. In a round every member of a group plays the same seed; the round completes as soon
as ``group_keep`` members have finished successfully, and the rest of the round is aborted (redundant
rollouts: ``group_size > group_keep`` tolerates fail-slow/fail-stop envs inside a group,
``num_env_groups > batch_groups`` across groups). A complete group goes to the SampleBuffer unless
dynamic filtering drops it (all rewards equal: no learning signal). A round whose members fail too
often to reach ``group_keep`` is counted and retried with the same seed.

Admission (SkyRL's fully-async docs, "capacity"): a new round starts only while
``accepted + running < (alpha + version + 1) * batch_groups + extra_groups``, so generation never runs
more than ``alpha`` policy versions ahead; ``extra_groups = num_env_groups - batch_groups`` is the
redundancy slack. When the version advances, running rounds begun more than ``alpha`` versions ago
are aborted and their seeds retried (nothing is lost).

Per-task quotas (``quotas={tag: groups}``, RollArt paper §7.1): every batch holds exactly that many
groups of each task (an env group's task is its EnvManagers' ``tag``), and admission is per task:
task ``t`` starts a round only while ``accepted_t + running_t < (alpha + version + 1) * q_t + extra_t``
(``extra_t`` = its env groups beyond ``q_t``). A fast task therefore runs at most ``alpha`` versions
ahead of its own share and then waits, instead of filling the buffer while a slow task starves; its
finished groups beyond the current batch wait in the buffer (under the same bound) for a later one.

Faults: a group loop that stops on an error (e.g. no inference worker can serve any more) fails the
scheduler: ``get_batch`` raises ``RolloutError`` with that cause instead of waiting. So does a run of
``max_consecutive_failed_rounds`` rounds that all failed (with the last trajectory error).

Accounting (``counts``): every trajectory started is counted once when it ends, by status
(``trajectories_ok`` / ``_aborted`` / ``_failed`` / ``_reward_failed``); of the ok ones,
``trajectories_kept`` entered the buffer and ``trajectories_trained`` were handed to the trainer
(``trajectories_evicted``: kept, then evicted as stale and played again). Memory stays bounded: only
the last ``2 * num_env_groups * group_size`` ended trajectories are kept for inspection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from rollart.rollout.config import RolloutConfig
from rollart.rollout.env_manager import EnvManager
from rollart.rollout.failures import FailureLog
from rollart.rollout.ledger import RoundLedger, trajectory_ledger
from rollart.rollout.policy_clock import PolicyClock
from rollart.rollout.sample_buffer import Group, RolloutError, SampleBuffer
from rollart.rollout.types import GroupId, TraceSink, Trajectory

log = logging.getLogger(__name__)


class _Round:
    def __init__(self, group: int, index: int, seed: int, version: int):
        self.group, self.index, self.seed, self.start_version = group, index, seed, version
        self.aborted = False
        self.abort_reason = ""  # why it was aborted: stale (the asynchronous bound), stop, reward failure
        self.asked_at = time.time()  # when it asked for admission (its trajectories' ``created`` time)
        self.waited_s = 0.0  # how long admission held it (the asynchronous bound)
        self.held = False  # whether the asynchronous bound held it back
        self.kept: list[Trajectory] = []  # members ended ok so far (the round is completing)


class RolloutScheduler:
    """Runs the groups in the background of the caller's event loop."""

    def __init__(
        self,
        groups: list[list[EnvManager]],
        config: RolloutConfig,
        seed_fn: Callable[[int, int], int] | None = None,
        quotas: Mapping[str, int] | None = None,
        clock: PolicyClock | None = None,
    ):
        if len(groups) != config.num_env_groups or any(len(g) != config.group_size for g in groups):
            raise ValueError("RolloutScheduler: groups must be num_env_groups lists of group_size EnvManagers")
        self.groups = groups
        self.config = config
        # the task (tag) of every env group: its EnvManagers' tag
        self.task_of_group: list[str] = [str(getattr(g[0], "tag", "")) for g in groups]
        self.quotas: dict[str, int] | None = self._check_quotas(quotas) if quotas else None
        self.accepted_by_task: Counter[str] = Counter()
        self.counts_by_task: dict[str, Counter[str]] = {t: Counter() for t in dict.fromkeys(self.task_of_group)}
        self.staleness_by_task: dict[str, Counter[int]] = {t: Counter() for t in self.counts_by_task}
        self.seed_fn = seed_fn or (lambda g, r: config.seed_offset + g * 1_000_003 + r)
        self.clock = clock if clock is not None else PolicyClock()  # the run's: the served version is its
        self.buffer = SampleBuffer(on_stale=self._requeue_group)
        self.counts: Counter[str] = Counter()
        self.accepted = 0  # groups accepted (buffer + consumed) since the start, minus evicted ones
        self.held_back = 0  # rounds that had to wait at admission (the asynchronous bound), since the start
        self.running: dict[int, _Round] = {}
        self._retry: dict[int, deque[int]] = {g: deque() for g in range(config.num_env_groups)}
        self._next_round = [0] * config.num_env_groups
        self._failures: Counter[tuple[int, int]] = Counter()
        self._cond: asyncio.Condition | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        # the last trajectories that ended (bounded: nothing grows with the number of steps)
        self.completed_trajectories: deque[Trajectory] = deque(maxlen=2 * config.num_env_groups * config.group_size)
        self.staleness: Counter[int] = Counter()
        self.error: BaseException | None = None
        self.settled = RoundLedger(config.num_env_groups)  # rounds trained, filtered or given up
        self._failed_in_row = 0
        self._last_error = ""
        self.failures = FailureLog()  # the episodes' failures by kind, the first of each logged
        for group in groups:
            for manager in group:
                if hasattr(manager, "failures"):
                    manager.failures = self.failures
        self._notify_tasks: set[asyncio.Task] = set()
        self.in_flight = 0  # member episodes started and not ended (an independent count for the ledger)
        self.traces: TraceSink | None = None  # trajectory traces (rollart.tracking.traces), when on
        self.last_batch_version = 0  # the policy version the last batch was taken for

    @property
    def version(self) -> int:
        """The served policy version (the run's :class:`~rollart.rollout.policy_clock.PolicyClock`): new rounds
        begin at it and the asynchronous bound counts from it."""
        return self.clock.served

    def _trace(self, trajs: list[Trajectory], event: str, **fields: Any) -> None:
        """An event of each traced trajectory of ``trajs``."""
        sink = self.traces
        if sink is None:
            return
        now = time.time()
        for traj in trajs:
            if sink.wants(traj.traj_id):
                sink.emit(traj.traj_id, event, t=now, **fields)

    def _check_quotas(self, quotas: Mapping[str, int]) -> dict[str, int]:
        tasks = set(self.task_of_group)
        unknown, missing = sorted(set(quotas) - tasks), sorted(tasks - set(quotas))
        if unknown or missing:
            raise ValueError(
                f"RolloutScheduler quotas: tasks {unknown} have no env group and tasks {missing} have no quota "
                f"(the env groups' tags are {sorted(tasks)}); give every tag a quota"
            )
        if sum(quotas.values()) != self.config.batch_groups or any(q < 1 for q in quotas.values()):
            raise ValueError(
                f"RolloutScheduler quotas {dict(quotas)} must be >= 1 each and add up to "
                f"rollout.batch_groups={self.config.batch_groups}"
            )
        return dict(quotas)

    def task_of(self, group: Group) -> str:
        """The task (tag) of a buffered group: that of its env group."""
        return self.task_of_group[group.gid.env_group]

    def buffered_by_task(self) -> dict[str, int]:
        """Groups waiting in the buffer per task (those held back for later batches included)."""
        return dict(Counter(self.task_of(g) for g in self.buffer.groups()))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._cond = asyncio.Condition()
        self._tasks = [
            asyncio.get_running_loop().create_task(self._group_loop(g)) for g in range(self.config.num_env_groups)
        ]
        for t in self._tasks:
            t.add_done_callback(self._loop_done)

    def _loop_done(self, task: asyncio.Task) -> None:
        """A group loop ended: on an error, fail the scheduler so ``get_batch`` raises it."""
        if task.cancelled() or task.exception() is None:
            return
        self._fail(task.exception())  # type: ignore[arg-type]

    def _fail(self, err: BaseException) -> None:
        if self.error is not None:
            return
        self.error = err
        log.error("rollout stopped: %r", err)
        self._fail_task = asyncio.get_running_loop().create_task(self.buffer.fail(err))

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Abort every running round and end the group loops (each ends its round first, so every
        started trajectory is counted; ``timeout_s`` bounds the wait, then the loops are cancelled)."""
        self._stopping = True
        await self._abort_rounds(lambda r: True, "stop")
        if self._cond is not None:
            await self._notify()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # ------------------------------------------------------------------ admission
    def _capacity(self) -> int:
        c = self.config
        return (c.alpha + self.version + 1) * c.batch_groups + (c.num_env_groups - c.batch_groups)

    def _task_capacity(self, task: str) -> int:
        """Per-task admission (quotas): ``(alpha + version + 1) * q_t`` plus the task's spare env groups."""
        assert self.quotas is not None
        c, q = self.config, self.quotas[task]
        return (c.alpha + self.version + 1) * q + max(0, self.task_of_group.count(task) - q)

    def _full(self, group: int) -> bool:
        if self.quotas is None:
            return self.accepted + len(self.running) >= self._capacity()
        task = self.task_of_group[group]
        running = sum(1 for g in self.running if self.task_of_group[g] == task)
        return self.accepted_by_task[task] + running >= self._task_capacity(task)

    async def _admit(self, group: int) -> bool:
        """Wait until ``group`` may start a round; True when the asynchronous bound held it back."""
        assert self._cond is not None
        held = False
        async with self._cond:
            if self._full(group) and not self._stopping:
                self.held_back += 1  # generation ahead of training: held by the asynchronous bound
                held = True
            while self._full(group) and not self._stopping:  # stop() wakes the waiters: they end at once
                await self._cond.wait()
        return held

    async def _notify(self) -> None:
        assert self._cond is not None
        async with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ rounds
    def _requeue_group(self, group: Group) -> None:
        task = self.task_of(group)
        self.accepted -= 1
        self.accepted_by_task[task] -= 1
        for counts in (self.counts, self.counts_by_task[task]):
            counts["groups_evicted_stale"] += 1
            counts["trajectories_evicted"] += len(group)
        self._trace(list(group), "evicted", reason="stale in the buffer: begun more than alpha versions ago")
        self._retry[group.gid.env_group].appendleft(group.gid.round)
        if self._cond is not None:  # capacity freed: wake the group loops waiting for admission
            task_ref = asyncio.get_running_loop().create_task(self._notify())
            self._notify_tasks.add(task_ref)
            task_ref.add_done_callback(self._notify_tasks.discard)

    async def _group_loop(self, g: int) -> None:
        while not self._stopping:
            asked, asked_m = time.time(), time.monotonic()
            held = await self._admit(g)
            if self._stopping:
                break
            r = self._retry[g].popleft() if self._retry[g] else self._take_round(g)
            rnd = _Round(g, r, self.seed_fn(g, r), self.version)
            rnd.asked_at, rnd.waited_s, rnd.held = asked, time.monotonic() - asked_m, held
            self.running[g] = rnd
            try:
                kept = await self._run_round(rnd)
            finally:
                self.running.pop(g, None)
            if kept is None and not rnd.aborted and not self._stopping:
                self._failed_in_row += 1
                if self._failed_in_row >= self.config.max_consecutive_failed_rounds:
                    raise RolloutError(
                        f"{self._failed_in_row} rounds in a row failed (rollout.max_consecutive_failed_rounds); "
                        f"most frequent failure: {self.failures.cause() or self._last_error or 'none recorded'}"
                    )
            if kept is None:  # aborted (stale or stop) or failed: the same seed again
                if not self._stopping:
                    self._retry[g].appendleft(r)
                await self._notify()
                continue
            if not kept:  # a seed given up after repeated failures: counted, nothing to train on
                await self._notify()
                continue
            self._failures.pop((g, r), None)  # the round succeeded: its failures are forgotten
            task_counts = self.counts_by_task[self.task_of_group[g]]
            if self.config.filter_zero_variance and len({t.reward for t in kept}) == 1 and len(kept) > 1:
                self.counts["groups_filtered"] += 1
                task_counts["groups_filtered"] += 1
                self.counts["trajectories_filtered"] += len(kept)
                self._trace(kept, "filtered", reason="every reward of the group equal (rollout.filter_zero_variance)")
                self.settled.settle(g, r)
                await self._notify()  # the round left without a group: a slot is free
            else:
                self.accepted += 1
                self.accepted_by_task[self.task_of_group[g]] += 1
                for counts in (self.counts, task_counts):
                    counts["groups_accepted"] += 1
                    counts["trajectories_kept"] += len(kept)
                self._failed_in_row = 0
                # no _notify(): the round moved from running to accepted, so no slot was freed (waking
                # every waiting group loop to find that out costs O(groups) per round)
                self._trace(kept, "buffered")
                await self.buffer.put(Group(kept, GroupId(g, r)))

    def _ended(self, _task: asyncio.Future) -> None:
        self.in_flight -= 1

    def _take_round(self, g: int) -> int:
        r = self._next_round[g]
        self._next_round[g] += 1
        return r

    async def _run_round(self, rnd: _Round) -> list[Trajectory] | None:
        tasks = self._start_members(rnd)
        kept = rnd.kept
        pending = set(tasks)
        task_counts = self.counts_by_task[self.task_of_group[rnd.group]]
        try:
            while pending and len(kept) < self.config.keep and not rnd.aborted:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    self._member_ended(rnd, t.result(), task_counts)
        finally:
            if pending:  # redundant members of a complete round, or the round was aborted
                await self._end_members(rnd, tasks, pending, task_counts)
        return self._round_outcome(rnd)

    def _start_members(self, rnd: _Round) -> dict[asyncio.Task[Trajectory], EnvManager]:
        """Start an episode of every member of the round's group (traced ones announced); each task with
        its env manager."""
        members = self.groups[rnd.group]
        gid = str(GroupId(rnd.group, rnd.index))
        ids = [f"{gid}:{i}:v{rnd.start_version}" for i in range(len(members))]
        sink = self.traces
        traced = [sink if sink is not None and sink.wants(tid) else None for tid in ids]
        for i, (tid, s) in enumerate(zip(ids, traced)):
            if s is not None:
                task = self.task_of_group[rnd.group]
                s.emit(tid, "created", t=rnd.asked_at, tag=task, group=rnd.group, round=rnd.index, member=i)
                s.emit(
                    tid, "admitted", seed=rnd.seed, start_version=rnd.start_version, wait_s=rnd.waited_s, held=rnd.held
                )
        tasks = {
            asyncio.ensure_future(m.run(rnd.seed, gid, tid) if s is None else m.run(rnd.seed, gid, tid, trace=s)): m
            for m, tid, s in zip(members, ids, traced)
        }
        task_counts = self.counts_by_task[self.task_of_group[rnd.group]]
        self.counts["trajectories_started"] += len(tasks)
        task_counts["trajectories_started"] += len(tasks)
        self.in_flight += len(tasks)
        for t in tasks:
            t.add_done_callback(self._ended)
        return tasks

    def _member_ended(self, rnd: _Round, traj: Trajectory, task_counts: Counter[str]) -> None:
        """Count a member's trajectory while its round runs: kept when ok (and the round not aborted),
        else dropped or failed (a failed reward requeues the whole round when so configured)."""
        self.counts[f"trajectories_{traj.status}"] += 1
        task_counts[f"trajectories_{traj.status}"] += 1
        self.completed_trajectories.append(traj)
        if traj.error:
            self._last_error = f"{traj.traj_id}: {traj.error}"
        if traj.status == "ok" and not rnd.aborted:
            rnd.kept.append(traj)
        elif traj.status == "ok" or traj.status == "aborted":  # its round was aborted: played again
            if traj.status == "ok":
                self.counts["trajectories_dropped"] += 1
            why = f"round aborted ({rnd.abort_reason or 'stop'})" if rnd.aborted else "aborted"
            self._trace([traj], "dropped", reason=why)
        else:
            self._trace([traj], "failed", status=traj.status, error=traj.error)
            if traj.status == "reward_failed" and self.config.requeue_reward_failures:
                rnd.aborted = True  # the whole round is played again: no group trains without it
                rnd.abort_reason = "a member's reward failed (reward.on_failure: requeue)"
                self.counts["rounds_requeued_reward"] += 1

    async def _end_members(
        self,
        rnd: _Round,
        tasks: dict[asyncio.Task[Trajectory], EnvManager],
        pending: set[asyncio.Task[Trajectory]],
        task_counts: Counter[str],
    ) -> None:
        """Abort the members still running (redundant, or their round was aborted) and count what they
        return: kept while the round still misses members, else dropped."""
        kept = rnd.kept
        await asyncio.gather(*(tasks[t].abort() for t in pending))
        for late in await asyncio.gather(*pending, return_exceptions=True):
            if isinstance(late, Trajectory):
                self.counts[f"trajectories_{late.status}"] += 1
                task_counts[f"trajectories_{late.status}"] += 1
                self.completed_trajectories.append(late)
                if late.status == "ok" and len(kept) < self.config.keep and not rnd.aborted:
                    kept.append(late)
                elif late.status in ("ok", "aborted"):
                    if late.status == "ok":
                        self.counts["trajectories_dropped"] += 1  # redundant, or its round was aborted
                    why = f"round aborted ({rnd.abort_reason or 'stop'})" if rnd.aborted else "redundant"
                    self._trace([late], "dropped", reason=why)
                else:
                    self._trace([late], "failed", status=late.status, error=late.error)

    def _round_outcome(self, rnd: _Round) -> list[Trajectory] | None:
        """The group a finished round gives: its first ``keep`` members; None when it was aborted or
        failed (played again), ``[]`` when its seed failed too often (given up)."""
        kept = rnd.kept
        if rnd.aborted:
            self.counts["rounds_aborted"] += 1
            self.counts["trajectories_dropped"] += len(kept)
            self._trace(kept, "dropped", reason=f"round aborted ({rnd.abort_reason or 'stop'})")
            return None
        if len(kept) < self.config.keep:
            self.counts["rounds_failed"] += 1
            self.counts["trajectories_dropped"] += len(kept)
            self._trace(kept, "dropped", reason=f"round failed: {len(kept)} of {self.config.keep} members ended ok")
            self._failures[(rnd.group, rnd.index)] += 1
            if self._failures[(rnd.group, rnd.index)] >= self.config.max_round_failures:
                self.counts["seeds_given_up"] += 1
                log.warning(
                    "group %d seed round %d failed %d times; moving on",
                    rnd.group,
                    rnd.index,
                    self.config.max_round_failures,
                )
                self._failures.pop((rnd.group, rnd.index), None)
                self.settled.settle(rnd.group, rnd.index)
                return []  # counted, not retried again
            return None
        self.counts["trajectories_dropped"] += len(kept) - self.config.keep  # redundant members past keep
        self._trace(kept[self.config.keep :], "dropped", reason="redundant")
        return kept[: self.config.keep]

    async def _abort_rounds(self, which: Callable[[_Round], bool], reason: str) -> None:
        victims = [r for r in list(self.running.values()) if which(r)]
        for rnd in victims:
            rnd.aborted = True
            rnd.abort_reason = rnd.abort_reason or reason
        await asyncio.gather(*(m.abort() for rnd in victims for m in self.groups[rnd.group]))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a resumed scheduler needs to play the same rounds next: the next new round of every
        group, and the rounds to replay first — queued retries, then the rounds generated but not yet
        handed to the trainer (in the buffer) and the running ones (both are generated again). Plain
        ints, lists and dicts (loadable by ``torch.load(weights_only=True)`` and JSON)."""
        retry: dict[int, list[int]] = {g: list(q) for g, q in self._retry.items()}
        for grp in list(self.buffer.groups()):
            retry[grp.gid.env_group].insert(0, grp.gid.round)
        for g, rnd in self.running.items():
            retry[g].insert(0, rnd.index)
        # A scheduler resumed from this state plays those rounds again, so for it their trajectories that
        # started here (generated and buffered, running, or ended in a round being completed) are retried:
        # counted so, its trajectory ledger accounts for every one of them (none reads as lost)
        counts = Counter(self.counts)
        counts["trajectories_replayed_on_resume"] += (
            sum(len(g) for g in self.buffer.groups()) + self.in_flight + sum(len(r.kept) for r in self.running.values())
        )
        return {
            "num_env_groups": self.config.num_env_groups,
            "next_round": list(self._next_round),
            "retry": {g: sorted(set(rounds)) for g, rounds in retry.items() if rounds},
            "counts": dict(counts),
            "counts_by_task": {t: dict(c) for t, c in self.counts_by_task.items()},
            "settled": self.settled.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` into a scheduler that has not started."""
        if self._tasks:
            raise RuntimeError("RolloutScheduler.load_state_dict: call it before start()")
        n = self.config.num_env_groups
        saved = int(state.get("num_env_groups", len(state["next_round"])))
        if saved != n or len(state["next_round"]) != n:
            raise ValueError(
                f"scheduler checkpoint has {saved} env groups but rollout.num_env_groups={n}: resume "
                "with the configuration the checkpoint was written with"
            )
        self._next_round = [int(r) for r in state["next_round"]]
        self._retry = {g: deque() for g in range(n)}
        for g, rounds in state["retry"].items():  # JSON turns the int keys into strings
            self._retry[int(g)].extend(sorted({int(r) for r in rounds}))
        self.counts = Counter({str(k): int(v) for k, v in state["counts"].items()})
        for task, counts in (state.get("counts_by_task") or {}).items():
            if task in self.counts_by_task:
                self.counts_by_task[task] = Counter({str(k): int(v) for k, v in counts.items()})
        if "settled" in state:
            self.settled.load_state_dict(state["settled"])

    # ------------------------------------------------------------------ controller side
    async def get_batch(self, version: int | None = None) -> list[Group]:
        """``batch_groups`` groups within the asynchronous bound (blocking) of the policy ``version`` they
        train (default: the served version; the trainer's own when the served one lags, e.g. while
        workers still fetch it); with quotas, exactly ``quotas[t]`` groups of every task ``t``."""
        version = self.version if version is None else max(version, self.version)
        self.last_batch_version = version
        groups = await self.buffer.get_batch(
            self.config.batch_groups, version, self.config.alpha, quotas=self.quotas, task_of=self.task_of
        )
        for grp in groups:
            task = self.task_of(grp)
            stale = version - SampleBuffer.start_version(grp)
            self.staleness[stale] += 1
            self.staleness_by_task[task][stale] += 1
            self.counts["trajectories_trained"] += len(grp)
            self.counts_by_task[task]["trajectories_trained"] += len(grp)
            self.counts_by_task[task]["groups_trained"] += 1
            if not self.settled.settle(*grp.gid):
                self.counts["rounds_trained_twice"] += 1
                log.error("round %s handed to the trainer a second time", grp.gid)
        return groups

    def resume_at(self, version: int) -> None:
        """Before :meth:`start`: serve from policy ``version`` (a resumed or restored run), with admission
        counting the groups consumed so far as if ``version`` steps ran."""
        self.clock.serve(version)
        self.accepted = version * self.config.batch_groups

    def carry_counts(self, old: RolloutScheduler) -> None:
        """This scheduler replaces ``old`` after a trainer restore rewound the run to this one's state:
        the run's counters go on from ``old``'s, and what the rewind undid is counted (trajectories
        trained again later: ``trajectories_rolled_back``; ``old``'s buffered ones: dropped), not erased."""
        restored_trained = self.counts.get("trajectories_trained", 0)
        counts = old.counts.copy()
        counts["trajectories_rolled_back"] += old.counts.get("trajectories_trained", 0) - restored_trained
        counts["trajectories_dropped"] += sum(len(g) for g in old.buffer.groups())
        counts["trainer_restarts"] += 1
        self.counts = counts

    def audit_trained(self, trajs: list[Trajectory]) -> None:
        """Count what must never happen to the trajectories of one training batch: an id twice in it
        (across steps the round ledger catches a round trained twice) or a reward that is not real
        (status not ok, an error, no reward or not a finite number)."""
        ids = [t.traj_id for t in trajs]
        invented = sum(
            t.status != "ok" or bool(t.error) or t.reward is None or not math.isfinite(float(t.reward)) for t in trajs
        )
        self.counts["trajectories_trained_twice_in_step"] += len(ids) - len(set(ids))
        self.counts["rewards_invented"] += invented

    def ledger(self) -> dict[str, int]:
        """Every trajectory started, by where it went (:func:`~rollart.rollout.ledger.trajectory_ledger`)."""
        buffered = sum(len(g) for g in self.buffer.groups())
        return trajectory_ledger(self.counts, buffered=buffered, in_flight=self.in_flight)

    async def set_version(self, version: int) -> None:
        """The policy advanced: abort rounds that can no longer be trained on, admit new ones."""
        self.clock.serve(version)  # the proxy's workers serve it already, unless no weights move
        await self._abort_rounds(
            lambda r: version - r.start_version > self.config.alpha, f"stale: more than alpha versions behind {version}"
        )
        await self.buffer.notify()
        await self._notify()
