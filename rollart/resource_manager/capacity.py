"""What the Ray cluster offers per hardware type, read before anything is placed.

A hardware type is the Ray resource ``accelerator_type:<TYPE>``. On a node with GPUs it marks the GPU
model and the devices are the node's ``GPU`` resource ("gpu" mode), unless the node marks the type as
logical (``rollart_logical:<TYPE>``, set by the local launcher); logical devices (one unit per device,
"logical" mode) are the type's own resource, and their workers run on the CPU. ``GPU`` is the hardware
type of every GPU, whatever its model ("gpu" mode, bundles of Ray's ``GPU`` resource alone). CPUs are
the ``CPU`` resource.

A bundle holds the devices of one worker (``devices_per_worker``; one by default). Its first worker
takes them; a colocated worker (reference, critic) shares them: on one-GPU bundles by a fractional GPU
in the same bundle (Ray then gives both the same ``CUDA_VISIBLE_DEVICES``), on larger ones by taking no
GPU and seeing its owner's GPUs (set by the Cluster).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import ray

from rollart.resource_manager.launcher import ACCEL_PREFIX, ANY_GPU, LOGICAL_PREFIX, accelerator_resource
from rollart.resource_manager.specs import CPU

log = logging.getLogger(__name__)

OWNER_GPU_SHARE = 0.5
"""What the owner of a one-GPU bundle takes: the rest stays for colocated workers."""
COLOCATED_GPU_SHARE = 0.25
"""What each colocated worker of a one-GPU bundle takes."""
MAX_COLOCATED_ON_GPU = round((1 - OWNER_GPU_SHARE) / COLOCATED_GPU_SHARE)


@dataclass
class HardwareCapacity:
    hardware: str
    mode: str  # "gpu" | "logical" | "cpu"
    total: float = 0.0
    available: float = 0.0
    node_ids: list[str] = field(default_factory=list)

    def bundle(self, devices: int = 1) -> dict[str, float]:
        """The Ray resources of one bundle of ``devices`` devices (or CPUs) of this hardware type."""
        if self.mode == "cpu":
            return {CPU: float(devices)}
        if self.mode == "gpu":
            if self.hardware == ANY_GPU:
                return {"GPU": float(devices)}
            # the accelerator_type marker is 1 per node: ask a sliver to pin the bundle to such a node
            return {"GPU": float(devices), accelerator_resource(self.hardware): 0.001}
        return {accelerator_resource(self.hardware): float(devices)}

    def actor_resources(self, devices: int = 1, colocated: bool = False) -> dict[str, Any]:
        """What a worker of a ``devices``-device bundle asks for: its owner takes the devices (on a one-GPU
        bundle :data:`OWNER_GPU_SHARE` of it), a colocated worker :data:`COLOCATED_GPU_SHARE` of a one-GPU
        bundle and nothing otherwise (it shares its owner's devices)."""
        if self.mode == "gpu":
            if devices == 1:
                return {"num_gpus": COLOCATED_GPU_SHARE if colocated else OWNER_GPU_SHARE, "num_cpus": 0.0}
            return {"num_cpus": 0.0} if colocated else {"num_gpus": float(devices), "num_cpus": 0.0}
        if colocated:
            return {"num_cpus": 0.0}
        if self.mode == "cpu":
            return {"num_cpus": float(devices)}
        return {"num_cpus": 0.0, "resources": {accelerator_resource(self.hardware): float(devices)}}


def node_devices(res: dict[str, float], free: dict[str, float]) -> dict[str, tuple[str, float, float]]:
    """One node's hardware types: ``{type: (mode, total, free)}`` from its Ray resources ``res`` and what is
    free of them (``free``); ``CPU`` for its CPUs, ``GPU`` for its GPUs of any type."""
    out: dict[str, tuple[str, float, float]] = {}
    if res.get(CPU, 0) > 0:
        out[CPU] = ("cpu", res[CPU], free.get(CPU, 0.0))
    gpus = res.get("GPU", 0.0)
    if gpus > 0:
        out[ANY_GPU] = ("gpu", gpus, free.get("GPU", 0.0))
    for key, amount in res.items():
        if not key.startswith(ACCEL_PREFIX):
            continue
        hw = key[len(ACCEL_PREFIX) :]
        if hw == ANY_GPU and gpus > 0:
            continue  # the GPUs themselves, counted above
        if gpus > 0 and f"{LOGICAL_PREFIX}{hw}" not in res:
            out[hw] = ("gpu", gpus, free.get("GPU", 0.0))
        else:
            out[hw] = ("logical", amount, free.get(key, 0.0))
    return out


def free_per_node() -> dict[str, dict[str, float]]:
    """What is free of each alive node's resources (empty where this Ray cannot tell: totals are used)."""
    try:
        return ray._private.state.available_resources_per_node()
    except Exception as err:  # a Ray without it: totals only, and say so — other jobs' use is not seen
        log.warning("cannot read free resources per node (%s); validating against cluster totals", err)
        return {}


def read_capacity() -> dict[str, HardwareCapacity]:
    """Totals and what is still free, per hardware type, over the alive nodes."""
    per_node_free = free_per_node()
    out: dict[str, HardwareCapacity] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        nid = node["NodeID"]
        for hw, (mode, total, free) in node_devices(res, per_node_free.get(nid, res)).items():
            cap = out.setdefault(hw, HardwareCapacity(hw, mode))
            cap.mode = mode if cap.mode == mode else "gpu"
            cap.total += total
            cap.available += free
            cap.node_ids.append(nid)
    return out
