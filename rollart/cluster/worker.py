"""``Worker``: the base class of every rollart worker; one Ray actor per rank (seed 004 §5.2)."""

from __future__ import annotations

import functools
import logging
import os
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
    device_ids: tuple[int, ...] = field(default_factory=tuple)
    shared_gpus: tuple[int, ...] = ()
    """Physical GPU ids of the owner a colocated worker shares (multi-GPU bundles; it takes no GPU itself)."""


class _TaggedLogger(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{(self.extra or {}).get('tag', '')}] {msg}", kwargs


class Worker:
    """Base class of user workers.

    Attributes set before ``__init__`` runs: ``rank``, ``world_size``, ``pool``, ``hardware`` (e.g.
    ``"H800"``), ``device_ids`` (GPU ids where Ray assigned GPUs, otherwise the worker's logical device
    slots in its pool) and ``logger`` (tagged with cluster, rank and hardware). Subclasses may define
    ``__init__`` with their own arguments; the Cluster passes ``worker_args``/``worker_kwargs``.
    """

    rank: int
    world_size: int
    pool: str | None
    hardware: str
    device_ids: tuple[int, ...]
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
        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
        if not gpu_ids and ctx.shared_gpus:  # before anything initialises CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in ctx.shared_gpus)
            gpu_ids = list(ctx.shared_gpus)
        self.device_ids = tuple(int(g) for g in gpu_ids) if gpu_ids else tuple(ctx.device_ids)
        tag = f"{ctx.cluster} rank={ctx.rank}/{ctx.world_size} hw={ctx.hardware} dev={list(self.device_ids)}"
        self.logger = _TaggedLogger(logging.getLogger(f"rollart.worker.{ctx.cluster}"), {"tag": tag})

    def _rollart_info(self) -> dict[str, Any]:
        """Placement facts the Cluster records in the metadata store."""
        return {
            "rank": self.rank,
            "hardware": self.hardware,
            "device_ids": list(self.device_ids),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def _rollart_ping(self) -> int:
        return self.rank


def host_class(worker_cls: type[Worker]) -> type:
    """A subclass of ``worker_cls`` whose constructor binds the context before the user's ``__init__``."""

    def __init__(self: Any, ctx: WorkerContext, args: tuple, kwargs: dict) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        Worker._rollart_bind(self, ctx)
        worker_cls.__init__(self, *args, **kwargs)

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
    @functools.wraps(fn, assigned=("__doc__", "__module__"), updated=())
    def call(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
        return fn(self, *args, **kwargs), self.rank

    return call
