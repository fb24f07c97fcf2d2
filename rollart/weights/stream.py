"""Weights published a bucket at a time (a sharded trainer never holds the whole model).

A publisher that cannot (or should not) make a full state dict describes its weights first: a
:class:`TensorMeta` per tensor (name, shape, dtype), known without gathering anything. The channel says
in which order it wants the tensors (:meth:`order`); the trainer gathers them in that order, a bucket of
at most a bounded number of bytes at a time, and hands them to :meth:`publish_stream` as an iterator of
``(name, tensor)``: the channel copies each one to its wire or store buffer and drops it, so the
publisher's extra memory is one bucket plus the channel's own buffer (one wire bucket, one chunk).

Every channel of rollart implements both methods; for a channel that does not,
:func:`publish_stream` falls back to its ``publish`` with a state dict built from the stream (the
whole model in one process: what the streaming avoids).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorMeta:
    """What a channel needs to lay out a tensor before its bytes exist: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorMeta:
        return cls(name, tuple(t.shape), t.dtype)


def metas_of(state: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    """The :class:`TensorMeta` of every tensor of a state dict, in its order."""
    return [TensorMeta.of(name, t) for name, t in state.items()]


def channel_order(channel: Any, metas: Sequence[TensorMeta]) -> list[str]:
    """The order ``channel`` takes the tensors in (its ``order``; the given order for any other channel)."""
    order = getattr(channel, "order", None)
    return list(order(metas)) if callable(order) else [m.name for m in metas]


def publish_stream(
    channel: Any, metas: Sequence[TensorMeta], tensors: Iterable[tuple[str, torch.Tensor]], version: int
) -> Any:
    """Publish ``tensors`` (given in :func:`channel_order`) as ``version`` on ``channel``."""
    stream = getattr(channel, "publish_stream", None)
    if callable(stream):
        return stream(metas, iter(tensors), version)
    return channel.publish(dict(tensors), version)


def take_in_order(tensors: Iterator[tuple[str, torch.Tensor]], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The next ``len(names)`` tensors of the stream, checked to be ``names`` in that order."""
    out: dict[str, torch.Tensor] = {}
    for expected in names:
        try:
            name, t = next(tensors)
        except StopIteration:
            raise ValueError(f"weight stream ended before {expected!r}") from None
        if name != expected:
            raise ValueError(f"weight stream out of order: got {name!r}, expected {expected!r}")
        out[name] = t
    return out


__all__ = ["TensorMeta", "channel_order", "metas_of", "publish_stream", "take_in_order"]
