"""Restart policies per role and the supervisor that applies one to a Cluster (issue #13).

``fault:`` in the pipeline config holds one :class:`RestartPolicy` per role. What is enforced today:

- ``inference``: a dead inference worker is restarted in its own placement bundle (at most
  ``max_restarts`` times within ``window_s`` seconds, ``backoff_s`` before each try); it loads the policy
  version being served before it takes traffic. Once its restarts are spent, ``on_exhausted: remove``
  takes it out of the routing table (the job goes on with the others), ``fail`` fails the job with the
  cause at the next call on that cluster.
- ``train``, ``reference``, ``critic``: enforced by the pipeline (:class:`RoleBudgets`). A dead rank of
  one of them fails the step it was in (``WorkerDiedError`` reaches the pipeline); within the policy
  every rank of the trainer (and of the critic) is rebuilt in its placement bundle, re-rendezvoused,
  and reloads the latest checkpoint, the rounds trained since it are played again, and the inference
  workers get the reloaded weights as a new version. Spent, the job fails with the rank, host and
  cause (``on_exhausted: remove`` is refused for them: a data-parallel group cannot lose a rank).
- ``env``, ``reward``: no policy (a config that sets one is refused): rollart does not restart those
  processes. Env faults are handled by the EnvManager's retries and timeouts (and Ray restarts the env
  servers of ``backend: ray``), reward faults by the reward client's retries and ``on_failure``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollart.cluster.config import TRAINER_ROLES, FaultConfig, RestartPolicy

if TYPE_CHECKING:
    from rollart.cluster.cluster import Cluster

log = logging.getLogger(__name__)
EVENTS_KEPT = 1000  # restart / removal / failure events a supervisor keeps (the newest)


class TrainerFailed(RuntimeError):
    """A trainer-side rank died and its role's restart policy is spent (or forbids restarts)."""


class RoleBudgets:
    """The restart budgets of the trainer-side roles (``train``, ``reference``, ``critic``), one per rank.

    ``take(role, rank, err)`` returns the backoff before the restart, or raises :class:`TrainerFailed`
    naming the rank, its host and the cause when the role's policy has no restart left."""

    def __init__(self, fault: FaultConfig, clock: Callable[[], float] = time.monotonic):
        self.budgets = {role: RestartBudget(getattr(fault, role), clock) for role in TRAINER_ROLES}

    def take(self, role: str, rank: int, err: BaseException, *, where: str = "") -> float:
        budget = self.budgets[role]
        backoff = budget.take(rank)
        if backoff is None:
            p = budget.policy
            raise TrainerFailed(
                f"{role} rank {rank}{f' ({where})' if where else ''} died and fault.{role} allows "
                f"{p.max_restarts} restart(s) within {p.window_s:g}s (on_exhausted: fail); cause: {err}"
            ) from err
        return backoff


class RestartBudget:
    """Restart times of each rank inside the policy's sliding window."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._times: dict[int, deque[float]] = {}

    def take(self, rank: int) -> float | None:
        """Record a restart of ``rank`` and return the backoff before it, or None when none is left."""
        now = self._clock()
        times = self._times.setdefault(rank, deque())
        while times and now - times[0] > self.policy.window_s:
            times.popleft()
        if len(times) >= self.policy.max_restarts:
            return None
        backoff = self.policy.backoff_s * (2 ** len(times))
        times.append(now)
        return backoff


class WorkerSupervisor:
    """Restarts the dead workers of one Cluster under a :class:`RestartPolicy`.

    ``prepare(actor) -> version`` runs on a restarted actor before it is marked alive (it loads the
    policy version being served and returns it); ``current_version()`` reads the version being served.
    A worker takes traffic only once the version it loaded is still the current one, checked under
    :attr:`version_lock` — the lock a weight push holds while it records the new version and sends it
    to the live workers, so a worker coming back during a push gets the new version too.
    """

    def __init__(
        self,
        cluster: Cluster,
        policy: RestartPolicy,
        *,
        prepare: Callable[[Any], int] | None = None,
        current_version: Callable[[], int] = lambda: 0,
        ready_timeout_s: float = 300.0,
    ):
        self.cluster = cluster
        self.policy = policy
        self.budget = RestartBudget(policy)
        self.prepare = prepare
        self.current_version = current_version
        self.ready_timeout_s = ready_timeout_s
        self.version_lock = threading.Lock()
        self.restarting: set[int] = set()
        # one per restart / removal / failure, for metrics and tests: the newest EVENTS_KEPT (a long run
        # with restarts must not grow without bound)
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._cond = threading.Condition()
        self._stopped = threading.Event()
        # Restarts run on a few long-lived daemon threads, started as needed (at most one per rank)
        # and reused: a new thread per restart gets a fresh malloc arena from glibc now and then, and
        # over thousands of restarts those arenas were most of the driver's growth.
        self._jobs: queue.SimpleQueue[tuple[int, float, BaseException | None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # restart threads waiting for a job
        cluster.add_death_listener(self._on_death)

    # ------------------------------------------------------------------ reacting to a death
    def _on_death(self, rank: int, cause: BaseException | None) -> None:
        with self._cond:
            if rank in self.restarting or self._stopped.is_set() or self.cluster.is_retired(rank):
                return  # a rank that left an elastic pool is not restarted
            backoff = self.budget.take(rank)
            if backoff is None:
                self._exhausted(rank, cause)
                return
            self.restarting.add(rank)
            self.cluster.mark_restarting(rank)
            if self._idle <= self._jobs.qsize():  # no waiting thread left for this job: one more
                t = threading.Thread(
                    target=self._restart_loop, name=f"restart-{self.cluster.name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
            self._jobs.put((rank, backoff, cause))

    def _restart_loop(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
            job = self._jobs.get()
            with self._cond:
                self._idle -= 1
            if job is None:  # stop()
                return
            self._restart(*job)

    @property
    def restart_threads(self) -> int:
        """How many restart threads this supervisor has started (they are reused, never more than
        the number of ranks restarting at the same time)."""
        return len(self._threads)

    def _exhausted(self, rank: int, cause: BaseException | None) -> None:
        p = self.policy
        what = f"{self.cluster.name}[rank {rank}] used its {p.max_restarts} restarts within {p.window_s:g}s"
        if p.on_exhausted == "remove":
            log.error("%s; removed from the pool (cause: %r)", what, cause)
            self.cluster.remove_worker(rank)
            self._event("removed", rank, cause)
        else:
            log.error("%s; failing the job (cause: %r)", what, cause)
            self.cluster.fail(RuntimeError(f"{what} (fault.on_exhausted: fail); cause: {cause!r}"), cause)
            self._event("failed", rank, cause)

    def _event(self, kind: str, rank: int, cause: BaseException | None, **more: Any) -> None:
        with self._cond:
            self.events.append({"event": kind, "rank": rank, "cause": repr(cause), **more})
            self._cond.notify_all()

    def _restart(self, rank: int, backoff: float, cause: BaseException | None) -> None:
        try:
            if self._stopped.wait(backoff) or self.cluster.is_retired(rank):  # a shutdown ends the backoff early
                with self._cond:
                    self.restarting.discard(rank)
                return
            self.cluster.restart_worker(rank, timeout_s=self.ready_timeout_s, mark_alive=False)
            actor = self.cluster.workers[rank]
            while not self.cluster.is_retired(rank):
                version = self.prepare(actor) if self.prepare is not None else self.current_version()
                with self.version_lock:
                    if version == self.current_version():
                        self.cluster.mark_alive(rank)
                        break
                log.info(
                    "%s[%d] loaded version %d, a newer one is served now; loading again",
                    self.cluster.name,
                    rank,
                    version,
                )
            else:  # it left an elastic pool meanwhile (its node went): not back
                with self._cond:
                    self.restarting.discard(rank)
                return
            log.warning("%s: rank %d restarted, serving version %d", self.cluster.name, rank, version)
            with self._cond:
                self.restarting.discard(rank)
            self._event("restarted", rank, cause, version=version)
        except Exception as err:  # the restart itself failed: counts as a death of its own
            with self._cond:
                self.restarting.discard(rank)
            if self.cluster.is_retired(rank):  # it left an elastic pool meanwhile (its node went)
                log.info("%s: rank %d left the pool during its restart (%r)", self.cluster.name, rank, err)
                return
            log.exception("%s: restart of rank %d failed", self.cluster.name, rank)
            self.cluster.mark_restarting(rank, False)
            if not self._stopped.is_set():
                self._on_death(rank, err)

    # ------------------------------------------------------------------ waiting (tests, shutdown)
    def wait_for(self, predicate: Callable[[deque[dict[str, Any]]], bool], timeout_s: float) -> bool:
        """Block until ``predicate(events)`` holds (True) or ``timeout_s`` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.events), timeout=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """No more restarts; waits (bounded) for the restarts under way to end."""
        self._stopped.set()
        self.cluster.remove_death_listener(self._on_death)
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
