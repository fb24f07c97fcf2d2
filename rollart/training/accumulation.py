"""One optimiser step over micro-batches with gradient accumulation, shared by the actor
(``torch_strategy``) and the critic (``critic``).

A step: zero the gradients; run ``passes`` micro-batch passes (``passes`` is the largest micro-batch
count over the data-parallel ranks, see :func:`rollart.training.placement.microbatch_count`), each a
caller-supplied ``backward`` on one micro-batch, a rank with fewer micro-batches running zero passes so
every rank joins DDP's reduction; only the last pass all-reduces (``sync_grads_on_last``); then clip
(or only measure) the gradient norm and take the optimiser step. The caller weights each micro-batch's
loss so that the sum over micro-batches and ranks is the loss of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from rollart.training.microbatch import plan_microbatches
from rollart.training.placement import (
    microbatch_count,
    sync_grads_on_last,
    zero_backward,
)

MB = TypeVar("MB")


def global_sum(values: Sequence[float], distributed: bool, group: Any = None) -> list[float]:
    """``values`` summed over the data-parallel ranks of ``group`` (default: all; float64 all-reduce;
    unchanged for one process)."""
    if not distributed:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()


@dataclass
class Share(Generic[MB]):
    """This rank's share of a batch cut into micro-batches: ``plans`` (row indices of each),
    ``microbatches`` (what ``make`` built from each plan) and ``passes`` (the pass count every rank runs)."""

    lengths: list[int]
    plans: list[list[int]]
    microbatches: list[MB]
    passes: int


def plan_share(
    lengths: Sequence[int],
    max_tokens: int,
    make: Callable[[list[int]], MB],
    distributed: bool,
    plans: list[list[int]] | None = None,
    group: Any = None,
) -> Share[MB]:
    """Pack rows of ``lengths`` into micro-batches under ``max_tokens`` (or take the given ``plans``)
    and agree on the pass count with the other ranks (a collective when ``distributed``: every rank
    must call it)."""
    if plans is None:
        plans = plan_microbatches(list(lengths), max_tokens)
    mbs = [make(idx) for idx in plans]
    return Share(list(lengths), plans, mbs, microbatch_count(len(mbs), distributed, group))


def accumulate_step(
    *,
    model: torch.nn.Module,
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    share: Share[MB],
    backward: Callable[[MB], Any],
    zero_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    grad_clip: float | None,
    clip: Callable[[Sequence[torch.nn.Parameter], float | None], float] | None = None,
) -> float:
    """One optimiser step over ``share`` (see the module docstring); ``backward(mb)`` computes the
    weighted loss of one micro-batch and calls ``.backward()`` on it. Returns the total gradient norm
    before clipping. ``clip(params, grad_clip)`` replaces the clipping for sharded gradients (it returns
    the global norm, see :func:`rollart.training.sharding.clip_grad_norm`)."""
    optimizer.zero_grad(set_to_none=True)
    for i in range(share.passes):
        with sync_grads_on_last(model, i, share.passes):
            if i >= len(share.microbatches):  # fewer micro-batches than another rank: a zero pass
                zero_backward(zero_forward, device)
                continue
            backward(share.microbatches[i])
    params = list(params)
    if clip is not None:
        norm_value = clip(params, grad_clip)
        optimizer.step()
        return norm_value
    if grad_clip:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    optimizer.step()
    return float(norm)
