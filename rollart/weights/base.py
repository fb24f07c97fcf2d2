"""What every weight channel offers (RollArt paper §5.2: the ``model_update_group`` interface).

Three channels implement :class:`WeightChannel`: the Ray object store
(:class:`~rollart.weights.ray_channel.RayObjectChannel`), a torch.distributed broadcast
(:class:`~rollart.weights.dist_channel.TorchBroadcastChannel`) and a Mooncake store
(:class:`~rollart.weights.mooncake_channel.MooncakeChannel`); :class:`~rollart.weights.host_cache.HostSharedChannel`
wraps one so each host fetches a version once. A channel is a serializable handle: the pipeline
creates it and passes the same object to the trainer (which publishes) and the inference workers
(which fetch).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class WeightChannel(Protocol):
    """Versioned weight snapshots from one publisher to many readers."""

    name: str
    # True when ``publish_async`` copies the tensors it is given before it returns: the trainer may then
    # hand over its module's live tensors (no snapshot-sized copy of its own) and train on at once
    packs_on_publish: bool

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> Any:
        """Make ``state`` available as ``version``; returns once it is (channel-specific result)."""
        ...

    def publish_async(self, state: Mapping[str, torch.Tensor], version: int, *, copy: bool = True) -> Future:
        """Publish in the background; ``copy=False`` hands over tensors the caller will not touch again."""
        ...

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """The snapshot of ``version`` as CPU tensors, checksum verified."""
        ...

    def latest(self) -> int | None:
        """The newest version published on the channel, or None."""
        ...
