"""``Batch``: a dict of equal-length columns (tensors, arrays or lists) plus free-form meta.

Invariant: every column has the same first dimension ``len(batch)``. ``split(n)`` makes ``n``
contiguous chunks whose sizes differ by at most one (no padding rows), and ``Batch.concat`` of the
chunks gives back the original rows in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

Column: TypeAlias = "torch.Tensor | np.ndarray | list[Any]"


def _length(name: str, col: Any) -> int:
    if isinstance(col, (torch.Tensor, np.ndarray)):
        if col.ndim == 0:
            raise ValueError(f"Batch column {name!r} is a 0-d tensor; columns need a first (row) dimension")
        return int(col.shape[0])
    if isinstance(col, (list, tuple)):
        return len(col)
    raise TypeError(f"Batch column {name!r} has type {type(col).__name__}; use a torch.Tensor, numpy array or list")


class Batch(Mapping[str, Column]):
    """Rows of training or rollout data. ``batch["col"]`` reads a column; ``batch.meta`` is shared."""

    def __init__(self, data: Mapping[str, Column] | None = None, meta: Mapping[str, Any] | None = None):
        self.data: dict[str, Column] = {}
        self.meta: dict[str, Any] = dict(meta or {})
        size: int | None = None
        first = ""
        for name, col in (data or {}).items():
            if isinstance(col, tuple):
                col = list(col)
            n = _length(name, col)
            if size is None:
                size, first = n, name
            elif n != size:
                raise ValueError(f"Batch columns must have equal length: {first!r} has {size} rows, {name!r} has {n}")
            self.data[name] = col
        self._size = size or 0

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, key: str) -> Column:
        return self.data[key]

    def __setitem__(self, key: str, col: Column) -> None:
        """Add or replace a column; it must have ``len(batch)`` rows (any length for an empty batch)."""
        if isinstance(col, tuple):
            col = list(col)
        n = _length(key, col)
        if self.data and n != self._size:
            raise ValueError(f"Batch column {key!r} has {n} rows; the batch has {self._size}")
        self.data[key] = col
        self._size = n

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __repr__(self) -> str:
        return f"Batch(rows={self._size}, columns={list(self.data)}, meta_keys={list(self.meta)})"

    @property
    def columns(self) -> list[str]:
        return list(self.data)

    def rows(self, start: int, stop: int) -> Batch:
        """Rows ``[start, stop)`` as a new Batch (tensors are views)."""
        return Batch({k: v[start:stop] for k, v in self.data.items()}, self.meta)

    def select(self, indices: Sequence[int]) -> Batch:
        """The rows at ``indices``, in that order."""
        idx = list(indices)
        out: dict[str, Column] = {}
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                out[k] = v[torch.as_tensor(idx, dtype=torch.long)]
            elif isinstance(v, np.ndarray):
                out[k] = v[np.asarray(idx, dtype=np.int64)]
            else:
                out[k] = [v[i] for i in idx]
        return Batch(out, self.meta)

    def split(self, n: int) -> list[Batch]:
        """``n`` contiguous chunks, sizes ``ceil`` then ``floor`` of ``len/n`` (may be empty, never padded)."""
        if n <= 0:
            raise ValueError(f"Batch.split(n={n}): n must be >= 1")
        base, extra = divmod(self._size, n)
        chunks, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            chunks.append(self.rows(start, stop))
            start = stop
        return chunks

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Rows of every batch in order; columns must match; meta of the first batch is kept."""
        parts = [b for b in batches]
        if not parts:
            return Batch()
        keys = parts[0].columns
        for b in parts[1:]:
            if b.columns != keys and len(b) > 0:
                raise ValueError(f"Batch.concat: column mismatch {keys} vs {b.columns}")
        parts = [b for b in parts if len(b) > 0] or parts[:1]
        out: dict[str, Column] = {}
        for k in keys:
            cols = [b.data[k] for b in parts]
            if isinstance(cols[0], torch.Tensor):
                out[k] = torch.cat(cols, dim=0)
            elif isinstance(cols[0], np.ndarray):
                out[k] = np.concatenate(cols, axis=0)
            else:
                out[k] = [x for c in cols for x in c]
        return Batch(out, parts[0].meta)
