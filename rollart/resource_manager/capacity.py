"""What the Ray cluster offers per hardware type, read before anything is placed.

A hardware type is the Ray resource ``accelerator_type:<TYPE>``. On a node with GPUs it marks the GPU
model and the devices are the node's ``GPU`` resource ("gpu" mode); on a node without GPUs the local
launcher declares it with one unit per logical device ("logical" mode). CPUs are the ``CPU`` resource.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray

from rollart.resource_manager.launcher import ACCEL_PREFIX, accelerator_resource
from rollart.resource_manager.specs import CPU

log = logging.getLogger(__name__)


@dataclass
class HardwareCapacity:
    hardware: str
    mode: str  # "gpu" | "logical" | "cpu"
    total: float = 0.0
    available: float = 0.0
    node_ids: list[str] = field(default_factory=list)

    def bundle(self) -> dict[str, float]:
        """The Ray resources of one device (or one CPU) bundle of this hardware type."""
        if self.mode == "cpu":
            return {CPU: 1.0}
        if self.mode == "gpu":
            # the accelerator_type marker is 1 per node: ask a sliver to pin the bundle to such a node
            return {"GPU": 1.0, accelerator_resource(self.hardware): 0.001}
        return {accelerator_resource(self.hardware): 1.0}

    def actor_resources(self) -> dict[str, float]:
        """What the first worker of a bundle asks for (it takes the bundle's device)."""
        if self.mode == "cpu":
            return {"num_cpus": 1.0}
        if self.mode == "gpu":
            return {"num_gpus": 1.0, "num_cpus": 0.0}
        return {"num_cpus": 0.0, "resources": {accelerator_resource(self.hardware): 1.0}}


def read_capacity() -> dict[str, HardwareCapacity]:
    """Totals and what is still free, per hardware type, over the alive nodes."""
    try:
        per_node_free = ray._private.state.available_resources_per_node()  # noqa: SLF001
    except Exception as err:  # a Ray without it: totals only, and say so — other jobs' use is not seen
        log.warning("cannot read free resources per node (%s); validating against cluster totals", err)
        per_node_free = {}
    out: dict[str, HardwareCapacity] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        nid = node["NodeID"]
        free = per_node_free.get(nid, res)
        if res.get(CPU, 0) > 0:
            cap = out.setdefault(CPU, HardwareCapacity(CPU, "cpu"))
            cap.total += res[CPU]
            cap.available += free.get(CPU, 0.0)
            cap.node_ids.append(nid)
        for key, amount in res.items():
            if not key.startswith(ACCEL_PREFIX):
                continue
            hw = key[len(ACCEL_PREFIX):]
            gpus = res.get("GPU", 0.0)
            mode = "gpu" if gpus > 0 else "logical"
            cap = out.setdefault(hw, HardwareCapacity(hw, mode))
            cap.mode = mode if cap.mode == mode else "gpu"
            if mode == "gpu":
                cap.total += gpus
                cap.available += free.get("GPU", 0.0)
            else:
                cap.total += amount
                cap.available += free.get(key, 0.0)
            cap.node_ids.append(nid)
    return out
