"""Weight transfer channels and snapshot checksums.

Every channel is a serializable handle with ``publish(state, version)``, ``publish_async(...)``,
``fetch(version)`` and ``latest()``: Ray object store (:class:`RayObjectChannel`), torch.distributed
broadcast in buckets (:class:`TorchBroadcastChannel`), Mooncake store (:class:`MooncakeChannel`, with
:class:`MooncakeMaster` to start a master on 127.0.0.1). Importing this package imports none of the
optional backends.
"""

from typing import Any

from rollart.weights.ray_channel import RayObjectChannel
from rollart.weights.snapshot import ChecksumMismatch, state_checksum, verify

_LAZY = {
    "MooncakeChannel": "rollart.weights.mooncake_channel",
    "MooncakeMaster": "rollart.weights.mooncake_master",
    "TorchBroadcastChannel": "rollart.weights.dist_channel",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = ["ChecksumMismatch", "MooncakeChannel", "MooncakeMaster", "RayObjectChannel", "TorchBroadcastChannel",
           "state_checksum", "verify"]
