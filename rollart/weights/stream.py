"""Weights published a bucket at a time (a sharded trainer never holds the whole model).

A publisher that cannot (or should not) make a full state dict describes its weights first: a
:class:`TensorMeta` per tensor (name, shape, dtype), known without gathering anything. The channel says
in which order it wants the tensors (:meth:`order`); the trainer gathers them in that order, a bucket of
at most a bounded number of bytes at a time, and hands them to :meth:`publish_stream` as an iterator of
``(name, tensor)``: the channel copies each one to its wire or store buffer and drops it, so the
publisher's extra memory is one bucket plus the channel's own buffer (one wire bucket, one chunk).

A tensor larger than a bucket travels as :class:`TensorPiece` s: consecutive row ranges along its first
dimension (elements of a 1-D tensor), each at most a bucket's bytes (at least one row), carrying where they
start and the whole tensor's shape. A stream item is ``(name, part)``, the part a whole tensor or a piece;
the pieces of a tensor come in row order, one after the other. Receivers write each piece into its rows of
the destination tensor (:class:`Assembler`, :func:`merge_buckets`); channels read the stream through a
:class:`PartReader`, which hands out any row range whatever the pieces' own boundaries.

Every channel of rollart implements both methods; for a channel that does not,
:func:`publish_stream` falls back to its ``publish`` with a state dict built from the stream (the
whole model in one process: what the streaming avoids).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

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


@dataclass(frozen=True)
class TensorPiece:
    """Rows ``start .. start + len(data)`` along the first dimension of a tensor of ``shape`` (for a 1-D
    tensor, elements): how a tensor larger than a bucket leaves a trainer."""

    data: torch.Tensor
    start: int
    shape: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.start + int(self.data.shape[0])

    @property
    def last(self) -> bool:
        """Whether this piece ends the tensor."""
        return self.stop >= self.shape[0]


Part: TypeAlias = torch.Tensor | TensorPiece
"""What a weight stream carries under a name: the whole tensor or one of its pieces."""


def nbytes_of(part: Part) -> int:
    data = part.data if isinstance(part, TensorPiece) else part
    return data.numel() * data.element_size()


def row_pieces(shape: Sequence[int], itemsize: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """The row ranges ``[(start, stop)]`` a tensor of ``shape`` travels in: one range (the whole tensor)
    when it fits ``bucket_bytes`` or has no rows to split (0-D), else consecutive ranges of at most
    ``bucket_bytes`` each (at least one row)."""
    numel = 1
    for d in shape:
        numel *= d
    if not shape or numel * itemsize <= bucket_bytes:
        return [(0, shape[0] if shape else 1)]
    rows = shape[0]
    row_bytes = numel // rows * itemsize
    step = max(1, bucket_bytes // max(row_bytes, 1))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


class Assembler:
    """Whole tensors out of a stream of parts: a piece is copied into its rows of a tensor allocated at its
    first piece, so a receiver holds the whole tensor and one piece, never the pieces all at once."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._filled: dict[str, int] = {}  # name -> rows written so far, for tensors still being assembled

    def add(self, name: str, part: Part) -> None:
        if not isinstance(part, TensorPiece):
            if name in self._filled:
                raise ValueError(f"weight {name!r}: a whole tensor while its pieces were being assembled")
            self.tensors[name] = part
            return
        at = self._filled.get(name)
        if at is None:
            if part.start != 0 or name in self.tensors:
                raise ValueError(f"weight {name!r}: a piece at row {part.start} before its first piece")
            self.tensors[name] = torch.empty(part.shape, dtype=part.data.dtype, device=part.data.device)
            at = 0
        if part.start != at or tuple(part.shape) != tuple(self.tensors[name].shape):
            raise ValueError(f"weight {name!r}: a piece at row {part.start} of {part.shape}, expected row {at}")
        dst = self.tensors[name]
        view = dst.reshape(1) if dst.dim() == 0 else dst
        view[part.start : part.stop].copy_(part.data)
        if part.last:
            del self._filled[name]
        else:
            self._filled[name] = part.stop

    def add_bucket(self, bucket: Mapping[str, Part]) -> None:
        for name, part in bucket.items():
            self.add(name, part)

    def result(self) -> dict[str, torch.Tensor]:
        """The whole tensors; refused while a tensor lacks some of its pieces."""
        if self._filled:
            name, rows = next(iter(self._filled.items()))
            raise ValueError(f"weight {name!r}: only its first {rows} rows arrived")
        return self.tensors


def merge_buckets(buckets: Iterable[Mapping[str, Part]]) -> dict[str, torch.Tensor]:
    """One state dict of whole tensors out of a trainer's buckets (``snapshot_weights``), pieces assembled."""
    assembler = Assembler()
    for bucket in buckets:
        assembler.add_bucket(bucket)
    return assembler.result()


class PartReader:
    """A weight stream read tensor by tensor, by rows: :meth:`rows` gives any row range of the tensor the
    stream is at (a view of one part when one holds them, else a copy of at most the range), :meth:`parts`
    its parts as they come. Each tensor must be read from its first row to its last."""

    def __init__(self, parts: Iterator[tuple[str, Part]]):
        self._it = parts
        # what is left of the part being read: name, its rows (a 0-D tensor as one row), first row, full shape
        self._pending: tuple[str, torch.Tensor, int, tuple[int, ...]] | None = None

    def _next(self, name: str) -> tuple[str, torch.Tensor, int, tuple[int, ...]]:
        if self._pending is not None:
            if self._pending[0] != name:
                raise ValueError(f"weight stream: {name!r} asked for before the rest of {self._pending[0]!r}")
            return self._pending
        try:
            got, part = next(self._it)
        except StopIteration:
            raise ValueError(f"weight stream ended before {name!r}") from None
        if got != name:
            raise ValueError(f"weight stream out of order: got {got!r}, expected {name!r}")
        if isinstance(part, TensorPiece):
            self._pending = (got, part.data, part.start, tuple(part.shape))
        else:
            self._pending = (got, part.reshape(1) if part.dim() == 0 else part, 0, tuple(part.shape))
        return self._pending

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start .. stop`` of ``name`` (0-D: rows 0 .. 1), where the last read of it ended."""
        chunks: list[torch.Tensor] = []
        at = start
        while at < stop or (at == start == 0 and self._pending is None):
            got, data, first, shape = self._next(name)
            if first != at:
                raise ValueError(f"weight {name!r}: the stream is at row {first}, asked for row {at}")
            n = min(stop - at, int(data.shape[0]))
            chunks.append(data[:n])
            self._pending = None if n == data.shape[0] else (got, data[n:], first + n, shape)
            at += n
            if n == 0:
                if at < stop:
                    raise ValueError(f"weight {name!r}: an empty part at row {at}")
                break
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def whole(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """All of ``name`` (a copy only when it came in pieces)."""
        return self.rows(name, 0, shape[0] if len(shape) else 1).reshape(tuple(shape))

    def parts(self, name: str, shape: Sequence[int]) -> Iterator[torch.Tensor]:
        """``name``'s rows as they come, part by part, till its last row (an empty tensor: one empty part)."""
        total = shape[0] if len(shape) else 1
        at = 0
        while True:
            got, data, first, _ = self._next(name)
            if first != at:
                raise ValueError(f"weight {name!r}: the stream is at row {first}, expected row {at}")
            self._pending = None
            at += int(data.shape[0])
            yield data
            if at >= total:
                return


def metas_of(state: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    """The :class:`TensorMeta` of every tensor of a state dict, in its order."""
    return [TensorMeta.of(name, t) for name, t in state.items()]


def channel_order(channel: Any, metas: Sequence[TensorMeta]) -> list[str]:
    """The order ``channel`` takes the tensors in (its ``order``; the given order for any other channel)."""
    order = getattr(channel, "order", None)
    return list(order(metas)) if callable(order) else [m.name for m in metas]


def publish_stream(channel: Any, metas: Sequence[TensorMeta], tensors: Iterable[tuple[str, Part]], version: int) -> Any:
    """Publish ``tensors`` (whole or in pieces, given in :func:`channel_order`) as ``version`` on ``channel``."""
    stream = getattr(channel, "publish_stream", None)
    if callable(stream):
        return stream(metas, iter(tensors), version)
    assembler = Assembler()
    for name, part in tensors:
        assembler.add(name, part)
    return channel.publish(assembler.result(), version)


__all__ = [
    "Assembler",
    "Part",
    "PartReader",
    "TensorMeta",
    "TensorPiece",
    "channel_order",
    "merge_buckets",
    "metas_of",
    "nbytes_of",
    "publish_stream",
    "row_pieces",
]
