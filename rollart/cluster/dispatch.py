"""Dispatch and collect functions behind ``@register`` modes (RollArt paper §5.2, "execute_all").

``plan_calls`` turns one Cluster call into per-rank ``(args, kwargs)`` (``None``: the rank does not
run); ``collect`` turns the results of the ranks that ran into the caller's answer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollart.cluster.batch import Batch
from rollart.decorators.specs import Dispatch, Execute, RegisterSpec

RankCall = tuple[tuple, dict] | None


def plan_calls(spec: RegisterSpec, method: str, world_size: int, args: tuple, kwargs: dict) -> list[RankCall]:
    """Per-rank arguments for one call, in rank order."""
    if spec.dispatch_fn is not None:
        plan = list(spec.dispatch_fn(world_size, args, kwargs))
        if len(plan) != world_size:
            raise ValueError(f"{method}: custom dispatch_fn returned {len(plan)} entries for world_size {world_size}")
        return plan
    mode = spec.dispatch
    if mode is Dispatch.RANK_ZERO or spec.execute is Execute.RANK_ZERO:
        return [(args, kwargs)] + [None] * (world_size - 1)
    if mode is Dispatch.ONE_TO_ALL:
        return [(args, kwargs)] * world_size
    if mode is Dispatch.ALL_TO_ALL:
        for i, a in enumerate(args):
            _check_scatter(method, f"argument {i}", a, world_size)
        for k, a in kwargs.items():
            _check_scatter(method, f"argument {k!r}", a, world_size)
        return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world_size)]
    if mode is Dispatch.DP_SPLIT:
        return split_batches(method, world_size, args, kwargs)
    raise ValueError(f"{method}: unsupported dispatch mode {mode!r}")


def split_batches(
    method: str, world_size: int, args: tuple, kwargs: dict, *, call_empty: bool = False
) -> list[RankCall]:
    """``DP_SPLIT``: every ``Batch`` argument split into ``world_size`` contiguous chunks, the other
    arguments broadcast. A rank whose chunks are all empty does not run (no padding rows, no empty
    calls) unless ``call_empty`` — for methods every rank must join (collectives)."""
    split_args = [a.split(world_size) if isinstance(a, Batch) else None for a in args]
    split_kwargs = {k: v.split(world_size) for k, v in kwargs.items() if isinstance(v, Batch)}
    if not any(s is not None for s in split_args) and not split_kwargs:
        raise TypeError(f"{method} uses DP_SPLIT but got no ra.Batch argument to split")
    plan: list[RankCall] = []
    for r in range(world_size):
        rank_args = tuple(s[r] if s is not None else a for s, a in zip(split_args, args))
        rank_kwargs = {k: (split_kwargs[k][r] if k in split_kwargs else v) for k, v in kwargs.items()}
        sizes = [len(x) for x in (*rank_args, *rank_kwargs.values()) if isinstance(x, Batch)]
        plan.append((rank_args, rank_kwargs) if call_empty or any(sizes) else None)
    return plan


def _check_scatter(method: str, what: str, value: Any, world_size: int) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != world_size:
        got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(
            f"{method} uses ALL_TO_ALL: {what} must be a list of world_size={world_size} items (got {got})"
        )


def collect(spec: RegisterSpec, results: list[Any]) -> Any:
    """Combine the results of the ranks that ran (rank order)."""
    if spec.collect_fn is not None:
        return spec.collect_fn(results)
    if spec.dispatch is Dispatch.RANK_ZERO or spec.execute is Execute.RANK_ZERO:
        return results[0]
    if spec.dispatch is Dispatch.DP_SPLIT:
        return concat_results(results)
    return results


def concat_results(results: list[Any]) -> Any:
    """Concatenate per-rank DP results in rank order.

    Batches are concatenated row-wise, tensors/arrays along dim 0, lists flattened; dicts (e.g. metrics)
    become ``{key: [value of rank 0, value of rank 1, ...]}``; ``None`` results are dropped.
    """
    parts = [r for r in results if r is not None]
    if not parts:
        return None
    first = parts[0]
    if isinstance(first, Batch):
        return Batch.concat(parts)
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts, axis=0)
    if isinstance(first, (list, tuple)):
        return [x for p in parts for x in p]
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for p in parts for k in p))
        return {k: [p.get(k) for p in parts] for k in keys}
    return parts
