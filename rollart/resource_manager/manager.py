"""``ResourceManager``: validate pools against the Ray cluster, reserve them as placement groups, and
keep pools, bindings and endpoints in the metadata store (RollArt paper §6, "Resource Manager").

Invariants:
- every check (spec shape, unknown hardware, over-subscription) runs before any placement group or
  actor exists, and its error names the pool and the field;
- each hardware group of a pool is one placement group of one-device (or one-CPU) bundles, so one
  job's pools never take another job's devices;
- a pool hosts one Cluster unless a second one asks to colocate with it;
- a colocated pool (``{"colocate_with": "train"}``) reserves nothing: its name stands for the other
  pool's bundles (:meth:`ResourceManager.pool_groups`, :meth:`ResourceManager.bind`);
- an elastic group (``max_devices``) is reserved one worker at a time: each worker's devices are a
  placement group of their own (a *unit*), so one worker's devices can be given back without the others
  (:meth:`ResourceManager.grow`, :meth:`ResourceManager.release`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from rollart.resource_manager.admission import Admission, wait_for_admission
from rollart.resource_manager.capacity import HardwareCapacity, node_devices, read_capacity
from rollart.resource_manager.launcher import (
    ANY_GPU,
    LocalRayPlan,
    RayStart,
    ensure_ray,
    plan_local_ray,
    starts_local_ray,
    take_ray_start,
)
from rollart.resource_manager.specs import CPU, HardwareGroup, PoolSpec, ResourceSpecError, parse_pools
from rollart.resource_manager.store import MetadataStore

log = logging.getLogger(__name__)


def resources_asked(specs: Mapping[str, PoolSpec]) -> dict[str, float]:
    """What ``specs`` (parsed pools) ask for in all, by hardware type (devices, or CPUs); a colocated pool
    asks for nothing (it shares another pool's devices)."""
    asked: dict[str, float] = {}
    for spec in specs.values():
        if spec.colocate_with is not None:
            continue
        for g in spec.groups:
            asked[g.hardware] = asked.get(g.hardware, 0) + g.amount
    return asked


def check_capacity(
    specs: Mapping[str, PoolSpec],
    capacity: Mapping[str, HardwareCapacity],
    *,
    admitted: bool = False,
    local: LocalRayPlan | None = None,
    local_resources: Mapping[str, float] | None = None,
) -> None:
    """Every pool's hardware is in ``capacity`` and the pools fit what is free of it; a
    :class:`ResourceSpecError` naming the field and the fix otherwise. ``admitted``: the job was admitted
    against the cluster's totals (placement waits for the rest), so only the names are checked.
    ``local``: ``capacity`` is the local Ray that will be started (:func:`check_local_pools`)."""
    known = ", ".join(sorted(capacity)) or "nothing"
    if local is not None:
        declared = "not set" if local_resources is None else _yaml_map(local_resources)
        cluster = (
            f"the local Ray rollart starts (it declares {known}; GPUs detected: {local.gpus.describe()}; "
            f"cluster.local_resources: {declared})"
        )
        add_name = "add it to cluster.local_resources (logical devices: their workers run on the CPU)"
    else:
        cluster, add_name = (
            f"the Ray cluster (it has {known})",
            "declare it under cluster.local_resources for a local run",
        )
    reserved = [s for s in specs.values() if s.colocate_with is None]
    for spec in specs.values():
        for i, g in enumerate(spec.groups):
            if g.hardware in capacity or (g.elastic and not g.devices):  # an elastic group may wait for it
                continue
            where = f"pools.{spec.name}[{i}]" if len(spec.groups) > 1 else f"pools.{spec.name}"
            raise ResourceSpecError(
                f"{where}.hardware: {g.hardware!r} is not in {cluster}; fix the name, or {add_name}"
            )
    if admitted:
        return
    asked = resources_asked(specs)
    for hw, need in asked.items():
        cap = capacity.get(hw)
        if cap is None:  # an elastic group waiting for hardware to join
            continue
        if need > cap.available + 1e-9:
            users = [s.name for s in reserved for g in s.groups if g.hardware == hw]
            field_name = "cpus" if hw == CPU else "devices"
            what = f"{need:g} CPUs" if hw == CPU else f"{need:g} {hw} devices"
            if local is not None:
                has = f"the local Ray rollart starts has {cap.total:g}"
                if hw == CPU:
                    cpus = (local_resources or {}).get(CPU)
                    setting = "not set" if cpus is None else f"{cpus:g}"
                    has += f" (cluster.local_resources.CPU: {setting}; this machine: {os.cpu_count() or 1})"
                fix = f"lower pools.<name>.{field_name} or raise cluster.local_resources.{hw}"
                if cap.mode == "gpu":
                    fix = f"lower pools.<name>.{field_name} (this machine has {local.gpus.describe()})"
            else:
                has = f"the cluster has {cap.available:g} free of {cap.total:g}"
                fix = f"lower pools.<name>.{field_name} or add {hw} hardware"
            raise ResourceSpecError(f"pools {users} ask for {what} but {has}; {fix}")
    # several names for the same GPUs (GPU and H100 on one machine): the sum must fit the GPUs
    on_gpus = {hw: n for hw, n in asked.items() if hw in capacity and capacity[hw].mode == "gpu"}
    every_gpu = capacity.get(ANY_GPU)
    if len(on_gpus) > 1 and every_gpu is not None and sum(on_gpus.values()) > every_gpu.available + 1e-9:
        users = [s.name for s in reserved for g in s.groups if g.hardware in on_gpus]
        split = ", ".join(f"{h}: {n:g}" for h, n in on_gpus.items())
        raise ResourceSpecError(
            f"pools {users} ask for {sum(on_gpus.values()):g} GPUs ({split}) but the cluster has "
            f"{every_gpu.available:g} free of {every_gpu.total:g}; lower pools.<name>.devices or add GPUs"
        )


def check_local_pools(
    pools: Mapping[str, Any], local_resources: Mapping[str, float] | None = None
) -> LocalRayPlan | None:
    """Before Ray starts: the checks of :meth:`ResourceManager.__init__` against the local Ray that
    :func:`~rollart.resource_manager.launcher.ensure_ray` will start for ``local_resources``
    (``cluster.local_resources``) on this machine, whose CPUs, GPUs and logical devices are known in
    advance: the plan of that Ray (its ``gpus`` can be handed to ``ensure_ray``, which then need not
    detect them again). None (nothing checked) when no local Ray would be started: a Ray already up in
    this process, or a cluster joined with ``RAY_ADDRESS``, is checked against what Ray reports."""
    if not starts_local_ray():
        return None
    specs = parse_pools(pools)
    plan = plan_local_ray(local_resources, resources_asked(specs))
    res = plan.node_resources()
    capacity = {
        hw: HardwareCapacity(hw, mode, total, free, ["local"])
        for hw, (mode, total, free) in node_devices(res, res).items()
    }
    check_capacity(specs, capacity, local=plan, local_resources=local_resources)
    return plan


def _yaml_map(values: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in values.items()) + "}"


@dataclass
class ReservedGroup:
    """One hardware group of a pool, reserved as a placement group of ``group.amount`` bundles."""

    pool: str
    index: int
    group: HardwareGroup
    capacity: HardwareCapacity
    placement_group: PlacementGroup
    name: str
    devices_per_bundle: int = 1
    elastic: bool = False  # one worker's devices of an elastic group (a unit), reserved and released alone


@dataclass
class PoolBinding:
    """The cluster that owns a pool and the clusters colocated with it."""

    owner: str
    colocated: list[str] = field(default_factory=list)


class ResourceManager:
    """Owns the job's pools.

    ``ResourceManager({"train": {"hardware": "H800", "devices": 2}, ...})`` validates and reserves at
    once. ``local_resources`` (``{"H800": 4, "H20": 4, "CPU": 16}``) is what a locally started Ray
    declares besides the GPUs it detects; by default what the pools ask for, as logical devices on a
    machine without GPUs (:mod:`rollart.resource_manager.launcher`). ``hardware: GPU`` takes GPUs of any
    type. ``store`` is the SQLite metadata file
    (default ``$ROLLART_METADATA_DB`` or ``~/.rollart/metadata.sqlite``). ``admission`` (default: from the
    environment ``rollart submit`` gives a job, else none) makes the job wait in the cluster's queue and
    keep to its quota before anything is reserved (:mod:`rollart.resource_manager.admission`).
    """

    def __init__(
        self,
        pools: Mapping[str, Any],
        *,
        job_id: str | None = None,
        store: MetadataStore | str | Path | None = None,
        local_resources: Mapping[str, float] | None = None,
        ready_timeout_s: float = 60.0,
        admission: Admission | None = None,
    ):
        self.specs: dict[str, PoolSpec] = parse_pools(pools)
        self.job_id = ensure_ray(local_resources, job_id, asked=self._resources_asked())
        # the start-up timeline: the Ray start this job waited for (None: Ray was up before), then Unix
        # times of Ray being up for this job and of its pools reserved
        self.ray_start: RayStart | None = take_ray_start()
        self.ray_ready_at = time.time()
        self.reserved_at = 0.0
        self.store = store if isinstance(store, MetadataStore) else MetadataStore(store)
        from rollart.resource_manager.registry import ClusterRegistry

        if self.store.registry is None:  # every host and driver of the Ray cluster sees this job
            self.store.registry = ClusterRegistry()
        registry = self.store.registry
        self.admission = admission if admission is not None else Admission.from_env()
        if self.admission is not None:
            users: dict[str, list[str]] = {}
            for s in self._reserved_specs():
                for g in s.groups:
                    users.setdefault(g.hardware, []).append(s.name)
            wait_for_admission(registry, self.job_id, self._resources_asked(), users, self.admission)
        self.groups: dict[str, list[ReservedGroup]] = {}
        self.bindings: dict[str, PoolBinding] = {}
        self.worker_devices: dict[str, int] = {}  # devices per worker of each pool (its bundles' size)
        self._units_lock = threading.Lock()  # the units of elastic groups come and go on another thread
        # a group's size is read and written to the store in one go: two releases at once (a scale-in of
        # several workers) must not leave the earlier, larger count as the row's last write
        self._record_lock = threading.Lock()
        self._serial = 0  # numbers the units' placement groups
        try:
            self.capacity = read_capacity()
            self._validate()
            self._reserve(ready_timeout_s)
            self.reserved_at = time.time()
        except BaseException:
            if self.admission is not None and isinstance(registry, ClusterRegistry):  # give the share back at once
                registry.end_job(self.job_id, state="failed")
            raise

    # ------------------------------------------------------------------ validation
    def _reserved_specs(self) -> list[PoolSpec]:
        """The pools with devices of their own (a colocated pool's are another pool's)."""
        return [s for s in self.specs.values() if s.colocate_with is None]

    def _resources_asked(self) -> dict[str, float]:
        return resources_asked(self.specs)

    def _validate(self) -> None:
        for spec in self.specs.values():
            for g in spec.groups:
                if g.hardware not in self.capacity and g.elastic and not g.devices:
                    log.info(
                        "pools.%s: no %s in the Ray cluster yet; the pool grows when some joins", spec.name, g.hardware
                    )
        check_capacity(self.specs, self.capacity, admitted=self.admission is not None)

    # ------------------------------------------------------------------ reservation
    def _reserve(self, ready_timeout_s: float) -> None:
        self.store.record_job(self.job_id, ray.get_runtime_context().gcs_address)
        created: list[PlacementGroup] = []
        try:
            for spec in self._reserved_specs():
                reserved = []
                for i, g in enumerate(spec.groups):
                    name = f"rollart/{self.job_id}/{spec.name}/{i}"
                    if g.elastic:  # one placement group per worker (a unit), released alone
                        for _ in range(g.amount):
                            unit = self._new_unit(spec.name, i, 1)
                            created.append(unit.placement_group)
                            reserved.append(unit)
                        continue
                    cap = self.capacity[g.hardware]
                    pg = placement_group([cap.bundle() for _ in range(g.amount)], strategy="PACK", name=name)
                    created.append(pg)
                    reserved.append(ReservedGroup(spec.name, i, g, cap, pg, name))
                self.groups[spec.name] = reserved
                self.worker_devices[spec.name] = 1
            # every pool's placement groups are asked for at once and awaited together
            ready = {rg.placement_group.ready(): rg for rgs in self.groups.values() for rg in rgs}
            _, pending = ray.wait(list(ready), num_returns=len(ready), timeout=ready_timeout_s)
            if pending:
                where = sorted({self._where(ready[r]) for r in pending})
                raise ResourceSpecError(
                    f"{', '.join(where)} could not be placed within {ready_timeout_s:.0f}s (free devices are split "
                    "across nodes or taken meanwhile); free hardware or lower that pool's devices"
                )
        except BaseException:
            for pg in created:
                remove_placement_group(pg)
            self.groups.clear()
            raise
        for spec in self._reserved_specs():
            for i in range(len(spec.groups)):
                self._record_group(spec.name, i)
        log.info(
            "job %s reserved pools %s%s",
            self.job_id,
            {s.name: s.hardware_types for s in self._reserved_specs()},
            "".join(f"; {s.name} shares {s.colocate_with}" for s in self.specs.values() if s.colocate_with),
        )

    def _where(self, rg: ReservedGroup) -> str:
        """The config field of a reserved group: ``pools.NAME`` (``pools.NAME[i]`` in a pool of several)."""
        return f"pools.{rg.pool}" + (f"[{rg.index}]" if len(self.specs[rg.pool].groups) > 1 else "")

    # ------------------------------------------------------------------ binding (used by Cluster)
    def devices_of(self, pool: str) -> str:
        """The pool whose devices ``pool`` names: itself, or the pool a colocated one shares."""
        spec = self.specs.get(pool)
        return spec.colocate_with or pool if spec is not None else pool

    def pool_groups(self, pool: str) -> list[ReservedGroup]:
        pool = self.devices_of(pool)
        if pool not in self.groups:
            raise ResourceSpecError(f"pool={pool!r} is not a pool of this ResourceManager (pools: {list(self.groups)})")
        return self.groups[pool]

    def regroup(self, pool: str, devices_per_bundle: int, ready_timeout_s: float = 60.0) -> None:
        """Re-reserve ``pool`` as bundles of ``devices_per_bundle`` devices each (one bundle per worker of
        ``devices_per_worker`` devices: a Ray actor fits in one bundle). Only an unbound pool can change."""
        groups = self.pool_groups(pool)
        pool = self.devices_of(pool)
        if self.worker_devices.get(pool, 1) == devices_per_bundle:
            return
        if pool in self.bindings:
            raise ResourceSpecError(
                f"pool {pool!r} already hosts cluster {self.bindings[pool].owner!r} with "
                f"{groups[0].devices_per_bundle} device(s) per worker; devices_per_worker={devices_per_bundle} "
                "needs a pool of its own"
            )
        for i, g in enumerate(self.specs[pool].groups):
            amounts = [g.max_devices, g.amount] if g.elastic else [g.amount]
            for amount in amounts:
                if amount is not None and amount % devices_per_bundle:
                    field = "max_devices" if g.elastic and amount == g.max_devices else "devices"
                    raise ResourceSpecError(
                        f"pools.{pool}[{i}].{field}: {amount} devices cannot be split into bundles of "
                        f"{devices_per_bundle}"
                    )
        fixed = [rg for rg in groups if not rg.elastic]
        units = [rg for rg in groups if rg.elastic]
        for rg in groups:  # free the one-device bundles first: the new ones need the same devices
            remove_placement_group(rg.placement_group)
        for rg in fixed:
            rg.placement_group = placement_group(
                [rg.capacity.bundle(devices_per_bundle) for _ in range(rg.group.amount // devices_per_bundle)],
                strategy="PACK",
                name=rg.name,
            )
            rg.devices_per_bundle = devices_per_bundle
        # an elastic group's units: one per worker of devices_per_bundle devices
        regrouped = list(fixed)
        for i in dict.fromkeys(u.index for u in units):
            total = sum(u.group.amount for u in units if u.index == i)
            regrouped += [self._new_unit(pool, i, devices_per_bundle) for _ in range(total // devices_per_bundle)]
        regrouped.sort(key=lambda rg: rg.index)  # the pool's group order (ranks follow it)
        self.groups[pool] = groups = regrouped
        self.worker_devices[pool] = devices_per_bundle
        ready = [rg.placement_group.ready() for rg in groups]
        _, pending = ray.wait(ready, num_returns=len(ready), timeout=ready_timeout_s)
        if pending:
            raise ResourceSpecError(
                f"pool {pool!r}: bundles of {devices_per_bundle} devices could not be placed within "
                f"{ready_timeout_s:.0f}s (each needs {devices_per_bundle} free devices on one node)"
            )

    # ------------------------------------------------------------------ elastic groups (units)
    def _capacity_of(self, hardware: str) -> HardwareCapacity:
        """How ``hardware`` is placed (its bundle); read again for a type that joined the cluster later."""
        cap = self.capacity.get(hardware)
        if cap is None:
            cap = read_capacity().get(hardware)
            if cap is None:
                raise ResourceSpecError(f"hardware {hardware!r} is not in the Ray cluster")
            self.capacity[hardware] = cap
        return cap

    def _new_unit(self, pool: str, index: int, devices: int) -> ReservedGroup:
        """A placement group of one bundle of ``devices`` devices of group ``index`` of ``pool`` (not waited for)."""
        hw = self.specs[pool].groups[index].hardware
        cap = self._capacity_of(hw)
        with self._units_lock:
            self._serial += 1
            name = f"rollart/{self.job_id}/{pool}/{index}/{self._serial}"
        pg = placement_group([cap.bundle(devices)], strategy="PACK", name=name)
        return ReservedGroup(
            pool, index, HardwareGroup(hardware=hw, devices=devices), cap, pg, name, devices, elastic=True
        )

    def grow(self, pool: str, index: int, timeout_s: float = 10.0) -> ReservedGroup | None:
        """Reserve one more worker's devices in the elastic group ``index`` of ``pool``; None when Ray could
        not place them within ``timeout_s`` (the devices were taken meanwhile: nothing stays reserved)."""
        group = self.specs[pool].groups[index]
        if not group.elastic:
            raise ResourceSpecError(f"pools.{pool}[{index}] is not elastic (no max_devices)")
        unit = self._new_unit(pool, index, self.worker_devices.get(pool, 1))
        try:
            ray.get(unit.placement_group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(unit.placement_group)
            return None
        with self._units_lock:
            self.groups[pool].append(unit)
        self._record_group(pool, index)
        return unit

    def release(self, unit: ReservedGroup) -> None:
        """Give a unit's devices back to the cluster (its worker must be stopped: Ray ends the actors of a
        removed placement group)."""
        try:
            remove_placement_group(unit.placement_group)
        except Exception as err:  # already gone with its node
            log.debug("placement group %s: %s", unit.name, err)
        with self._units_lock:
            if unit in self.groups.get(unit.pool, []):
                self.groups[unit.pool].remove(unit)
        self._record_group(unit.pool, unit.index)

    def units(self, pool: str, index: int | None = None) -> list[ReservedGroup]:
        """The units (workers' reservations) of the elastic groups of ``pool`` (of group ``index``)."""
        with self._units_lock:
            return [rg for rg in self.groups.get(pool, []) if rg.elastic and index in (None, rg.index)]

    def group_devices(self, pool: str, index: int) -> int:
        """The devices group ``index`` of ``pool`` holds now (an elastic group's units; a fixed group's devices)."""
        group = self.specs[pool].groups[index]
        if not group.elastic:
            return group.amount
        return sum(u.group.amount for u in self.units(pool, index))

    def resources_held(self) -> dict[str, float]:
        """What the job's pools hold now per hardware type (devices, or CPUs): the ``asks`` of its row."""
        held: dict[str, float] = {}
        for spec in self._reserved_specs():  # a colocated pool's devices are its owner's
            for i, g in enumerate(spec.groups):
                held[g.hardware] = held.get(g.hardware, 0.0) + self.group_devices(spec.name, i)
        return held

    def _record_group(self, pool: str, index: int) -> None:
        """A group's row in the store: its hardware, the devices it holds now and, elastic, its maximum."""
        g = self.specs[pool].groups[index]
        with self._record_lock:
            devices = self.group_devices(pool, index) if g.hardware != CPU else None
            self.store.record_pool(
                self.job_id,
                pool,
                index,
                g.hardware,
                devices,
                g.cpus,
                f"rollart/{self.job_id}/{pool}/{index}",
                max_devices=g.max_devices,
            )

    def bind(self, cluster: str, pool: str, colocate_with: str | None) -> None:
        """Record that ``cluster`` uses ``pool`` (a colocated pool: the pool it shares); a second cluster must
        ask to colocate."""
        self.pool_groups(pool)
        pool = self.devices_of(pool)
        current = self.bindings.get(pool)
        if colocate_with is None:
            if current is not None:
                raise ResourceSpecError(
                    f"pool {pool!r} already hosts cluster {current.owner!r}; pass colocate_with="
                    f"<the {current.owner} Cluster> to share its devices, or give {cluster!r} its own pool"
                )
            self.bindings[pool] = PoolBinding(owner=cluster)
            return
        if current is None or (colocate_with != current.owner and colocate_with not in current.colocated):
            raise ResourceSpecError(
                f"colocate_with: cluster {colocate_with!r} does not run on pool {pool!r}; colocate on its own pool"
            )
        current.colocated.append(cluster)

    def unbind(self, cluster: str, pool: str) -> None:
        binding = self.bindings.get(self.devices_of(pool))
        if binding is None:
            return
        if binding.owner == cluster:
            del self.bindings[pool]
        elif cluster in binding.colocated:
            binding.colocated.remove(cluster)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, wait_s: float = 30.0) -> None:
        """Release every placement group (waiting up to ``wait_s`` for Ray to report them removed, so the
        next job on this cluster finds the devices free) and mark the job ended in the store."""
        removed = []
        released: dict[str, float] = {}  # the Ray resources the removed groups held
        try:
            before = ray.available_resources() if self.groups else {}
        except Exception:  # no cluster left
            before = {}
        for groups in self.groups.values():
            for rg in groups:
                try:
                    remove_placement_group(rg.placement_group)
                    removed.append(rg.placement_group)
                    for bundle in rg.placement_group.bundle_specs:
                        for key, amount in bundle.items():
                            released[key] = released.get(key, 0.0) + amount
                except Exception as err:  # already gone with a dead cluster
                    log.debug("placement group %s: %s", rg.name, err)
        deadline = time.monotonic() + wait_s
        for pg in removed:
            try:
                while placement_group_table(pg).get("state") != "REMOVED" and time.monotonic() < deadline:
                    time.sleep(0.05)  # removal is asynchronous in Ray; its table says when it is done
            except Exception as err:  # the cluster went away: nothing left to wait for
                log.debug("placement group %s: %s", pg.id, err)
                break
        # Ray's view of free resources follows the removal a moment later; another job may also have
        # taken them by then, so this wait is short and never an error
        view_deadline = min(deadline, time.monotonic() + 5.0)
        while removed and time.monotonic() < view_deadline:
            try:
                now = ray.available_resources()
            except Exception:
                break
            if all(now.get(k, 0.0) >= before.get(k, 0.0) + v - 1e-6 for k, v in released.items()):
                break
            time.sleep(0.05)
        self.groups.clear()
        self.bindings.clear()
        self.store.end_job(self.job_id)
