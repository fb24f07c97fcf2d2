"""Pool specs, validation against Ray, placement groups and the persistent metadata store (RollArt paper §6)."""

from rollart.resource_manager.capacity import HardwareCapacity, read_capacity
from rollart.resource_manager.launcher import accelerator_resource, ensure_ray
from rollart.resource_manager.manager import ReservedGroup, ResourceManager
from rollart.resource_manager.specs import HardwareGroup, PoolSpec, ResourceSpecError, parse_pools
from rollart.resource_manager.store import MetadataStore, default_store_path

__all__ = [
    "HardwareCapacity",
    "HardwareGroup",
    "MetadataStore",
    "PoolSpec",
    "ReservedGroup",
    "ResourceManager",
    "ResourceSpecError",
    "accelerator_resource",
    "default_store_path",
    "ensure_ray",
    "parse_pools",
    "read_capacity",
]
