"""Weight transfer channels and snapshot checksums.

Every channel is a serializable handle implementing :class:`WeightChannel` (``publish(state, version)``,
``publish_async(...)``, ``fetch(version)``, ``latest()``): Ray object store (:class:`RayObjectChannel`),
torch.distributed broadcast in buckets (:class:`TorchBroadcastChannel`), Mooncake store
(:class:`MooncakeChannel`, with :class:`MooncakeMaster` to start a master on a given address), and
:class:`HostSharedChannel`, which reads another channel once per host. Importing this package imports
nothing (each name loads its module on first use): the config reads the channels' kinds
(:mod:`rollart.weights.kinds`) without torch.
"""

from typing import Any

_LAZY = {
    "WeightChannel": "rollart.weights.base",
    "HostSharedChannel": "rollart.weights.host_cache",
    "RayObjectChannel": "rollart.weights.ray_channel",
    "ChecksumMismatch": "rollart.weights.snapshot",
    "state_checksum": "rollart.weights.snapshot",
    "verify": "rollart.weights.snapshot",
    "MooncakeChannel": "rollart.weights.mooncake_channel",
    "MooncakeMaster": "rollart.weights.mooncake_master",
    "TorchBroadcastChannel": "rollart.weights.dist_channel",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = [
    "ChecksumMismatch",
    "HostSharedChannel",
    "MooncakeChannel",
    "MooncakeMaster",
    "RayObjectChannel",
    "TorchBroadcastChannel",
    "WeightChannel",
    "state_checksum",
    "verify",
]
