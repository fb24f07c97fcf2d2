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
from rollart.weights.stream import Assembler, Part, TensorMeta, TensorPiece


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

    def publish_stream(self, metas: Sequence[TensorMeta], tensors: Iterator[tuple[str, Part]], version: int) -> None:
        """Publish tensors given one at a time: each into the object store as it comes (one object per
        tensor, or per piece of a tensor that comes in pieces), the version registered once all are in. The
        checksum is the whole snapshot's (:func:`~rollart.weights.snapshot.state_checksum`), computed piece
        by piece."""
        refs: dict[str, ray.ObjectRef | list[ray.ObjectRef]] = {}
        digest = StateDigest()
        for name, part in tensors:
            digest.update(name, part)
            if isinstance(part, TensorPiece):
                pieces = refs.setdefault(name, [])
                assert isinstance(pieces, list)
                pieces.append(ray.put(part))
            else:
                refs[name] = ray.put(part)
            del part  # dropped before the stream gathers the next one
        ray.get(self._registry.put.remote(version, [refs], digest.hexdigest()))

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        entry = ray.get(self._registry.get.remote(version))
        if entry is None:
            raise KeyError(f"weight channel {self.name!r} has no version {version}")
        boxed, checksum = entry
        stored = boxed[0]
        if isinstance(stored, dict):  # a streamed publish: one object per tensor, or per piece
            whole = {name: ref for name, ref in stored.items() if not isinstance(ref, list)}
            assembler = Assembler()
            for name, t in zip(whole, ray.get(list(whole.values()))):
                assembler.add(name, t)
            for name, pieces in stored.items():
                for ref in pieces if isinstance(pieces, list) else ():
                    assembler.add(name, ray.get(ref))  # one piece at a time into its rows of the tensor
            state = dict(sorted(assembler.result().items()))
        else:
            state = ray.get(stored)
        verify(state, checksum, version)
        return state

    def latest(self) -> int | None:
        return ray.get(self._registry.latest.remote())
