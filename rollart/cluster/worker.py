"""``Worker``: the base class of every rollart worker; one Ray actor per rank (RollArt paper §5.2).

Devices: a worker's ``device_ids`` are the GPUs Ray assigned to its actor (``ray.get_gpu_ids()``), or its
owner's GPUs for a worker colocated on a multi-GPU bundle; nothing else ever becomes a CUDA device. A
worker without GPUs runs on the CPU with CUDA hidden (``CUDA_VISIBLE_DEVICES=""``: the Cluster sets it in
the actor's runtime environment, before anything in the process can initialise CUDA, and
:func:`hide_gpus` sets it again when the worker is bound). ``slot_ids`` are the worker's device slots in
its pool group: what rollart placed it on (logical devices on a CPU-only machine), never CUDA ordinals.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker sits: set by the Cluster before the user's ``__init__`` runs."""

    cluster: str
    job_id: str
    rank: int
    world_size: int
    pool: str | None
    hardware: str
    slot_ids: tuple[int, ...] = field(default_factory=tuple)
    """The worker's device slots in its pool group (logical positions, never CUDA ordinals)."""
    shared_gpus: tuple[int, ...] = ()
    """Physical GPU ids of the owner a colocated worker shares (multi-GPU bundles; it takes no GPU itself)."""


CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class WorkerStart:
    """When one worker started (Unix times; the driver's and the worker's clocks, one machine's when
    local): the Cluster asked Ray for its actor (``requested``), its process began
    (``process_started``), its ``__init__`` began (``init_began``: the process booted and imported the
    worker's modules) and returned (``init_done``: the model is loaded), and the driver had its answer
    (``answered``). Zero where unknown. ``boot_cpu_s`` and ``init_cpu_s``: the CPU seconds its process
    used before ``__init__`` (Ray's worker start, unpickling and importing the worker's modules) and in
    it (on a busy machine a phase's time is mostly waiting for a CPU; its CPU seconds are not)."""

    requested: float = 0.0
    process_started: float = 0.0
    init_began: float = 0.0
    init_done: float = 0.0
    answered: float = 0.0
    boot_cpu_s: float = 0.0
    init_cpu_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "requested": self.requested,
            "process_started": self.process_started,
            "init_began": self.init_began,
            "init_done": self.init_done,
            "answered": self.answered,
            "boot_cpu_s": self.boot_cpu_s,
            "init_cpu_s": self.init_cpu_s,
        }


def process_start_time() -> float:
    """When this process began (Unix time, to the kernel's clock tick; 0.0 when the OS does not say).
    Linux: its start in ticks since boot (``/proc/self/stat``) against the boot-time clock now, which
    is finer than ``psutil``'s (the boot time it adds is in whole seconds)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, after pid and (comm)
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # no psutil, or a platform without the process start time
        return 0.0


log = logging.getLogger(__name__)


def hide_gpus() -> bool:
    """Make CUDA see no device in this process (a worker Ray gave no GPU). Returns whether CUDA is hidden:
    False when something initialised CUDA here before (too late to hide it; logged)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        log.warning("CUDA was initialised in this CPU worker (pid %d) before rollart could hide it", os.getpid())
        return False
    os.environ[CUDA_VISIBLE] = ""
    return True


class _TaggedLogger(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{(self.extra or {}).get('tag', '')}] {msg}", kwargs


class Worker:
    """Base class of user workers.

    Attributes set before ``__init__`` runs: ``rank``, ``world_size``, ``pool``, ``hardware`` (e.g.
    ``"H800"``), ``device_ids`` (the GPUs Ray assigned to this actor; empty on the CPU, and then CUDA is
    hidden), ``slot_ids`` (its device slots in the pool group, logical on a CPU-only machine; never CUDA
    ordinals) and ``logger`` (tagged with cluster, rank and hardware). Subclasses may define
    ``__init__`` with their own arguments; the Cluster passes ``worker_args``/``worker_kwargs``.
    """

    rank: int
    world_size: int
    pool: str | None
    hardware: str
    device_ids: tuple[int, ...]
    slot_ids: tuple[int, ...]
    cluster_name: str
    job_id: str
    logger: logging.LoggerAdapter

    def _rollart_bind(self, ctx: WorkerContext) -> None:
        self.cluster_name = ctx.cluster
        self.job_id = ctx.job_id
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.pool = ctx.pool
        self.hardware = ctx.hardware
        self.slot_ids = tuple(ctx.slot_ids)
        in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
        gpu_ids = ray.get_gpu_ids() if in_actor else []
        if not gpu_ids and ctx.shared_gpus:  # before anything initialises CUDA in this process
            os.environ[CUDA_VISIBLE] = ",".join(str(g) for g in ctx.shared_gpus)
            gpu_ids = list(ctx.shared_gpus)
        if not gpu_ids and in_actor:  # an in-process worker (tests, benches) leaves its caller's CUDA alone
            hide_gpus()
        self.device_ids = tuple(int(g) for g in gpu_ids)
        gpus = f"gpu={list(self.device_ids)}" if self.device_ids else "cpu"
        tag = f"{ctx.cluster} rank={ctx.rank}/{ctx.world_size} hw={ctx.hardware} slot={list(self.slot_ids)} {gpus}"
        self.logger = _TaggedLogger(logging.getLogger(f"rollart.worker.{ctx.cluster}"), {"tag": tag})

    def _rollart_info(self) -> dict[str, Any]:
        """Placement facts the Cluster records in the metadata store."""
        return {
            "rank": self.rank,
            "hardware": self.hardware,
            "device_ids": list(self.device_ids),
            "slot_ids": list(self.slot_ids),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            # when this worker's process and __init__ began and when __init__ returned (start-up timeline)
            "process_started": process_start_time(),
            "init_began": getattr(self, "_rollart_init_began", 0.0),
            "init_done": getattr(self, "_rollart_init_done", 0.0),
            "boot_cpu_s": getattr(self, "_rollart_boot_cpu_s", 0.0),
            "init_cpu_s": getattr(self, "_rollart_init_cpu_s", 0.0),
        }

    def _rollart_ping(self) -> int:
        return self.rank

    def _rollart_allocations(self, action: str, frames: int = 12) -> tuple[list[dict[str, Any]], str] | None:
        """Where this worker's Python allocations grow (``rollart bench soak --tracemalloc-train``): ``"start"``
        tracing, take the ``"baseline"``, or the allocations ``"grown"`` since it (records and text;
        :func:`rollart.cluster.allocations.trace_allocations`)."""
        from rollart.cluster.allocations import trace_allocations

        return trace_allocations(action, frames)


def host_class(worker_cls: type[Worker]) -> type:
    """A subclass of ``worker_cls`` whose constructor binds the context before the user's ``__init__``."""

    def __init__(self: Any, ctx: WorkerContext, args: tuple, kwargs: dict) -> None:
        self._rollart_init_began = time.time()
        self._rollart_boot_cpu_s = time.process_time()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        Worker._rollart_bind(self, ctx)
        worker_cls.__init__(self, *args, **kwargs)
        self._rollart_init_done = time.time()
        self._rollart_init_cpu_s = time.process_time() - self._rollart_boot_cpu_s

    # a distinct qualname makes cloudpickle ship this class by value instead of looking up the user's
    attrs: dict[str, Any] = {
        "__init__": __init__,
        "__module__": worker_cls.__module__,
        "__qualname__": f"{worker_cls.__qualname__}.hosted",
    }
    attrs.update(_by_ref_methods(worker_cls))
    return type(worker_cls.__name__, (worker_cls,), attrs)


BY_REF_PREFIX = "_rollart_by_ref_"


def _by_ref_methods(worker_cls: type) -> dict[str, Callable[..., Any]]:
    """For each ``@register(by_ref=True)`` method ``m``, ``_rollart_by_ref_m`` returns ``(result, rank)``:
    the Cluster calls it with two returns, hands the caller the result's ObjectRef (a task's return is
    owned by the caller: its object is freed when the caller drops the ref) and waits on the small
    second one. The method itself is left as written."""
    from rollart.cluster.methods import exposed_methods

    return {
        BY_REF_PREFIX + name: _two_returns(m.fn)
        for name, m in exposed_methods(worker_cls).items()
        if m.register is not None and m.register.by_ref
    }


def _two_returns(fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isgeneratorfunction(fn):  # streamed: each item an object of its own, then the rank
        return _stream_returns(fn)

    @functools.wraps(fn, assigned=("__doc__", "__module__"), updated=())
    def call(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
        return fn(self, *args, **kwargs), self.rank

    return call


def _stream_returns(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A generator method called with ``num_returns="streaming"``: every item it yields becomes an object of
    its own as it is yielded (owned by the caller, so the worker keeps no item once it is stored), then a
    last one, the rank, tells the caller the method ran to its end."""

    @functools.wraps(fn, assigned=("__doc__", "__module__"), updated=())
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        yield from fn(self, *args, **kwargs)
        yield self.rank

    return call
