"""Weight transfer channels (Ray object store, torch.distributed, Mooncake) and snapshot checksums."""

from rollart.weights.ray_channel import RayObjectChannel
from rollart.weights.snapshot import ChecksumMismatch, state_checksum, verify

__all__ = ["ChecksumMismatch", "RayObjectChannel", "state_checksum", "verify"]
