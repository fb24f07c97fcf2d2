"""Loss aggregation over tokens, sequences and groups (seed 000 §2.2)."""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "group-mean")


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss over the tokens where ``mask`` is 1.

    - ``token-mean``: ``sum(loss * mask) / sum(mask)``
    - ``seq-mean-token-sum``: mean over sequences of ``sum_t loss * mask``
    - ``seq-mean-token-mean``: mean over sequences of the per-sequence token mean
    - ``group-mean``: mean over groups (``group_ids``) of each group's token mean
    """
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if mode == "group-mean":
        if group_ids is None:
            raise ValueError("aggregate(mode='group-mean') needs group_ids")
        groups = torch.unique(group_ids)
        per = [
            (loss[group_ids == g] * mask[group_ids == g]).sum() / mask[group_ids == g].sum().clamp(min=1.0)
            for g in groups
        ]
        return torch.stack(per).mean()
    raise ValueError(f"unknown aggregation {mode!r}; use one of {AGG_MODES}")
