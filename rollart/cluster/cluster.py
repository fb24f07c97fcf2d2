"""``Cluster``: spawn a worker class on a pool and act as its invocation proxy (RollArt paper §5.2).

Every method decorated with ``@register``, ``@hw_mapping`` or ``@register_serverless`` is bound onto
the Cluster instance under the same name:

- ``@register``: the call is planned by its dispatch mode, run on the ranks, collected.
- ``@hw_mapping``: the call's ``tag_name`` picks the ordered hardware preference; the first hardware
  type with a live worker serves it, the least-loaded one (fewest calls in flight) within that type.
  ``route_override`` (automatic affinity) may reorder a tag's preference.
  A worker found dead is marked so and the call is routed to the next candidate.
- ``@register_serverless``: the arguments are POSTed as JSON to the URL; nothing runs on a worker.

Faults: with ``skip_dead_ranks=True`` a ``ONE_TO_ALL`` control call (suspend, weight updates, aborts)
goes to the live ranks only; a rank found dead during the call is marked dead and left out of the
answer. Each death is reported to the death listeners (a :class:`~rollart.cluster.fault.WorkerSupervisor`
restarts the rank under its policy). Such a call fails (``WorkerDiedError`` with the cause) only when no
rank is alive and none is being restarted. A rank taken out for good (``remove_worker``) never serves
again; ``fail(err)`` makes every later call raise ``err``.

Membership: each rank has one state (:class:`~rollart.cluster.membership.WorkerState`: starting, joining,
serving, draining, dead, restarting, removed, retired, stopped), changed only through the transitions of
:mod:`rollart.cluster.membership`. Elastic pools: :meth:`add_worker` starts a new rank in a unit the
ResourceManager reserved (it takes traffic once :meth:`mark_alive`), :meth:`set_draining` stops routing to
a rank while control calls still reach it (its in-flight calls finish: :meth:`wait_idle`), and
:meth:`retire_worker` takes it out for good (no restart, no death reported). Ranks are never reused.
The proxies bound for the methods are :mod:`rollart.cluster.proxies`'; the ranks' plan,
:mod:`rollart.cluster.planning`'s.

Sync worker methods block and return the collected value unless ``blocking=False`` is passed (then
a :class:`ClusterFuture`); ``async def`` worker methods always return an awaitable ``ClusterFuture``.
``blocking`` is therefore a reserved keyword for exposed methods (a worker method with a parameter of
that name is reported when the Cluster is created).

Typed calls: ``cluster.call(Worker.method, *args, **kwargs)`` and ``cluster.call_async(...)`` take the
worker's method itself, so a type checker checks the arguments against its signature (``ParamSpec``)
and an IDE can jump to it; the attribute style (``cluster.method(...)``) does the same at run time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray

from rollart.cluster.actors import Actors
from rollart.cluster.errors import NoLiveWorkerError, WorkerDiedError
from rollart.cluster.future import ACTOR_GONE, SKIPPED
from rollart.cluster.membership import Membership, Slot, WorkerState
from rollart.cluster.methods import ExposedMethod, exposed_methods
from rollart.cluster.planning import plan_slots
from rollart.cluster.proxies import bind_method, proxy_for
from rollart.cluster.worker import Worker, WorkerStart
from rollart.decorators.specs import HwMappingSpec
from rollart.resource_manager.manager import ReservedGroup, ResourceManager
from rollart.resource_manager.specs import ResourceSpecError

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class Cluster:
    """A set of workers of one class on one pool, addressed as one object.

    ``Cluster(name, worker_cls, resource_manager, pool=..., devices_per_worker=1, colocate_with=None)``
    spawns ``devices / devices_per_worker`` workers per hardware group of the pool (ranks run group by
    group in the pool's order). ``pool=None`` is for classes whose methods are all serverless.
    ``worker_args``/``worker_kwargs`` go to the worker's ``__init__``.

    ``wait=False`` returns once the workers are asked for (Ray starts their processes in the background),
    so that several clusters start at the same time; :meth:`wait_ready` then waits for them, and the
    cluster's methods refuse calls until it did.
    """

    def __init__(
        self,
        name: str,
        worker_cls: type[Worker],
        resource_manager: ResourceManager,
        pool: str | None = None,
        devices_per_worker: int = 1,
        colocate_with: Cluster | None = None,
        *,
        worker_args: tuple = (),
        worker_kwargs: dict[str, Any] | None = None,
        max_concurrency: int | None = None,
        ready_timeout_s: float = 300.0,
        skip_dead_ranks: bool = False,
        wait: bool = True,
    ):
        if not isinstance(name, str) or not name:
            raise ValueError("Cluster(name=...) must be a non-empty string")
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"Cluster({name!r}): worker_cls must subclass rollart.Worker, got {worker_cls!r}")
        self.name = name
        self.worker_cls = worker_cls
        self.resource_manager = resource_manager
        self.pool = pool
        self.devices_per_worker = devices_per_worker
        self.methods: dict[str, ExposedMethod] = exposed_methods(worker_cls)
        for taken in ("call", "call_async"):
            if taken in self.methods:
                raise TypeError(
                    f"{worker_cls.__name__}.{taken}: {taken!r} is a Cluster method of its own; rename the worker method"
                )
        self.skip_dead_ranks = skip_dead_ranks
        # tag -> hardware order that replaces the @hw_mapping one (None: keep it); see rollart.rollout.affinity
        self.route_override: Callable[[str], tuple[str, ...] | None] | None = None
        self.members = Membership(name, self._record_state)
        self._executor: ThreadPoolExecutor | None = None
        is_async = any(m.is_async for m in self.methods.values() if m.serverless is None)
        self.actors = Actors(
            self,
            worker_cls,
            max_concurrency=max_concurrency or (1000 if is_async else 1),
            worker_args=tuple(worker_args),
            worker_kwargs=dict(worker_kwargs or {}),
            colocate_with=colocate_with,
        )
        self._pending: dict[int, ray.ObjectRef] = {}  # rank -> its start answer, until wait_ready()
        self._ready_timeout_s = ready_timeout_s
        self._start(resource_manager, pool, devices_per_worker, colocate_with, wait)
        for m in self.methods.values():
            bind_method(self, m)
            if m.serverless is not None:
                s = m.serverless
                resource_manager.store.record_endpoint(
                    resource_manager.job_id, name, m.name, s.url, s.timeout_s, s.retries
                )

    def _start(self, rm: ResourceManager, pool: str | None, d: int, colocate_with: Cluster | None, wait: bool) -> None:
        """Plan the ranks (every check runs before any actor exists), bind the pool, ask for the actors."""
        elastic = pool is not None and pool in rm.specs and rm.specs[pool].elastic
        if elastic and colocate_with is not None:
            raise ResourceSpecError(
                f"Cluster({self.name!r}): pool {pool!r} is elastic (max_devices); a colocated cluster cannot follow "
                "its workers as they come and go; give it a pool of its own"
            )
        if pool is not None and elastic and d > 1:  # an elastic group is reserved per worker: the units first
            rm.regroup(pool, d)
        self.members.slots = plan_slots(self.name, self.worker_cls, self.methods, rm, pool, d, colocate_with)
        if pool is None:
            return
        if d > 1 and colocate_with is None and not elastic:
            rm.regroup(pool, d)
        rm.bind(self.name, pool, colocate_with.name if colocate_with else None)
        try:
            for slot in self._slots:  # their start answers wait in _pending (wait_ready)
                self._pending[slot.rank] = self.actors.start(slot)
        except BaseException:
            self.shutdown()
            raise
        if wait:
            self.wait_ready()

    @property
    def _slots(self) -> list[Slot]:
        return self.members.slots

    @property
    def fault_counts(self) -> dict[str, int]:
        """Deaths, reroutes, skipped ranks, restarts and removals so far."""
        return self.members.fault_counts

    @property
    def awaiting_workers(self) -> bool:
        return self.members.awaiting_workers

    @property
    def world_size(self) -> int:
        return len(self._slots)

    @property
    def job_id(self) -> str:
        return self.resource_manager.job_id

    def _record_state(self, rank: int, state: str) -> None:
        self.resource_manager.store.set_binding_state(self.job_id, self.name, rank, state)

    # ------------------------------------------------------------------ actors
    def wait_ready(self) -> None:
        """Wait until every worker asked for by ``Cluster(..., wait=False)`` runs (its ``__init__``
        returned); at once when none is pending. A worker that fails to start (or does not answer within
        ``ready_timeout_s``) shuts this cluster down, and its error is raised."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        try:
            for rank, ref in pending.items():
                slot = self._slots[rank]
                try:
                    info = ray.get(ref, timeout=self._ready_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    raise self._died(rank) from None
                except ray.exceptions.RayError as err:
                    raise RuntimeError(
                        f"worker {self.name}[rank {rank}] on {slot.hardware} failed to start: {err}"
                    ) from err
                self.actors.started(slot, info)
                self.members.move(rank, WorkerState.SERVING)
        except BaseException:
            self.shutdown()
            raise
        hardware = ", ".join(s.hardware for s in self._slots)
        log.info("cluster %s: %d workers on pool %s (%s)", self.name, self.world_size, self.pool, hardware)

    # ------------------------------------------------------------------ membership
    def restart_worker(self, rank: int, timeout_s: float = 300.0, *, mark_alive: bool = True) -> None:
        """Replace the actor of ``rank`` (dead or alive) with a fresh one in the same placement bundle.

        ``mark_alive=False`` leaves it joining (out of routing and control calls) until :meth:`mark_alive`
        (a supervisor first loads the current weights into it)."""
        slot = self._slot(rank)
        if slot.state is WorkerState.RETIRED:
            raise RuntimeError(f"{self.name}[rank {rank}] left the pool; it is not restarted")
        if slot.alive:
            self.members.move(rank, WorkerState.DEAD)  # replaced while alive: no death to report
        self.actors.kill(slot)
        info = ray.get(self.actors.start(slot), timeout=timeout_s)
        with self.members.lock:
            slot.inflight = 0
            self.fault_counts["restarts"] += 1
        self.actors.started(slot, info)
        if slot.state is not WorkerState.RETIRED:
            self.members.move(rank, WorkerState.JOINING)
        log.info("cluster %s: rank %d restarted on %s", self.name, rank, slot.hardware)
        if mark_alive:
            self.mark_alive(rank)

    def mark_alive(self, rank: int) -> None:
        """Let ``rank`` take traffic (after :meth:`restart_worker` with ``mark_alive=False`` or
        :meth:`add_worker`); a rank that left the pool meanwhile stays out."""
        self.members.serve(rank)

    def mark_restarting(self, rank: int, restarting: bool = True) -> None:
        """A supervisor is (or no longer is) bringing ``rank`` back: control calls skip it meanwhile."""
        self.members.set_restarting(rank, restarting)

    def remove_worker(self, rank: int) -> None:
        """Take ``rank`` out of the pool for good: no routed call or control call reaches it again."""
        self.members.move(rank, WorkerState.REMOVED, record="removed")
        with self.members.lock:
            self.fault_counts["removed"] += 1
        self.actors.kill(self._slot(rank))

    def add_worker(self, unit: ReservedGroup, timeout_s: float = 300.0) -> int:
        """Start a new rank in ``unit`` (one worker's devices, reserved by the ResourceManager); it takes no
        traffic until :meth:`mark_alive`. Returns its rank. A start that fails retires the rank and raises."""
        with self.members.lock:
            rank = len(self._slots)
            self._slots.append(Slot(rank, unit.group.hardware, unit, 0, tuple(range(self.devices_per_worker))))
        try:
            info = ray.get(self.actors.start(slot := self._slots[rank]), timeout=timeout_s)
        except BaseException:
            self.retire_worker(rank, "failed")
            raise
        self.actors.started(slot, info)
        self.members.move(rank, WorkerState.JOINING, record="joining")
        log.info("cluster %s: rank %d started on %s (host %s)", self.name, rank, slot.hardware, slot.node_ip or "?")
        return rank

    def set_draining(self, rank: int, draining: bool = True) -> None:
        """Route no new call to ``rank`` (its in-flight calls go on, control calls still reach it)."""
        self.members.set_draining(rank, draining)

    def wait_idle(self, rank: int, timeout_s: float) -> bool:
        """Block until ``rank`` has no routed call in flight (True) or ``timeout_s`` passes (False)."""
        return self.members.wait_idle(rank, timeout_s)

    def retire_worker(self, rank: int, state: str = "left") -> None:
        """Take ``rank`` out of the pool for good (it left an elastic pool): no call reaches it, it is never
        restarted and its death is not reported; its actor is killed. ``state`` is what the records say."""
        self.members.move(rank, WorkerState.RETIRED)
        self.actors.kill(self._slot(rank))
        self._record_state(rank, state)

    def group_of(self, rank: int) -> ReservedGroup:
        """The reserved group (for an elastic pool: the unit) ``rank`` runs in."""
        return self._slot(rank).group

    def set_awaiting_workers(self, awaiting: bool) -> None:
        """Whether workers may join later (an elastic pool): routed calls then wait for one while none serves."""
        self.members.set_awaiting(awaiting)

    def is_retired(self, rank: int) -> bool:
        """Whether ``rank`` left the pool (:meth:`retire_worker`)."""
        return self._slot(rank).state is WorkerState.RETIRED

    def state_of(self, rank: int) -> WorkerState:
        """Where ``rank`` is in its life (:class:`~rollart.cluster.membership.WorkerState`)."""
        return self._slot(rank).state

    def fail(self, err: BaseException, cause: BaseException | None = None) -> None:
        """Every later call on this cluster raises ``err`` (a restart policy gave up with ``fail``)."""
        if cause is not None and err.__cause__ is None:
            err.__cause__ = cause
        self.members.fail(err)

    def _check_fatal(self) -> None:
        if self.members.fatal is not None:
            raise self.members.fatal
        if self._pending:
            raise RuntimeError(
                f"cluster {self.name!r} is still starting (Cluster(..., wait=False)): call its wait_ready() first"
            )

    def add_death_listener(self, fn: Callable[[int, BaseException | None], None]) -> None:
        """``fn(rank, cause)`` runs (in the caller's thread) each time a live rank is found dead."""
        self.members.add_death_listener(fn)

    def remove_death_listener(self, fn: Callable[[int, BaseException | None], None]) -> None:
        self.members.remove_death_listener(fn)

    def recoverable(self) -> bool:
        """Whether a rank is alive, being restarted or joining, or workers are awaited (an elastic pool that
        waits for capacity): a control call may then skip the dead ones, a routed call wait for one."""
        return self.members.recoverable()

    def wait_until_serving(self, timeout_s: float) -> bool:
        """Block until a rank serves (True), or none can come back / ``timeout_s`` passes (False)."""
        return self.members.wait_until_serving(timeout_s)

    def start_times(self) -> list[WorkerStart]:
        """Each rank's last start (rank order): when its actor was asked for, its process and
        ``__init__`` began, ``__init__`` returned and the driver had the answer."""
        return [s.start for s in self._slots]

    def pids(self) -> dict[int, int]:
        """The process id of each rank's actor (as reported when it started)."""
        return {s.rank: s.pid for s in self._slots if s.state is not WorkerState.RETIRED}

    def health_check(self, timeout_s: float = 10.0) -> dict[int, bool]:
        """Ping every worker; mark the unreachable ones dead. Returns rank → alive."""
        refs = {
            s.rank: s.actor._rollart_ping.remote()
            for s in self._slots
            if s.actor is not None and s.state is not WorkerState.RETIRED
        }
        for rank, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.GetTimeoutError, *ACTOR_GONE):
                self._mark_dead(rank)
        return {s.rank: s.alive for s in self._slots}

    def shutdown(self) -> None:
        """Kill this cluster's workers and free its pool binding (the pool stays reserved)."""
        self._pending = {}  # a cluster still starting: its workers go too
        for slot in self._slots:
            if slot.actor is not None:
                self.actors.kill(slot)
                if slot.state is not WorkerState.STOPPED:
                    self.members.move(slot.rank, WorkerState.STOPPED, record="stopped")
        if self.pool is not None:
            self.resource_manager.unbind(self.name, self.pool)
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ introspection
    def _slot(self, rank: int) -> Slot:
        if not 0 <= rank < len(self._slots):
            raise IndexError(f"{self.name}: rank {rank} out of range (world_size {self.world_size})")
        return self._slots[rank]

    @property
    def workers(self) -> list[Any]:
        """The Ray actor handles, rank order."""
        return [s.actor for s in self._slots]

    def hardware_of(self, rank: int) -> str:
        return self._slot(rank).hardware

    def node_ip_of(self, rank: int) -> str:
        """The host address of a rank's node ("" before it started)."""
        return self._slot(rank).node_ip

    def placement(self) -> list[dict[str, Any]]:
        """Rank, hardware, node id, slot ids (its device slots in the pool), device ids (the GPUs Ray
        gave its actor; empty on the CPU), state and liveness of every worker."""
        return self.members.placement()

    def load(self) -> dict[int, dict[str, int]]:
        """Per rank: calls in flight and calls routed so far."""
        return self.members.load()

    # ------------------------------------------------------------------ liveness
    def _mark_dead(self, rank: int, cause: BaseException | None = None) -> None:
        slot = self._slots[rank]
        if self.members.died(rank, cause):
            log.warning(
                "cluster %s: worker rank %d on %s (host %s) is dead",
                self.name,
                rank,
                slot.hardware,
                slot.node_ip or "?",
            )

    def _died(self, rank: int, err: BaseException | None = None) -> WorkerDiedError:
        """The error for a dead ``rank``: its cluster, hardware, host IP and the Ray cluster's address."""
        slot = self._slots[rank]
        try:
            gcs = ray.get_runtime_context().gcs_address if ray.is_initialized() else ""
        except Exception:  # a Ray without it
            gcs = ""
        return WorkerDiedError(self.name, rank, slot.hardware, err, node_ip=slot.node_ip, ray_cluster=gcs)

    def _dead(self, rank: int, err: BaseException) -> ray.ObjectRef:
        self._mark_dead(rank, err)
        raise self._died(rank, err) from err

    def _dead_skip(self, rank: int, err: BaseException) -> Any:
        """``skip_dead_ranks``: a rank that died during a control call is left out of its answer."""
        self._mark_dead(rank, err)
        if not self.recoverable():
            raise self._died(rank, err) from err
        with self.members.lock:
            self.fault_counts["skipped"] += 1
        log.warning("%s: rank %d died during a control call; skipped", self.name, rank)
        return SKIPPED

    def worker_died(self, rank: int, err: BaseException) -> WorkerDiedError:
        """Mark ``rank`` dead (routing skips it, death listeners such as a supervisor are told) and
        return the error that names it: what a caller of a batched call raises for each of its calls."""
        self._mark_dead(rank, err)
        return self._died(rank, err)

    # ------------------------------------------------------------------ routing
    def _route(self, spec: HwMappingSpec, tag: str, prefer: int | None = None) -> Slot:
        prefs = spec.preference(tag)  # an unknown tag is refused here, with or without an override
        if self.route_override is not None:
            prefs = self.route_override(tag) or prefs
        slot = self.members.pick(prefs, prefer)
        if slot is None:
            raise NoLiveWorkerError(
                f"cluster {self.name}: no live worker of {list(prefs)} for tag {tag!r}; restart workers with "
                "restart_worker(rank)"
            )
        return slot

    def route_many(
        self, method: str, tag: str, n: int, prefer: Sequence[int | None] | None = None
    ) -> list[tuple[int, Any]]:
        """Route ``n`` calls of the ``@hw_mapping`` method ``method`` for ``tag``, each as a call of its
        own would be (least-loaded serving worker of the tag's preference, counted in flight): a
        ``(rank, actor)`` per call, for a caller that sends them to each worker together (one Ray call
        per worker). Each is given back with :meth:`release` once answered. ``prefer[i]``: a rank call
        ``i`` goes to while it serves and is of the tag's hardware (affinity, e.g. a session's earlier
        calls, whose KV cache that worker may still hold)."""
        m = self.methods.get(method)
        if m is None or m.hw_mapping is None:
            raise TypeError(f"cluster {self.name!r}: {method!r} is not a routed (@hw_mapping) method")
        self._check_fatal()
        out = []
        for i in range(n):
            slot = self._route(m.hw_mapping, tag, prefer[i] if prefer is not None else None)
            out.append((slot.rank, slot.actor))
        return out

    def release(self, rank: int, n: int = 1) -> None:
        """``n`` calls routed to ``rank`` by :meth:`route_many` were answered (or failed)."""
        self.members.release(self._slots[rank], n)

    # ------------------------------------------------------------------ typed calls
    def call(self, method: Callable[Concatenate[Any, P], R], /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Call ``method`` (the worker class's method, e.g. ``Trainer.train_step``) on this cluster and
        block for the collected result: for ``@register`` what its dispatch mode collects (``ONE_TO_ALL``
        and ``ALL_TO_ALL``: a list of ``R``, one per rank; ``RANK_ZERO``: ``R``; ``DP_SPLIT``: the
        per-rank ``R`` concatenated), for ``@hw_mapping`` and ``@register_serverless`` the ``R`` of the one
        call. The arguments are type-checked against ``method``'s signature. For an ``async def`` method
        this returns its awaitable :class:`ClusterFuture` (as the attribute style does)."""
        if "blocking" in kwargs:
            raise TypeError(f"{self.name}.call: 'blocking' is not an argument of call(); use call_async() for a future")
        return proxy_for(self, method)(*args, **kwargs)

    def call_async(
        self, method: Callable[Concatenate[Any, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> Awaitable[Any]:
        """Start ``method`` without blocking; await the result (collected as in :meth:`call`). Sync and
        async worker methods alike: a :class:`ClusterFuture` (also ``.result(timeout)``) for worker
        calls, an awaitable for serverless ones."""
        if "blocking" in kwargs:
            raise TypeError(f"{self.name}.call_async: 'blocking' is not an argument of call_async()")
        out = proxy_for(self, method)(*args, blocking=False, **kwargs)
        if isinstance(out, Future):  # a sync serverless call running in the cluster's thread pool
            return _await_future(out)
        return out

    def __getattr__(self, item: str) -> Any:
        if item.startswith("_"):
            raise AttributeError(item)
        exposed = sorted(self.__dict__.get("methods", {}))
        raise AttributeError(
            f"cluster {self.__dict__.get('name')!r} has no method {item!r}; exposed methods are {exposed} "
            "(decorate a worker method with @register, @hw_mapping or @register_serverless to expose it)"
        )

    def __repr__(self) -> str:
        return f"Cluster({self.name!r}, {self.worker_cls.__name__}, pool={self.pool!r}, world_size={self.world_size})"

    def _pool_executor(self) -> ThreadPoolExecutor:
        with self.members.lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix=f"{self.name}-serverless")
            return self._executor


async def _await_future(fut: Future[Any]) -> Any:
    return await asyncio.wrap_future(fut)


def start_together(starts: Sequence[Callable[[], Cluster]]) -> list[Cluster]:
    """Start several clusters at the same time: each of ``starts`` builds one with ``Cluster(...,
    wait=False)`` (Ray starts its workers' processes in the background), then the workers of all of them
    are waited for together, so their processes boot, import and load their models side by side. The
    clusters are returned in the order of ``starts``. When a build or a worker fails (or a worker does not
    answer within its cluster's ``ready_timeout_s``), every cluster started here shuts down, and the
    first error is raised: the failing cluster's own (``ResourceSpecError``, ``WorkerDiedError`` or the
    worker's start error, naming it)."""
    started: list[Cluster] = []
    try:
        for start in starts:
            started.append(start())
        owners = {ref: c for c in started for ref in c._pending.values()}
        deadline = time.monotonic() + max((c._ready_timeout_s for c in started), default=0.0)
        while owners:  # the first failure surfaces at once, whichever cluster it is in
            ready, _ = ray.wait(list(owners), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            cluster = owners.pop(ready[0])
            try:
                ray.get(ready[0], timeout=0)
            except ray.exceptions.RayError:
                cluster.wait_ready()  # raises that cluster's start error (and shuts it down)
        for c in started:
            c.wait_ready()  # at once where every worker answered; the timeout error where one did not
    except BaseException:
        for c in reversed(started):
            c.shutdown()
        raise
    return started
