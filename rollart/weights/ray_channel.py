"""Weight channel over the Ray object store.

The publisher ``ray.put``s a snapshot and registers ``(ref, checksum)`` under its version in a named
registry actor; receivers fetch a version by name, verify the checksum and load. Only the newest
``keep`` versions stay referenced, so old snapshots are freed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future

import ray
import torch

from rollart.weights.snapshot import StateDigest, state_checksum, verify
from rollart.weights.stream import TensorMeta


@ray.remote(num_cpus=0)
class _Registry:
    def __init__(self, keep: int):
        self.keep = keep
        self.entries: dict[int, tuple[list, str]] = {}

    def put(self, version: int, boxed_ref: list, checksum: str) -> None:
        self.entries[version] = (boxed_ref, checksum)
        for old in sorted(self.entries)[: -self.keep]:
            del self.entries[old]

    def get(self, version: int) -> tuple[list, str] | None:
        return self.entries.get(version)

    def latest(self) -> int | None:
        return max(self.entries) if self.entries else None


class RayObjectChannel:
    """Serializable handle: pass it to trainer and inference workers alike."""

    packs_on_publish = False  # publish_async keeps the tensors it is given (the caller hands over a copy)

    def __init__(self, name: str, keep: int = 2):
        self.name = name
        self.keep = keep
        self._registry = _Registry.options(name=f"rollart-weights:{name}", get_if_exists=True).remote(keep)

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        ref = ray.put(dict(state))
        ray.get(self._registry.put.remote(version, [ref], state_checksum(state)))

    def publish_async(self, state: Mapping[str, torch.Tensor], version: int, *, copy: bool = True) -> Future:
        """``ray.put`` already copies the snapshot into the object store: publish now, return a done future."""
        done: Future = Future()
        self.publish(state, version)
        done.set_result(None)
        return done

    def order(self, metas: Sequence[TensorMeta]) -> list[str]:
        """By name: the order the checksum hashes them in."""
        return sorted(m.name for m in metas)

    def publish_stream(
        self, metas: Sequence[TensorMeta], tensors: Iterator[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Publish tensors given one at a time: each into the object store as it comes (one object per
        tensor), the version registered once all are in."""
        refs: dict[str, ray.ObjectRef] = {}
        digest = StateDigest()
        for name, t in tensors:
            digest.update(name, t)
            refs[name] = ray.put(t)
        ray.get(self._registry.put.remote(version, [refs], digest.hexdigest()))

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        entry = ray.get(self._registry.get.remote(version))
        if entry is None:
            raise KeyError(f"weight channel {self.name!r} has no version {version}")
        boxed, checksum = entry
        stored = boxed[0]
        if isinstance(stored, dict):  # a streamed publish: one object per tensor
            state = dict(zip(stored, ray.get(list(stored.values()))))
        else:
            state = ray.get(stored)
        verify(state, checksum, version)
        return state

    def latest(self) -> int | None:
        return ray.get(self._registry.latest.remote())
