"""Dynamic micro-batching: pack sequences of similar length under a token budget.

Sequences are sorted by length and cut greedily into micro-batches whose padded size
``rows * max_len`` stays within ``max_tokens``; padding is only ever added up to the longest sequence
of a micro-batch of neighbours in length, so the padding waste is small and no padded row exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def plan_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Index lists, each a micro-batch; every index appears exactly once."""
    if max_tokens <= 0:
        raise ValueError("max_tokens_per_microbatch must be > 0")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if current and max(longest, n) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


def pad_right(seqs: Sequence[Sequence[float]], value: float, dtype: torch.dtype) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), value, dtype=dtype)
    for r, s in enumerate(seqs):
        out[r, : len(s)] = torch.as_tensor(list(s), dtype=dtype)
    return out
