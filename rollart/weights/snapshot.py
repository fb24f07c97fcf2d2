"""Versioned weight snapshots and their checksum.

A snapshot is a flat ``{name: tensor}`` state dict plus its version and a BLAKE2b digest over names,
dtypes, shapes and bytes in name order. A receiver recomputes the digest before loading, so an engine
never serves a torn or mixed snapshot.

Packed form (the Mooncake store, the per-host shared copy): every tensor back to back in one flat
``uint8`` buffer plus a layout ``[{name, dtype, shape, offset, nbytes}]`` (:func:`pack_state`); its
digest (:func:`flat_checksum`, SHA-256: hardware-accelerated on current CPUs, 4.5x faster than BLAKE2b
on this project's machine) covers the layout and the buffer in one pass, without unpacking.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

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


def pack_state(state: Mapping[str, torch.Tensor], align: int = 64) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """All tensors as one flat ``uint8`` buffer plus ``[{name, dtype, shape, offset, nbytes}]``, in one
    copy; every tensor starts at a multiple of ``align`` bytes so a reader can view it in place."""
    layout: list[dict[str, Any]] = []
    offset = 0
    for name in sorted(state):
        t = state[name]
        nbytes = t.numel() * t.element_size()
        layout.append(
            {"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": int(nbytes)}
        )
        offset += nbytes + (-nbytes % align)
    flat = torch.empty(offset, dtype=torch.uint8)
    end = 0
    for item in layout:
        flat[end : item["offset"]] = 0  # the alignment padding (hashed with the rest)
        end = item["offset"] + item["nbytes"]
        if item["nbytes"]:
            dst = flat[item["offset"] : item["offset"] + item["nbytes"]].view(DTYPES[item["dtype"]])
            dst.copy_(state[item["name"]].detach().reshape(-1))
    flat[end:] = 0
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


def flat_checksum(flat: Any, layout: list[dict[str, Any]]) -> str:
    """SHA-256 of a packed snapshot: its layout (names, dtypes, shapes, offsets) and its bytes.
    ``flat``: anything exposing a buffer (``bytes``, ``mmap``, numpy array) or a ``uint8`` tensor."""
    h = hashlib.sha256()
    h.update(json.dumps(layout, sort_keys=True).encode())
    data = flat.numpy() if isinstance(flat, torch.Tensor) else flat
    h.update(memoryview(data).cast("B"))
    return h.hexdigest()


def verify_flat(flat: Any, layout: list[dict[str, Any]], expected: str, version: int) -> None:
    got = flat_checksum(flat, layout)
    if got != expected:
        raise ChecksumMismatch(f"weights version {version}: checksum {got} != published {expected}; not loaded")


def state_checksum(state: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


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
