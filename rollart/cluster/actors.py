"""A cluster's Ray actors: how each rank's actor is asked for (its placement bundle, resources and CUDA
visibility), what it reports when it started, and how it is killed. One Ray actor class serves every rank
and every restart."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollart.cluster.membership import Slot
from rollart.cluster.worker import CUDA_VISIBLE, Worker, WorkerContext, WorkerStart, host_class
from rollart.resource_manager.launcher import workers_see_no_gpu

log = logging.getLogger(__name__)


class Actors:
    """Starts, records and kills the actors of cluster ``name`` (its ``world_size()`` ranks)."""

    def __init__(
        self,
        cluster: Any,
        worker_cls: type[Worker],
        *,
        max_concurrency: int,
        worker_args: tuple,
        worker_kwargs: dict[str, Any],
        colocate_with: Any = None,
    ):
        self.cluster = cluster  # name, job_id, pool, devices_per_worker, world_size, resource_manager
        self.worker_cls = worker_cls
        self.max_concurrency = max_concurrency
        self.worker_args, self.worker_kwargs = worker_args, worker_kwargs
        self.colocate_with = colocate_with
        self.actor_class: Any = None  # the Ray actor class of worker_cls, built at the first start

    def options(self, slot: Slot) -> dict[str, Any]:
        """The Ray options of ``slot``'s actor: its bundle, concurrency, name and resources."""
        c = self.cluster
        opts: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=slot.group.placement_group, placement_group_bundle_index=slot.bundle_index
            ),
            "max_concurrency": self.max_concurrency,
            "name": f"{c.name}:{slot.rank}:{uuid.uuid4().hex[:6]}",
        }
        # a colocated worker shares its owner's bundle: a GPU share on one-GPU bundles, else nothing of it
        opts.update(slot.group.capacity.actor_resources(c.devices_per_worker, self.colocate_with is not None))
        if not opts.get("num_gpus") and not self.shared_devices(slot) and not workers_see_no_gpu():
            # no GPU of its own: CUDA sees no device in its process, set before anything there can
            # initialise CUDA (Ray sets CUDA_VISIBLE_DEVICES only for actors it gives GPUs); a local Ray
            # without GPUs sets it for all its workers already
            opts["runtime_env"] = {"env_vars": {CUDA_VISIBLE: ""}}
        return opts

    def shared_devices(self, slot: Slot) -> tuple[int, ...]:
        """The owner's GPUs, for a colocated worker that takes no GPU of its multi-GPU bundle (known once
        the owner's workers started: an owner still starting is waited for)."""
        owner = self.colocate_with
        if owner is None or slot.group.capacity.mode != "gpu" or self.cluster.devices_per_worker == 1:
            return ()
        owner.wait_ready()
        return tuple(owner._slots[slot.rank].device_ids)

    def start(self, slot: Slot) -> ray.ObjectRef:
        """Ask for ``slot``'s actor; the returned ref answers its start info once ``__init__`` returned."""
        c = self.cluster
        ctx = WorkerContext(
            cluster=c.name,
            job_id=c.job_id,
            rank=slot.rank,
            world_size=c.world_size,
            pool=c.pool,
            hardware=slot.hardware,
            slot_ids=slot.slot_ids,
            shared_gpus=self.shared_devices(slot),
        )
        opts = self.options(slot)
        if self.actor_class is None:
            # one Ray actor class for every rank and every restart: a class built per actor is pickled,
            # exported and kept by the driver once per restart (memory that grows with each fault)
            self.actor_class = ray.remote(host_class(self.worker_cls))
        slot.requested_at = time.time()
        slot.actor = self.actor_class.options(**opts).remote(ctx, self.worker_args, self.worker_kwargs)
        slot.actor_name = opts["name"]
        return slot.actor._rollart_info.remote()

    def started(self, slot: Slot, info: dict[str, Any]) -> None:
        """Record what ``slot``'s actor reported when it started (its node, process, devices, times)."""
        c = self.cluster
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
        c.resource_manager.store.record_binding(
            c.job_id,
            c.name,
            slot.rank,
            c.pool,
            slot.hardware,
            slot.node_id,
            list(slot.device_ids),
            slot.actor_name,
            node_ip=slot.node_ip,
            slot_ids=list(slot.slot_ids),
        )

    def kill(self, slot: Slot) -> None:
        if slot.actor is not None:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception as err:  # already dead
                log.debug("kill %s[%d]: %s", self.cluster.name, slot.rank, err)
