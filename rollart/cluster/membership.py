"""Which workers of a cluster serve: one state per rank, changed only through the transitions below.

A rank's :class:`WorkerState` says whether it takes calls:

```
STARTING ──▶ SERVING ◀──▶ DRAINING ──▶ RETIRED
   │  JOINING ──▶ SERVING            (an elastic pool's new rank, or a restart loading the served weights)
   │  SERVING / DRAINING ──▶ DEAD ──▶ RESTARTING ──▶ JOINING ──▶ SERVING
   │                          └──▶ REMOVED                        (its restart policy is spent)
   └──▶ (any) ──▶ STOPPED                                         (the cluster shut down)
```

Routed calls (``@hw_mapping``, the LLMProxy's) go to ``SERVING`` ranks only; control calls (``@register``)
reach ``SERVING`` and ``DRAINING`` ranks (:attr:`WorkerState.alive`). Fault supervision
(:mod:`rollart.cluster.fault`), elastic growth and drain (:mod:`rollart.rollout.elastic`), trainer recovery
and the proxy's loader ask the cluster for a transition (``restart_worker``, ``mark_alive``,
``set_draining``, ``retire_worker``, ...); :class:`Membership` checks it against :data:`TRANSITIONS`, records
it, and wakes whoever waits on the states (a routed call waiting for a serving rank, a drain waiting
for a rank's calls to end). A rank asked to drain keeps that wish through a death and a restart: it comes
back ``DRAINING``.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rollart.cluster.worker import WorkerStart
from rollart.resource_manager.manager import ReservedGroup

log = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    """Where a rank is in its life (see the module's diagram)."""

    STARTING = "starting"  # asked for; its __init__ has not answered yet
    JOINING = "joining"  # running, not serving yet (a new rank of an elastic pool, or a restart loading weights)
    SERVING = "serving"  # takes routed and control calls
    DRAINING = "draining"  # leaving: no new routed call; its calls in flight and control calls go on
    DEAD = "dead"  # found dead; a supervisor may bring it back
    RESTARTING = "restarting"  # dead, and a supervisor is bringing it back
    REMOVED = "removed"  # out of the pool for good (its restart policy is spent)
    RETIRED = "retired"  # left an elastic pool (scale-in, its node drained or lost): never restarted
    STOPPED = "stopped"  # its cluster shut down

    @property
    def alive(self) -> bool:
        """Its actor runs and takes control calls."""
        return self in (WorkerState.SERVING, WorkerState.DRAINING)

    @property
    def coming(self) -> bool:
        """Alive, or on its way in or back: a call may wait for it."""
        return self.alive or self in (WorkerState.STARTING, WorkerState.JOINING, WorkerState.RESTARTING)


S = WorkerState
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    S.STARTING: frozenset({S.SERVING, S.JOINING, S.DEAD, S.REMOVED, S.RETIRED, S.STOPPED}),
    S.JOINING: frozenset({S.SERVING, S.DRAINING, S.DEAD, S.RESTARTING, S.REMOVED, S.RETIRED, S.STOPPED}),
    S.SERVING: frozenset({S.DRAINING, S.DEAD, S.JOINING, S.REMOVED, S.RETIRED, S.STOPPED}),
    S.DRAINING: frozenset({S.SERVING, S.DEAD, S.JOINING, S.REMOVED, S.RETIRED, S.STOPPED}),
    S.DEAD: frozenset({S.RESTARTING, S.JOINING, S.SERVING, S.DRAINING, S.REMOVED, S.RETIRED, S.STOPPED}),
    S.RESTARTING: frozenset({S.DEAD, S.JOINING, S.SERVING, S.DRAINING, S.REMOVED, S.RETIRED, S.STOPPED}),
    S.REMOVED: frozenset({S.RETIRED, S.STOPPED}),
    S.RETIRED: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
}
"""The states each state may move to; any other move is a bug and raises :class:`IllegalTransition`, except
that a rank that retired or whose cluster stopped stays so (a supervisor's thread may still ask for a
restart or a removal it decided before)."""


class IllegalTransition(RuntimeError):
    """A rank was asked to move where its state does not allow."""


@dataclass
class Slot:
    """One rank: its actor, where it sits, its state and the load counters routing reads."""

    rank: int
    hardware: str
    group: ReservedGroup
    bundle_index: int
    slot_ids: tuple[int, ...]  # its device slots in the pool group (logical positions)
    device_ids: tuple[int, ...] = ()  # the GPUs its actor got (reported when it started)
    actor: Any = None
    state: WorkerState = WorkerState.STARTING
    node_id: str = ""
    node_ip: str = ""
    actor_name: str = ""
    pid: int = 0
    inflight: int = 0
    served: int = 0
    requested_at: float = 0.0  # when its actor was last asked for (Unix time)
    start: WorkerStart = field(default_factory=WorkerStart)  # its last start: see Cluster.start_times

    @property
    def alive(self) -> bool:
        return self.state.alive

    @property
    def serving(self) -> bool:
        return self.state is WorkerState.SERVING


class Membership:
    """The states of one cluster's ranks, their transitions, and what waits on them.

    ``record(rank, state)`` is told every transition that the job's records show (the metadata store's
    binding state). ``lock`` guards the slots' states and load counters; ``changed`` is notified on every
    transition and when a draining rank's last call ends."""

    def __init__(self, name: str, record: Callable[[int, str], None]):
        self.name = name
        self.slots: list[Slot] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.awaiting_workers = False  # an elastic pool: workers may join later (routed calls wait for them)
        self.fatal: BaseException | None = None
        self.last_death: BaseException | None = None
        self.fault_counts: dict[str, int] = {"deaths": 0, "rerouted": 0, "skipped": 0, "restarts": 0, "removed": 0}
        self._record = record
        self._leaving: set[int] = set()  # asked to drain: a restart brings them back draining
        self._listeners: list[Callable[[int, BaseException | None], None]] = []

    # ------------------------------------------------------------------ transitions
    def move(self, rank: int, to: WorkerState, *, record: str | None = None) -> WorkerState:
        """Move ``rank`` to ``to`` (a state it may move to) and wake the waiters; returns the state it left.
        ``record``: the binding state the job's records get (none: nothing recorded)."""
        with self.lock:
            was = self._move(rank, to)
        if record is not None:
            self._record(rank, record)
        return was

    def _move(self, rank: int, to: WorkerState) -> WorkerState:
        slot = self.slots[rank]
        was = slot.state
        if to is was:
            return was
        if was in (WorkerState.RETIRED, WorkerState.STOPPED) and to is not WorkerState.STOPPED:
            log.debug("%s[rank %d]: %s stays, not %s", self.name, rank, was.value, to.value)
            return was
        if to not in TRANSITIONS[was]:
            raise IllegalTransition(f"{self.name}[rank {rank}]: {was.value} cannot become {to.value}")
        if to is WorkerState.SERVING and rank in self._leaving:
            to = WorkerState.DRAINING  # it was asked to leave before it died: it comes back leaving
        slot.state = to
        if to in (WorkerState.RETIRED, WorkerState.STOPPED):
            self._leaving.discard(rank)
        self.changed.notify_all()
        return was

    def serve(self, rank: int) -> bool:
        """A rank that was started, restarted or joined takes traffic (False: it retired, was removed or its
        cluster stopped meanwhile)."""
        with self.lock:
            if self.slots[rank].state in (WorkerState.RETIRED, WorkerState.REMOVED, WorkerState.STOPPED):
                return False
            self._move(rank, WorkerState.SERVING)
        self._record(rank, "running")
        return True

    def set_restarting(self, rank: int, restarting: bool) -> None:
        """A supervisor is bringing a dead ``rank`` back, or gave up on this attempt (a restarted rank that
        did not come to serve is dead again)."""
        with self.lock:
            state = self.slots[rank].state
            if restarting and state is WorkerState.DEAD:
                self._move(rank, WorkerState.RESTARTING)
            elif not restarting and state in (WorkerState.RESTARTING, WorkerState.JOINING):
                self._move(rank, WorkerState.DEAD)

    def set_draining(self, rank: int, draining: bool) -> None:
        """Route no new call to ``rank`` (its calls in flight go on), or route to it again."""
        with self.lock:
            state = self.slots[rank].state
            if draining:
                self._leaving.add(rank)
                if state is WorkerState.SERVING:
                    self._move(rank, WorkerState.DRAINING)
            else:
                self._leaving.discard(rank)
                if state is WorkerState.DRAINING:
                    self._move(rank, WorkerState.SERVING)
            self.changed.notify_all()
        if draining:
            self._record(rank, "draining")

    def died(self, rank: int, cause: BaseException | None) -> bool:
        """An alive ``rank`` was found dead: DEAD, counted, recorded and its listeners told (True). A rank
        that was not alive stays as it is (False)."""
        with self.lock:
            if not self.slots[rank].alive:
                return False
            self._move(rank, WorkerState.DEAD)
            self.fault_counts["deaths"] += 1
            self.last_death = cause or self.last_death
        self._record(rank, "dead")
        for listener in list(self._listeners):
            try:
                listener(rank, cause)
            except Exception:
                log.exception("cluster %s: death listener of rank %d failed", self.name, rank)
        return True

    # ------------------------------------------------------------------ listeners, failure
    def add_death_listener(self, fn: Callable[[int, BaseException | None], None]) -> None:
        self._listeners.append(fn)

    def remove_death_listener(self, fn: Callable[[int, BaseException | None], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def fail(self, err: BaseException) -> None:
        with self.lock:
            self.fatal = err
            self.changed.notify_all()

    def set_awaiting(self, awaiting: bool) -> None:
        with self.lock:
            self.awaiting_workers = awaiting
            self.changed.notify_all()

    # ------------------------------------------------------------------ questions
    def states(self) -> dict[int, WorkerState]:
        with self.lock:
            return {s.rank: s.state for s in self.slots}

    def in_state(self, *states: WorkerState) -> list[int]:
        with self.lock:
            return [s.rank for s in self.slots if s.state in states]

    def recoverable(self) -> bool:
        """A rank is alive, on its way back or joining, or workers are awaited (an elastic pool waiting for
        capacity): a control call may skip the dead ones, a routed call wait for one."""
        return self.awaiting_workers or any(s.state.coming for s in self.slots)

    def wait_until_serving(self, timeout_s: float) -> bool:
        """Block until a rank serves (True), or none can come back / ``timeout_s`` passes (False)."""

        def serving() -> bool:
            return any(s.serving for s in self.slots)

        with self.changed:
            self.changed.wait_for(
                lambda: self.fatal is not None or not self.recoverable() or serving(), timeout=timeout_s
            )
            return self.fatal is None and serving()

    def wait_idle(self, rank: int, timeout_s: float) -> bool:
        """Block until ``rank`` has no routed call in flight (True) or ``timeout_s`` passes (False)."""
        slot = self.slots[rank]
        with self.changed:
            return self.changed.wait_for(lambda: slot.inflight == 0 or not slot.actor, timeout=timeout_s)

    def placement(self) -> list[dict[str, Any]]:
        """Rank, hardware, node id, slot ids, device ids, state and liveness of every rank."""
        return [
            {
                "rank": s.rank,
                "hardware": s.hardware,
                "node_id": s.node_id,
                "node_ip": s.node_ip,
                "slot_ids": list(s.slot_ids),
                "device_ids": list(s.device_ids),
                "state": s.state.value,
                "alive": s.alive,
                "joining": s.state is WorkerState.JOINING,
                "draining": s.state is WorkerState.DRAINING,
                "retired": s.state is WorkerState.RETIRED,
                "served": s.served,  # routed calls it took
            }
            for s in self.slots
        ]

    def load(self) -> dict[int, dict[str, int]]:
        """Per rank: calls in flight and calls routed so far."""
        with self.lock:
            return {s.rank: {"inflight": s.inflight, "served": s.served} for s in self.slots}

    # ------------------------------------------------------------------ routing
    def pick(self, prefs: Iterable[str], prefer: int | None = None) -> Slot | None:
        """The rank a routed call goes to, counted in flight: ``prefer`` while it serves and is of one of
        the hardware types ``prefs`` (affinity), else the least-loaded serving rank of the first type in
        ``prefs`` that has one; None when no rank of ``prefs`` serves."""
        prefs = tuple(prefs)
        with self.lock:
            if prefer is not None and 0 <= prefer < len(self.slots):
                slot = self.slots[prefer]
                if slot.serving and slot.hardware in prefs:
                    slot.inflight += 1
                    slot.served += 1
                    return slot
            for hw in prefs:
                taken = self.take(s for s in self.slots if s.hardware == hw)
                if taken is not None:
                    return taken
        return None

    def take(self, candidates: Iterable[Slot]) -> Slot | None:
        """The least-loaded serving slot of ``candidates`` (in flight, then served, then rank), counted
        in flight; None when none serves. Call with :attr:`lock` held."""
        live = [s for s in candidates if s.serving]
        if not live:
            return None
        slot = min(live, key=lambda s: (s.inflight, s.served, s.rank))
        slot.inflight += 1
        slot.served += 1
        return slot

    def release(self, slot: Slot, n: int = 1) -> None:
        """``n`` calls routed to ``slot`` were answered (or failed)."""
        with self.lock:
            slot.inflight = max(0, slot.inflight - n)
            if slot.state is WorkerState.DRAINING and not slot.inflight:
                self.changed.notify_all()
