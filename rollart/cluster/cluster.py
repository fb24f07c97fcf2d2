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

Membership (elastic pools): :meth:`add_worker` starts a new rank in a unit the ResourceManager reserved
(it takes traffic once :meth:`mark_alive`), :meth:`set_draining` stops routing to a rank while control
calls still reach it (its in-flight calls finish: :meth:`wait_idle`), and :meth:`retire_worker` takes it
out for good (no restart, no death reported). Ranks are never reused.

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
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollart.cluster.dispatch import collect, plan_calls
from rollart.cluster.errors import NoLiveWorkerError, WorkerDiedError
from rollart.cluster.future import ACTOR_GONE, SKIPPED, ClusterFuture
from rollart.cluster.methods import ExposedMethod, exposed_methods
from rollart.cluster.worker import BY_REF_PREFIX, CUDA_VISIBLE, Worker, WorkerContext, WorkerStart, host_class
from rollart.decorators.specs import Dispatch, HwMappingSpec, ServerlessSpec
from rollart.resource_manager.capacity import MAX_COLOCATED_ON_GPU
from rollart.resource_manager.launcher import workers_see_no_gpu
from rollart.resource_manager.manager import ReservedGroup, ResourceManager
from rollart.resource_manager.specs import ResourceSpecError

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class _Slot:
    """One rank: its actor, where it sits, and the load counters routing reads."""

    rank: int
    hardware: str
    group: ReservedGroup
    bundle_index: int
    slot_ids: tuple[int, ...]  # its device slots in the pool group (logical positions)
    device_ids: tuple[int, ...] = ()  # the GPUs its actor got (reported when it started)
    actor: Any = None
    alive: bool = False
    node_id: str = ""
    node_ip: str = ""
    actor_name: str = ""
    pid: int = 0
    removed: bool = False  # taken out of the pool for good (its restart policy is spent, or it left)
    restarting: bool = False  # a supervisor is bringing it back
    joining: bool = False  # added to an elastic pool, not serving yet (loading weights)
    draining: bool = False  # leaving: no new routed call; control calls still reach it
    retired: bool = False  # left an elastic pool (scale-in, its node drained or lost): never restarted
    inflight: int = 0
    served: int = 0
    requested_at: float = 0.0  # when its actor was last asked for (Unix time)
    start: WorkerStart = WorkerStart()  # its last start: see Cluster.start_times


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
        self._lock = threading.Lock()
        self._live_changed = threading.Condition(self._lock)
        self.skip_dead_ranks = skip_dead_ranks
        # tag -> hardware order that replaces the @hw_mapping one (None: keep it); see rollart.rollout.affinity
        self.route_override: Callable[[str], tuple[str, ...] | None] | None = None
        self._death_listeners: list[Callable[[int, BaseException | None], None]] = []
        self.awaiting_workers = False  # an elastic pool: workers may join later (routed calls wait for them)
        self._fatal: BaseException | None = None
        self._last_death: BaseException | None = None
        self.fault_counts: dict[str, int] = {"deaths": 0, "rerouted": 0, "skipped": 0, "restarts": 0, "removed": 0}
        self._slots: list[_Slot] = []
        self._executor: ThreadPoolExecutor | None = None
        self._actor_class: Any = None  # the Ray actor class of worker_cls, built at the first start
        self._worker_args = tuple(worker_args)
        self._worker_kwargs = dict(worker_kwargs or {})
        self._colocate_with = colocate_with
        self._is_async = any(m.is_async for m in self.methods.values() if m.serverless is None)
        self._max_concurrency = max_concurrency or (1000 if self._is_async else 1)
        self._pending: dict[int, ray.ObjectRef] = {}  # rank -> its start answer, until wait_ready()
        self._ready_timeout_s = ready_timeout_s

        elastic = pool is not None and pool in resource_manager.specs and resource_manager.specs[pool].elastic
        if elastic and colocate_with is not None:
            raise ResourceSpecError(
                f"Cluster({name!r}): pool {pool!r} is elastic (max_devices); a colocated cluster cannot follow its "
                "workers as they come and go; give it a pool of its own"
            )
        if (
            pool is not None and elastic and devices_per_worker > 1
        ):  # an elastic group is reserved per worker: the units first
            resource_manager.regroup(pool, devices_per_worker)
        self._plan_slots()  # every check runs before any actor exists
        if pool is not None:
            if devices_per_worker > 1 and colocate_with is None and not elastic:
                resource_manager.regroup(pool, devices_per_worker)
            resource_manager.bind(name, pool, colocate_with.name if colocate_with else None)
            try:
                self._spawn_all()
            except BaseException:
                self.shutdown()
                raise
            if wait:
                self.wait_ready()
        for m in self.methods.values():
            self._bind_method(m)
            if m.serverless is not None:
                resource_manager.store.record_endpoint(
                    resource_manager.job_id,
                    name,
                    m.name,
                    m.serverless.url,
                    m.serverless.timeout_s,
                    m.serverless.retries,
                )

    # ------------------------------------------------------------------ planning and validation
    def _plan_slots(self) -> None:
        worker_methods = [m.name for m in self.methods.values() if m.serverless is None]
        if self.pool is None:
            if worker_methods:
                raise ResourceSpecError(
                    f"Cluster({self.name!r}, pool=None): methods {worker_methods} run on workers and need a pool; "
                    "give pool=<name> (pool=None is only for classes whose methods are all @register_serverless)"
                )
            return
        if not isinstance(self.devices_per_worker, int) or self.devices_per_worker < 1:
            raise ResourceSpecError(f"Cluster({self.name!r}): devices_per_worker must be an integer >= 1")
        groups = self.resource_manager.pool_groups(self.pool)
        d = self.devices_per_worker
        rank = 0
        for rg in groups:
            amount = rg.group.amount
            if amount % d != 0:
                unit = "cpus" if rg.group.hardware == "CPU" else "devices"
                raise ResourceSpecError(
                    f"pools.{self.pool}[{rg.index}].{unit}: {amount} {rg.group.hardware} {unit} cannot be split "
                    f"into workers of devices_per_worker={d}; use a divisor of {amount} or change the pool"
                )
            for k in range(amount // d):
                slots = tuple(range(k * d, (k + 1) * d))
                # one bundle per worker: d > 1 re-reserves the pool as d-device bundles (ResourceManager.regroup)
                self._slots.append(_Slot(rank, rg.group.hardware, rg, k if d > 1 else k * d, slots))
                rank += 1
        # the pool's hardware types, also those of an elastic group that holds no device yet
        pool_hw = (
            set(self.resource_manager.specs[self.pool].hardware_types)
            if self.pool in self.resource_manager.specs
            else set()
        )
        pool_hw |= {s.hardware for s in self._slots}
        for m in self.methods.values():
            if m.hw_mapping is None:
                continue
            for tag, prefs in m.hw_mapping.mapping.items():
                if not pool_hw.intersection(prefs):
                    raise ResourceSpecError(
                        f"{self.worker_cls.__name__}.{m.name}: @hw_mapping tag {tag!r} prefers {list(prefs)} but pool "
                        f"{self.pool!r} has only {sorted(pool_hw)}; add one of them to the pool or to the mapping"
                    )
        if self._colocate_with is not None:
            other = self._colocate_with
            rm = self.resource_manager
            if rm.devices_of(other.pool or "") != rm.devices_of(self.pool) or other.devices_per_worker != d:
                raise ResourceSpecError(
                    f"Cluster({self.name!r}): colocate_with={other.name!r} runs on pool {other.pool!r} with "
                    f"devices_per_worker={other.devices_per_worker}; colocation needs the same pool and devices_per_worker"
                )
            binding = rm.bindings.get(rm.devices_of(self.pool))
            on_gpu = any(s.group.capacity.mode == "gpu" for s in self._slots)
            if on_gpu and d == 1 and binding is not None and len(binding.colocated) >= MAX_COLOCATED_ON_GPU:
                raise ResourceSpecError(
                    f"Cluster({self.name!r}): pool {self.pool!r} already has {len(binding.colocated)} colocated "
                    f"clusters {binding.colocated}; a one-GPU worker holds its owner and at most "
                    f"{MAX_COLOCATED_ON_GPU} colocated workers (fractional GPUs); give {self.name!r} its own pool"
                )

    @property
    def world_size(self) -> int:
        return len(self._slots)

    @property
    def job_id(self) -> str:
        return self.resource_manager.job_id

    # ------------------------------------------------------------------ actors
    def _actor_options(self, slot: _Slot) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=slot.group.placement_group, placement_group_bundle_index=slot.bundle_index
            ),
            "max_concurrency": self._max_concurrency,
            "name": f"{self.name}:{slot.rank}:{uuid.uuid4().hex[:6]}",
        }
        # a colocated worker shares its owner's bundle: a GPU share on one-GPU bundles, else nothing of it
        opts.update(slot.group.capacity.actor_resources(self.devices_per_worker, self._colocate_with is not None))
        if not opts.get("num_gpus") and not self._shared_devices(slot) and not workers_see_no_gpu():
            # no GPU of its own: CUDA sees no device in its process, set before anything there can
            # initialise CUDA (Ray sets CUDA_VISIBLE_DEVICES only for actors it gives GPUs); a local Ray
            # without GPUs sets it for all its workers already
            opts["runtime_env"] = {"env_vars": {CUDA_VISIBLE: ""}}
        return opts

    def _shared_devices(self, slot: _Slot) -> tuple[int, ...]:
        """The owner's GPUs, for a colocated worker that takes no GPU of its multi-GPU bundle (known once
        the owner's workers started: an owner still starting is waited for)."""
        owner = self._colocate_with
        if owner is None or slot.group.capacity.mode != "gpu" or self.devices_per_worker == 1:
            return ()
        owner.wait_ready()
        return tuple(owner._slots[slot.rank].device_ids)

    def _start_actor(self, slot: _Slot) -> ray.ObjectRef:
        ctx = WorkerContext(
            cluster=self.name,
            job_id=self.job_id,
            rank=slot.rank,
            world_size=self.world_size,
            pool=self.pool,
            hardware=slot.hardware,
            slot_ids=slot.slot_ids,
            shared_gpus=self._shared_devices(slot),
        )
        opts = self._actor_options(slot)
        if self._actor_class is None:
            # one Ray actor class for every rank and every restart: a class built per actor is pickled,
            # exported and kept by the driver once per restart (memory that grows with each fault)
            self._actor_class = ray.remote(host_class(self.worker_cls))
        slot.requested_at = time.time()
        slot.actor = self._actor_class.options(**opts).remote(ctx, self._worker_args, self._worker_kwargs)
        slot.actor_name = opts["name"]
        return slot.actor._rollart_info.remote()

    def _mark_started(self, slot: _Slot, info: dict[str, Any]) -> None:
        slot.node_id = info["node_id"]
        slot.pid = int(info.get("pid", 0))
        slot.node_ip = info.get("node_ip", "")
        slot.device_ids = tuple(info["device_ids"])
        slot.start = WorkerStart(
            requested=slot.requested_at,
            process_started=float(info.get("process_started", 0.0)),
            init_began=float(info.get("init_began", 0.0)),
            init_done=float(info.get("init_done", 0.0)),
            answered=time.time(),
            boot_cpu_s=float(info.get("boot_cpu_s", 0.0)),
            init_cpu_s=float(info.get("init_cpu_s", 0.0)),
        )
        self.resource_manager.store.record_binding(
            self.job_id,
            self.name,
            slot.rank,
            self.pool,
            slot.hardware,
            slot.node_id,
            list(slot.device_ids),
            slot.actor_name,
            node_ip=slot.node_ip,
            slot_ids=list(slot.slot_ids),
        )

    def _spawn_all(self) -> None:
        """Ask Ray for every rank's actor; their start answers wait in ``_pending`` (:meth:`wait_ready`)."""
        for slot in self._slots:
            self._pending[slot.rank] = self._start_actor(slot)

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
                self._mark_started(slot, info)
                slot.alive = True
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "cluster %s: %d workers on pool %s (%s)",
            self.name,
            self.world_size,
            self.pool,
            ", ".join(f"{s.hardware}" for s in self._slots),
        )

    def restart_worker(self, rank: int, timeout_s: float = 300.0, *, mark_alive: bool = True) -> None:
        """Replace the actor of ``rank`` (dead or alive) with a fresh one in the same placement bundle.

        ``mark_alive=False`` leaves it out of routing and control calls until :meth:`mark_alive` (a
        supervisor first loads the current weights into it)."""
        slot = self._slot(rank)
        with self._lock:
            if slot.retired:
                raise RuntimeError(f"{self.name}[rank {rank}] left the pool; it is not restarted")
            slot.alive = False
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception as err:  # already dead
            log.debug("kill %s[%d]: %s", self.name, rank, err)
        info = ray.get(self._start_actor(slot), timeout=timeout_s)
        with self._lock:
            slot.inflight = 0
            self.fault_counts["restarts"] += 1
        self._mark_started(slot, info)
        log.info("cluster %s: rank %d restarted on %s", self.name, rank, slot.hardware)
        if mark_alive:
            self.mark_alive(rank)

    def mark_alive(self, rank: int) -> None:
        """Let ``rank`` take traffic again (after :meth:`restart_worker` with ``mark_alive=False``)."""
        slot = self._slot(rank)
        with self._lock:
            if slot.retired:  # it left the pool meanwhile (its node went): it stays out
                return
            slot.alive, slot.restarting, slot.removed, slot.joining = True, False, False, False
            self._live_changed.notify_all()
        self.resource_manager.store.set_binding_state(self.job_id, self.name, rank, "running")

    def mark_restarting(self, rank: int, restarting: bool = True) -> None:
        """A supervisor is (or no longer is) bringing ``rank`` back: control calls skip it meanwhile."""
        with self._lock:
            self._slot(rank).restarting = restarting
            self._live_changed.notify_all()

    def remove_worker(self, rank: int) -> None:
        """Take ``rank`` out of the pool for good: no routed call or control call reaches it again."""
        slot = self._slot(rank)
        with self._lock:
            slot.alive, slot.restarting, slot.removed = False, False, True
            self.fault_counts["removed"] += 1
            self._live_changed.notify_all()
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception as err:
            log.debug("kill %s[%d]: %s", self.name, rank, err)
        self.resource_manager.store.set_binding_state(self.job_id, self.name, rank, "removed")

    # ------------------------------------------------------------------ membership (elastic pools)
    def add_worker(self, unit: ReservedGroup, timeout_s: float = 300.0) -> int:
        """Start a new rank in ``unit`` (one worker's devices, reserved by the ResourceManager); it takes no
        traffic until :meth:`mark_alive`. Returns its rank. A start that fails retires the rank and raises."""
        with self._lock:
            rank = len(self._slots)
            slot = _Slot(rank, unit.group.hardware, unit, 0, tuple(range(self.devices_per_worker)), joining=True)
            self._slots.append(slot)
            self._live_changed.notify_all()
        try:
            info = ray.get(self._start_actor(slot), timeout=timeout_s)
        except BaseException:
            self.retire_worker(rank, "failed")
            raise
        self._mark_started(slot, info)
        self.resource_manager.store.set_binding_state(self.job_id, self.name, rank, "joining")
        log.info("cluster %s: rank %d started on %s (host %s)", self.name, rank, slot.hardware, slot.node_ip or "?")
        return rank

    def set_draining(self, rank: int, draining: bool = True) -> None:
        """Route no new call to ``rank`` (its in-flight calls go on, control calls still reach it)."""
        slot = self._slot(rank)
        with self._lock:
            slot.draining = draining
            self._live_changed.notify_all()
        if draining:
            self.resource_manager.store.set_binding_state(self.job_id, self.name, rank, "draining")

    def wait_idle(self, rank: int, timeout_s: float) -> bool:
        """Block until ``rank`` has no routed call in flight (True) or ``timeout_s`` passes (False)."""
        slot = self._slot(rank)
        with self._live_changed:
            return self._live_changed.wait_for(lambda: slot.inflight == 0 or not slot.actor, timeout=timeout_s)

    def retire_worker(self, rank: int, state: str = "left") -> None:
        """Take ``rank`` out of the pool for good (it left an elastic pool): no call reaches it, it is never
        restarted and its death is not reported; its actor is killed. ``state`` is what the records say."""
        slot = self._slot(rank)
        with self._lock:
            slot.alive = slot.restarting = slot.joining = slot.draining = False
            slot.removed = slot.retired = True
            self._live_changed.notify_all()
        if slot.actor is not None:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception as err:
                log.debug("kill %s[%d]: %s", self.name, rank, err)
        self.resource_manager.store.set_binding_state(self.job_id, self.name, rank, state)

    def group_of(self, rank: int) -> ReservedGroup:
        """The reserved group (for an elastic pool: the unit) ``rank`` runs in."""
        return self._slot(rank).group

    def set_awaiting_workers(self, awaiting: bool) -> None:
        """Whether workers may join later (an elastic pool): routed calls then wait for one while none serves."""
        with self._lock:
            self.awaiting_workers = awaiting
            self._live_changed.notify_all()

    def is_retired(self, rank: int) -> bool:
        """Whether ``rank`` left the pool (:meth:`retire_worker`)."""
        return self._slot(rank).retired

    def fail(self, err: BaseException, cause: BaseException | None = None) -> None:
        """Every later call on this cluster raises ``err`` (a restart policy gave up with ``fail``)."""
        if cause is not None and err.__cause__ is None:
            err.__cause__ = cause
        with self._lock:
            self._fatal = err
            self._live_changed.notify_all()

    def _check_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._pending:
            raise RuntimeError(
                f"cluster {self.name!r} is still starting (Cluster(..., wait=False)): call its wait_ready() first"
            )

    def add_death_listener(self, fn: Callable[[int, BaseException | None], None]) -> None:
        """``fn(rank, cause)`` runs (in the caller's thread) each time a live rank is found dead."""
        self._death_listeners.append(fn)

    def remove_death_listener(self, fn: Callable[[int, BaseException | None], None]) -> None:
        if fn in self._death_listeners:
            self._death_listeners.remove(fn)

    def recoverable(self) -> bool:
        """Whether a rank is alive, being restarted or joining, or workers are awaited (an elastic pool that
        waits for capacity): a control call may then skip the dead ones, a routed call wait for one."""
        return self.awaiting_workers or any(s.alive or s.restarting or s.joining for s in self._slots)

    def wait_until_serving(self, timeout_s: float) -> bool:
        """Block until a rank serves (alive, not draining: True), or none can come back / ``timeout_s``
        passes (False)."""

        def serving() -> bool:
            return any(s.alive and not s.draining for s in self._slots)

        with self._live_changed:
            self._live_changed.wait_for(
                lambda: self._fatal is not None or not self.recoverable() or serving(), timeout=timeout_s
            )
            return self._fatal is None and serving()

    def start_times(self) -> list[WorkerStart]:
        """Each rank's last start (rank order): when its actor was asked for, its process and
        ``__init__`` began, ``__init__`` returned and the driver had the answer."""
        return [s.start for s in self._slots]

    def pids(self) -> dict[int, int]:
        """The process id of each rank's actor (as reported when it started)."""
        return {s.rank: s.pid for s in self._slots if not s.retired}

    def health_check(self, timeout_s: float = 10.0) -> dict[int, bool]:
        """Ping every worker; mark the unreachable ones dead. Returns rank → alive."""
        refs = {s.rank: s.actor._rollart_ping.remote() for s in self._slots if s.actor is not None and not s.retired}
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
                try:
                    ray.kill(slot.actor, no_restart=True)
                except Exception as err:
                    log.debug("kill %s[%d]: %s", self.name, slot.rank, err)
                slot.alive = False
                self.resource_manager.store.set_binding_state(self.job_id, self.name, slot.rank, "stopped")
        if self.pool is not None:
            self.resource_manager.unbind(self.name, self.pool)
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ introspection
    def _slot(self, rank: int) -> _Slot:
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
        gave its actor; empty on the CPU) and liveness of every worker."""
        return [
            {
                "rank": s.rank,
                "hardware": s.hardware,
                "node_id": s.node_id,
                "node_ip": s.node_ip,
                "slot_ids": list(s.slot_ids),
                "device_ids": list(s.device_ids),
                "alive": s.alive,
                "joining": s.joining,
                "draining": s.draining,
                "retired": s.retired,
                "served": s.served,  # routed calls it took
            }
            for s in self._slots
        ]

    def load(self) -> dict[int, dict[str, int]]:
        """Per rank: calls in flight and calls routed so far."""
        with self._lock:
            return {s.rank: {"inflight": s.inflight, "served": s.served} for s in self._slots}

    # ------------------------------------------------------------------ typed calls
    def _proxy_for(self, method: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(method, "__name__", None)
        if not isinstance(name, str) or name not in self.methods:
            raise TypeError(
                f"cluster {self.name!r}: {method!r} is not an exposed method of "
                f"{self.worker_cls.__name__}; exposed methods are {sorted(self.methods)}"
            )
        # the same name on a class of the worker's hierarchy (a subclass may override the method)
        owners = [
            c
            for c in self.worker_cls.__mro__
            if c.__dict__.get(name) is method or getattr(c.__dict__.get(name), "__func__", None) is method
        ]
        if not owners and self.methods[name].fn is not method:
            raise TypeError(
                f"cluster {self.name!r}: {getattr(method, '__qualname__', name)} is not a method of "
                f"{self.worker_cls.__name__} (pass {self.worker_cls.__name__}.{name})"
            )
        return self.__dict__[name]

    def call(self, method: Callable[Concatenate[Any, P], R], /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Call ``method`` (the worker class's method, e.g. ``Trainer.train_step``) on this cluster and
        block for the collected result: for ``@register`` what its dispatch mode collects (``ONE_TO_ALL``
        and ``ALL_TO_ALL``: a list of ``R``, one per rank; ``RANK_ZERO``: ``R``; ``DP_SPLIT``: the
        per-rank ``R`` concatenated), for ``@hw_mapping`` and ``@register_serverless`` the ``R`` of the one
        call. The arguments are type-checked against ``method``'s signature. For an ``async def`` method
        this returns its awaitable :class:`ClusterFuture` (as the attribute style does)."""
        if "blocking" in kwargs:
            raise TypeError(f"{self.name}.call: 'blocking' is not an argument of call(); use call_async() for a future")
        return self._proxy_for(method)(*args, **kwargs)

    def call_async(
        self, method: Callable[Concatenate[Any, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> Awaitable[Any]:
        """Start ``method`` without blocking; await the result (collected as in :meth:`call`). Sync and
        async worker methods alike: a :class:`ClusterFuture` (also ``.result(timeout)``) for worker
        calls, an awaitable for serverless ones."""
        if "blocking" in kwargs:
            raise TypeError(f"{self.name}.call_async: 'blocking' is not an argument of call_async()")
        out = self._proxy_for(method)(*args, blocking=False, **kwargs)
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

    # ------------------------------------------------------------------ liveness
    def _mark_dead(self, rank: int, cause: BaseException | None = None) -> None:
        slot = self._slots[rank]
        with self._lock:
            was_alive, slot.alive = slot.alive, False
            if was_alive:
                self.fault_counts["deaths"] += 1
                self._last_death = cause or self._last_death
                self._live_changed.notify_all()
        if was_alive:
            log.warning(
                "cluster %s: worker rank %d on %s (host %s) is dead",
                self.name,
                rank,
                slot.hardware,
                slot.node_ip or "?",
            )
            self.resource_manager.store.set_binding_state(self.job_id, self.name, rank, "dead")
            for listener in list(self._death_listeners):
                try:
                    listener(rank, cause)
                except Exception:
                    log.exception("cluster %s: death listener of rank %d failed", self.name, rank)

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
        with self._lock:
            self.fault_counts["skipped"] += 1
        log.warning("%s: rank %d died during a control call; skipped", self.name, rank)
        return SKIPPED

    # ------------------------------------------------------------------ binding the proxies
    def _bind_method(self, m: ExposedMethod) -> None:
        if m.serverless is not None:
            proxy = self._serverless_proxy(m, m.serverless)
        elif m.hw_mapping is not None:
            proxy = self._routed_proxy(m, m.hw_mapping)
        else:
            proxy = self._dispatch_proxy(m)
        proxy.__name__ = m.name
        proxy.__qualname__ = f"Cluster[{self.worker_cls.__name__}].{m.name}"
        proxy.__doc__ = m.fn.__doc__
        try:
            params = list(inspect.signature(m.fn).parameters.values())[1:]
            proxy.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            pass
        setattr(self, m.name, proxy)

    def _dispatch_proxy(self, m: ExposedMethod) -> Callable[..., Any]:
        spec = m.register
        assert spec is not None
        qual = f"{self.name}.{m.name}"

        skippable = spec.dispatch is Dispatch.ONE_TO_ALL and spec.dispatch_fn is None
        streamed = inspect.isgeneratorfunction(m.fn)  # by_ref: each rank answers the refs of what it yielded

        def call(*args: Any, blocking: bool = True, **kwargs: Any) -> Any:
            self._check_fatal()
            plan = plan_calls(spec, qual, self.world_size, args, kwargs)
            skip = skippable and self.skip_dead_ranks
            targets = [r for r, c in enumerate(plan) if c is not None]
            if skip:
                dead = [r for r in targets if not self._slots[r].alive]
                if dead and not self.recoverable():
                    raise self._died(dead[0], self._last_death) from self._last_death
                targets = [r for r in targets if self._slots[r].alive]
            if len(targets) > 1:  # put shared arguments into the object store once, not once per rank
                plan = _share_common_args(plan)
            calls = []
            results: dict[int, ray.ObjectRef] = {}  # by_ref: rank -> the result's ObjectRef
            for rank in targets:
                slot = self._slots[rank]
                if not slot.alive:
                    raise self._died(rank)
                a, kw = plan[rank]  # type: ignore[misc]
                if spec.by_ref and streamed:  # one object per yielded item, the list of their refs answers
                    method = getattr(slot.actor, BY_REF_PREFIX + m.name).options(num_returns="streaming")
                    calls.append((rank, method.remote(*a, **kw)))
                elif spec.by_ref:
                    method = getattr(slot.actor, BY_REF_PREFIX + m.name).options(num_returns=2)
                    results[rank], done = method.remote(*a, **kw)
                    calls.append((rank, done))  # answers the rank once the result is stored
                else:
                    calls.append((rank, getattr(slot.actor, m.name).remote(*a, **kw)))
            fut: ClusterFuture[Any] = ClusterFuture(
                calls,
                (lambda ranks: collect(spec, [results[r] for r in ranks]))
                if spec.by_ref and not streamed
                else (lambda res: collect(spec, res)),
                self._dead_skip if skip else self._dead,
            )
            if m.is_async or not blocking:
                return fut
            return fut.result()

        return call

    def _route(self, spec: HwMappingSpec, tag: str, prefer: int | None = None) -> _Slot:
        prefs = spec.preference(tag)  # an unknown tag is refused here, with or without an override
        if self.route_override is not None:
            prefs = self.route_override(tag) or prefs
        with self._lock:
            if prefer is not None and 0 <= prefer < len(self._slots):  # affinity: the rank that served before
                slot = self._slots[prefer]
                if slot.alive and not slot.draining and slot.hardware in prefs:
                    slot.inflight += 1
                    slot.served += 1
                    return slot
            for hw in prefs:
                live = [s for s in self._slots if s.hardware == hw and s.alive and not s.draining]
                if live:
                    slot = min(live, key=lambda s: (s.inflight, s.served, s.rank))
                    slot.inflight += 1
                    slot.served += 1
                    return slot
        raise NoLiveWorkerError(
            f"cluster {self.name}: no live worker of {list(prefs)} for tag {tag!r}; restart workers with restart_worker(rank)"
        )

    def route_many(
        self, method: str, tag: str, n: int, prefer: Sequence[int | None] | None = None
    ) -> list[tuple[int, Any]]:
        """Route ``n`` calls of the ``@hw_mapping`` method ``method`` for ``tag``, each as a call of its
        own would be (least-loaded live worker of the tag's preference, counted in flight): a
        ``(rank, actor)`` per call, for a caller that sends them to each worker together (one Ray call
        per worker). Each is given back with :meth:`release` once answered. ``prefer[i]``: a rank call
        ``i`` goes to while it is alive and of the tag's hardware (affinity, e.g. a session's earlier
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
        slot = self._slots[rank]
        with self._lock:
            slot.inflight = max(0, slot.inflight - n)
            if slot.draining and not slot.inflight:
                self._live_changed.notify_all()

    def worker_died(self, rank: int, err: BaseException) -> WorkerDiedError:
        """Mark ``rank`` dead (routing skips it, death listeners such as a supervisor are told) and
        return the error that names it: what a caller of a batched call raises for each of its calls."""
        self._mark_dead(rank, err)
        return self._died(rank, err)

    def _submit_routed(self, slot: _Slot, method: str, args: tuple, kwargs: dict) -> ray.ObjectRef:
        ref = getattr(slot.actor, method).remote(*args, **kwargs)

        def done(_: Any) -> None:
            with self._lock:
                slot.inflight = max(0, slot.inflight - 1)
                if slot.draining and not slot.inflight:
                    self._live_changed.notify_all()

        ref.future().add_done_callback(done)
        return ref

    def _routed_proxy(self, m: ExposedMethod, spec: HwMappingSpec) -> Callable[..., Any]:
        sig = inspect.signature(m.fn)

        def call(*args: Any, blocking: bool = True, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(None, *args, **kwargs)
            except TypeError as err:
                raise TypeError(f"{self.name}.{m.name}: {err}") from None
            tag = bound.arguments.get("tag_name")
            if not isinstance(tag, str):
                raise TypeError(f"{self.name}.{m.name}: tag_name must be a string, got {tag!r}")
            self._check_fatal()
            slot = self._route(spec, tag)

            def reroute(rank: int, err: BaseException) -> tuple[int, ray.ObjectRef]:
                self._mark_dead(rank, err)
                self._check_fatal()
                try:
                    nxt = self._route(spec, tag)
                except NoLiveWorkerError as none_left:
                    raise self._died(rank, err) from none_left
                with self._lock:
                    self.fault_counts["rerouted"] += 1
                log.info(
                    "%s.%s: rank %d died, tag %r rerouted to rank %d (%s)",
                    self.name,
                    m.name,
                    rank,
                    tag,
                    nxt.rank,
                    nxt.hardware,
                )
                return nxt.rank, self._submit_routed(nxt, m.name, args, kwargs)

            fut: ClusterFuture[Any] = ClusterFuture(
                [(slot.rank, self._submit_routed(slot, m.name, args, kwargs))], lambda res: res[0], reroute
            )
            if m.is_async or not blocking:
                return fut
            return fut.result()

        return call

    def _serverless_proxy(self, m: ExposedMethod, spec: ServerlessSpec) -> Callable[..., Any]:
        from rollart.cluster.serverless import RetryPolicy, acall_serverless, call_serverless

        sig = inspect.signature(m.fn)
        self_name = next(iter(sig.parameters))
        retry = RetryPolicy(retries=spec.retries, backoff_base_s=spec.backoff_base_s, backoff_max_s=spec.backoff_max_s)

        def payload_of(args: tuple, kwargs: dict) -> dict[str, Any]:
            try:
                bound = sig.bind(None, *args, **kwargs)
            except TypeError as err:
                raise TypeError(f"{self.name}.{m.name}: {err}") from None
            bound.apply_defaults()
            return {k: v for k, v in bound.arguments.items() if k != self_name}

        opts: dict[str, Any] = {
            "timeout_s": spec.timeout_s,
            "retry": retry,
            "token_env": spec.token_env,
            "tenant": self.job_id,
        }

        def call(*args: Any, blocking: bool = True, **kwargs: Any) -> Any:
            payload = payload_of(args, kwargs)
            if m.is_async:
                return acall_serverless(spec.url, payload, **opts)
            if not blocking:
                return self._pool_executor().submit(call_serverless, spec.url, payload, **opts)
            return call_serverless(spec.url, payload, **opts)

        return call

    def _pool_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix=f"{self.name}-serverless")
            return self._executor


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


_NOT_SHARED = (int, float, str, bool, type(None), ray.ObjectRef)  # small, or already in the object store


async def _await_future(fut: Future[Any]) -> Any:
    return await asyncio.wrap_future(fut)


def _share_common_args(plan: list[Any]) -> list[Any]:
    """Replace arguments that are the same object for every rank by one object-store reference."""
    live = [p for p in plan if p is not None]
    first_args, first_kwargs = live[0]
    shared_pos = {
        i: ray.put(a)
        for i, a in enumerate(first_args)
        if all(len(p[0]) > i and p[0][i] is a for p in live) and not isinstance(a, _NOT_SHARED)
    }
    shared_kw = {
        k: ray.put(v)
        for k, v in first_kwargs.items()
        if all(p[1].get(k) is v for p in live) and not isinstance(v, _NOT_SHARED)
    }
    out: list[Any] = []
    for p in plan:
        if p is None:
            out.append(None)
            continue
        a, kw = p
        out.append(
            (
                tuple(shared_pos.get(i, x) for i, x in enumerate(a)),
                {k: shared_kw.get(k, v) for k, v in kw.items()},
            )
        )
    return out
