"""A cluster's ranks before any actor exists: one per ``devices_per_worker`` devices of each of the pool's
groups, checked against the worker's ``@hw_mapping`` tags and against the cluster it colocates with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollart.cluster.membership import Slot
from rollart.cluster.methods import ExposedMethod
from rollart.resource_manager.capacity import MAX_COLOCATED_ON_GPU
from rollart.resource_manager.specs import ResourceSpecError


def plan_slots(
    name: str,
    worker_cls: type,
    methods: Mapping[str, ExposedMethod],
    rm: Any,
    pool: str | None,
    devices_per_worker: int,
    colocate_with: Any = None,
) -> list[Slot]:
    """The ranks of cluster ``name`` on ``pool`` (ResourceManager ``rm``), or a ``ResourceSpecError`` naming
    what does not fit."""
    worker_methods = [m.name for m in methods.values() if m.serverless is None]
    if pool is None:
        if worker_methods:
            raise ResourceSpecError(
                f"Cluster({name!r}, pool=None): methods {worker_methods} run on workers and need a pool; "
                "give pool=<name> (pool=None is only for classes whose methods are all @register_serverless)"
            )
        return []
    d = devices_per_worker
    if not isinstance(d, int) or d < 1:
        raise ResourceSpecError(f"Cluster({name!r}): devices_per_worker must be an integer >= 1")
    slots: list[Slot] = []
    for rg in rm.pool_groups(pool):
        amount = rg.group.amount
        if amount % d != 0:
            unit = "cpus" if rg.group.hardware == "CPU" else "devices"
            raise ResourceSpecError(
                f"pools.{pool}[{rg.index}].{unit}: {amount} {rg.group.hardware} {unit} cannot be split "
                f"into workers of devices_per_worker={d}; use a divisor of {amount} or change the pool"
            )
        for k in range(amount // d):
            # one bundle per worker: d > 1 re-reserves the pool as d-device bundles (ResourceManager.regroup)
            slots.append(
                Slot(len(slots), rg.group.hardware, rg, k if d > 1 else k * d, tuple(range(k * d, (k + 1) * d)))
            )
    # the pool's hardware types, also those of an elastic group that holds no device yet
    pool_hw = set(rm.specs[pool].hardware_types) if pool in rm.specs else set()
    pool_hw |= {s.hardware for s in slots}
    for m in methods.values():
        if m.hw_mapping is None:
            continue
        for tag, prefs in m.hw_mapping.mapping.items():
            if not pool_hw.intersection(prefs):
                raise ResourceSpecError(
                    f"{worker_cls.__name__}.{m.name}: @hw_mapping tag {tag!r} prefers {list(prefs)} but pool "
                    f"{pool!r} has only {sorted(pool_hw)}; add one of them to the pool or to the mapping"
                )
    if colocate_with is not None:
        _check_colocation(name, rm, pool, d, colocate_with, slots)
    return slots


def _check_colocation(name: str, rm: Any, pool: str, d: int, other: Any, slots: list[Slot]) -> None:
    if rm.devices_of(other.pool or "") != rm.devices_of(pool) or other.devices_per_worker != d:
        raise ResourceSpecError(
            f"Cluster({name!r}): colocate_with={other.name!r} runs on pool {other.pool!r} with "
            f"devices_per_worker={other.devices_per_worker}; colocation needs the same pool and devices_per_worker"
        )
    binding = rm.bindings.get(rm.devices_of(pool))
    on_gpu = any(s.group.capacity.mode == "gpu" for s in slots)
    if on_gpu and d == 1 and binding is not None and len(binding.colocated) >= MAX_COLOCATED_ON_GPU:
        raise ResourceSpecError(
            f"Cluster({name!r}): pool {pool!r} already has {len(binding.colocated)} colocated "
            f"clusters {binding.colocated}; a one-GPU worker holds its owner and at most "
            f"{MAX_COLOCATED_ON_GPU} colocated workers (fractional GPUs); give {name!r} its own pool"
        )
