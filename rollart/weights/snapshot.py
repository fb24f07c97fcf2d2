"""Versioned weight snapshots and their checksum.

A snapshot is a flat ``{name: tensor}`` state dict plus its version and a BLAKE2b digest over names,
dtypes, shapes and bytes in name order. A receiver recomputes the digest before loading, so an engine
never serves a torn or mixed snapshot.

Packed form (the Mooncake store, the per-host shared copy): every tensor back to back in one flat
``uint8`` buffer plus a layout ``[{name, dtype, shape, offset, nbytes}]`` (:func:`pack_state`, or
:func:`pack_into` a buffer the publisher reuses); its checksum (:func:`flat_checksum`) covers the
layout and the buffer in one pass, without unpacking. It is CRC-32 (``"crc32:<hex>"``): the check is
against transfer errors and torn or mixed versions, not an adversary, and CRC-32 costs the publisher
2.2 ms per 15.5 MB where SHA-256 cost 8.9 ms (this project's machine), on the trainer's own core.
A checksum without a prefix is SHA-256 (manifests written before).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from rollart.weights.stream import Part, PartReader, TensorMeta, TensorPiece, metas_of

DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def snapshot_layout(state: Mapping[str, torch.Tensor] | Sequence[TensorMeta], align: int = 64) -> list[dict[str, Any]]:
    """``[{name, dtype, shape, offset, nbytes}]`` of ``state`` (a state dict, or the :class:`TensorMeta` of
    its tensors) packed in name order, every tensor at a multiple of ``align`` bytes (so a reader can view
    it in place); the packed size is :func:`packed_nbytes`."""
    metas = metas_of(state) if isinstance(state, Mapping) else list(state)
    layout: list[dict[str, Any]] = []
    offset = 0
    for meta in sorted(metas, key=lambda m: m.name):
        nbytes = meta.nbytes
        layout.append(
            {
                "name": meta.name,
                "dtype": str(meta.dtype),
                "shape": list(meta.shape),
                "offset": offset,
                "nbytes": int(nbytes),
            }
        )
        offset += nbytes + (-nbytes % align)
    return layout


def packed_nbytes(layout: list[dict[str, Any]], align: int = 64) -> int:
    if not layout:
        return 0
    last = layout[-1]
    return last["offset"] + last["nbytes"] + (-last["nbytes"] % align)


def pack_into(state: Mapping[str, torch.Tensor], layout: list[dict[str, Any]], flat: torch.Tensor) -> None:
    """Copy ``state`` (on any device) into ``flat`` (a CPU ``uint8`` tensor of :func:`packed_nbytes`
    bytes) at ``layout``'s offsets; the alignment padding is zeroed (it is checksummed with the rest)."""
    end = 0
    with torch.no_grad():
        for item in layout:
            if item["offset"] > end:
                flat[end : item["offset"]] = 0
            end = item["offset"] + item["nbytes"]
            if item["nbytes"]:
                dst = flat[item["offset"] : end].view(DTYPES[item["dtype"]])
                dst.copy_(state[item["name"]].detach().reshape(-1))
        if flat.numel() > end:
            flat[end:] = 0


def pack_state(state: Mapping[str, torch.Tensor], align: int = 64) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """All tensors as one new flat ``uint8`` buffer plus its layout (:func:`snapshot_layout`), in one copy."""
    layout = snapshot_layout(state, align)
    flat = torch.empty(packed_nbytes(layout, align), dtype=torch.uint8)
    pack_into(state, layout, flat)
    return flat, layout


def tensor_views(flat: torch.Tensor, layout: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The tensors of ``layout`` as views of ``flat`` (no copy; pickling one writes all of ``flat``)."""
    out = {}
    for item in layout:
        dtype = DTYPES[item["dtype"]]
        raw = flat[item["offset"] : item["offset"] + item["nbytes"]]
        out[item["name"]] = (
            raw.view(dtype).reshape(item["shape"]) if item["nbytes"] else torch.empty(item["shape"], dtype=dtype)
        )
    return out


def unpack_state(flat: torch.Tensor, layout: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The tensors of ``layout`` copied out of ``flat``, each into a storage of its own: a view of
    ``flat`` would pickle all of ``flat`` (see :func:`owning_storage`)."""
    return {name: t.clone() for name, t in tensor_views(flat, layout).items()}


def packed_chunks(
    layout: list[dict[str, Any]],
    tensors: Iterator[tuple[str, Part]],
    chunk_bytes: int,
    staging: torch.Tensor,
    align: int = 64,
) -> Iterator[memoryview]:
    """The packed form of a snapshot (:func:`pack_into`'s bytes) cut in chunks of ``chunk_bytes``, built from
    tensors that arrive one at a time (whole or in row pieces) in ``layout``'s order: each is copied into
    ``staging`` (a CPU ``uint8`` tensor of at least ``chunk_bytes``, reused) and a chunk is yielded as soon as
    it is full, so nothing larger than one chunk is ever held. A yielded view is valid until the next one is
    asked for."""
    total = packed_nbytes(layout, align)
    buf = staging[:chunk_bytes]
    fill = 0

    def put(data: torch.Tensor) -> Iterator[memoryview]:
        nonlocal fill
        at = 0
        while at < data.numel():
            n = min(chunk_bytes - fill, data.numel() - at)
            buf[fill : fill + n].copy_(data[at : at + n])
            fill, at = fill + n, at + n
            if fill == chunk_bytes:
                yield memoryview(buf.numpy())
                fill = 0

    end = 0
    reader = PartReader(tensors)
    for item in layout:
        if item["offset"] > end:
            yield from put(torch.zeros(item["offset"] - end, dtype=torch.uint8))
        end = item["offset"] + item["nbytes"]
        for data in reader.parts(item["name"], item["shape"]):
            if data.numel():
                yield from put(data.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
            del data  # dropped before the stream gathers the next piece
    if total > end:
        yield from put(torch.zeros(total - end, dtype=torch.uint8))
    if fill:
        yield memoryview(buf[:fill].numpy())


def flat_checksum(flat: Any, layout: list[dict[str, Any]], algorithm: str = "crc32") -> str:
    """Checksum of a packed snapshot: its layout (names, dtypes, shapes, offsets) and its bytes, as
    ``"crc32:<hex>"`` (default) or a bare SHA-256 hex digest (``algorithm="sha256"``, older manifests).
    ``flat``: anything exposing a buffer (``bytes``, ``mmap``, numpy array) or a ``uint8`` tensor."""
    head = json.dumps(layout, sort_keys=True).encode()
    data = memoryview(flat.numpy() if isinstance(flat, torch.Tensor) else flat).cast("B")
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(data, zlib.crc32(head)):08x}"
    if algorithm == "sha256":
        h = hashlib.sha256(head)
        h.update(data)
        return h.hexdigest()
    raise ValueError(f"unknown snapshot checksum algorithm {algorithm!r} (crc32 or sha256)")


def verify_flat(flat: Any, layout: list[dict[str, Any]], expected: str, version: int) -> None:
    """Raise :class:`ChecksumMismatch` unless ``flat`` has the checksum its publisher announced (with
    the algorithm the announced checksum names)."""
    got = flat_checksum(flat, layout, "crc32" if expected.startswith("crc32:") else "sha256")
    if got != expected:
        raise ChecksumMismatch(f"weights version {version}: checksum {got} != published {expected}; not loaded")


class StateDigest:
    """:func:`state_checksum` built tensor by tensor (given in name order), so a stream of tensors is hashed
    without holding them all."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self._last: str | None = None
        self._rows = 0  # rows of the last tensor hashed so far (pieces)

    def update(self, name: str, part: Part) -> None:
        """Add a tensor, or a piece of one (its pieces one after the other, in row order: the same digest as
        the whole tensor's)."""
        if isinstance(part, TensorPiece) and part.start > 0:
            if name != self._last or part.start != self._rows:
                raise ValueError(f"StateDigest: a piece of {name!r} at row {part.start} out of order")
        else:
            if self._last is not None and name <= self._last:
                raise ValueError(f"StateDigest: tensors must come in name order ({name!r} after {self._last!r})")
            self._last = name
            dtype = part.data.dtype if isinstance(part, TensorPiece) else part.dtype
            self._h.update(name.encode())
            self._h.update(str(dtype).encode())
            self._h.update(str(tuple(part.shape)).encode())
        t = (part.data if isinstance(part, TensorPiece) else part).detach().to("cpu").contiguous()
        self._rows = part.stop if isinstance(part, TensorPiece) else 0
        self._h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def state_checksum(state: Mapping[str, torch.Tensor]) -> str:
    digest = StateDigest()
    for name in sorted(state):
        digest.update(name, state[name])
    return digest.hexdigest()


def owning_storage(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every tensor that is a view into a larger buffer copied into a storage of its own.

    Pickling a tensor (``ray.put``, an actor call's arguments or result) writes its whole storage, not
    just the bytes it views: a snapshot whose N tensors are views of one flat buffer serializes that
    buffer N times (measured: 24 tensors of a 15 MB state pickle to 360 MB). Tensors that
    already own their storage are passed through, uncopied."""
    return {
        name: t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
        for name, t in state.items()
    }


class ChecksumMismatch(RuntimeError):
    """A fetched snapshot does not hash to what its publisher announced."""


def verify(state: Mapping[str, torch.Tensor], expected: str, version: int) -> None:
    got = state_checksum(state)
    if got != expected:
        raise ChecksumMismatch(f"weights version {version}: checksum {got} != published {expected}; not loaded")
