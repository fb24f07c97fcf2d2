"""What every training-side worker (actor, critic, reference) sets up the same way: its model folder,
its device, and its data-parallel group (DDP over gloo on CPU, NCCL on GPU).

The data-parallel invariant: every rank takes part in every collective of a training step in the same
order, whatever its share of the batch. ``DP_SPLIT_EVERY_RANK`` calls a rank even when its share is
empty; ``microbatch_count`` makes all ranks run the same number of micro-batches (the short ones pad
with :func:`zero_backward` passes); ``sync_grads_on_last`` lets only the last micro-batch's backward
all-reduce the accumulated gradients (DDP ``no_sync`` for the others); DDP does not broadcast
buffers in forward (the only buffers of these models are the rotary caches, equal on every rank)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from rollart.cluster.dispatch import RankCall, concat_results, split_batches


def model_path(path: str | None) -> str:
    """``path``, or the built-in tiny model (built offline on first use) when it is None."""
    if path is not None:
        return path
    from rollart.models import default_tiny_path

    return str(default_tiny_path())


def worker_device(device_ids: Sequence[int]) -> torch.device:
    """The worker's first assigned GPU when CUDA is there, else the CPU."""
    return torch.device(f"cuda:{device_ids[0]}" if torch.cuda.is_available() and device_ids else "cpu")


def join_data_parallel(module: torch.nn.Module, *, rank: int, world_size: int, backend: str, device: torch.device,
                       master_addr: str, master_port: int) -> tuple[torch.nn.Module, str]:
    """Join the default process group and wrap ``module`` in DDP; ``("single")`` for one rank.
    ``backend="auto"`` picks NCCL on CUDA and gloo otherwise (gloo on the loopback interface)."""
    if world_size == 1:
        return module, "single"
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size)
    return wrap_ddp(module), backend


def wrap_ddp(module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
    """DDP without forward-time buffer broadcasts: forwards are then local, and only backward passes
    (see :func:`sync_grads_on_last`) communicate."""
    return torch.nn.parallel.DistributedDataParallel(module, broadcast_buffers=False)


def microbatch_count(local: int, distributed: bool) -> int:
    """The largest micro-batch count over the ranks (at least 1): every rank runs that many passes.
    A single process runs just its own."""
    if not distributed:
        return local
    t = torch.tensor([max(local, 1)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sync_grads_on_last(model: torch.nn.Module, index: int, count: int) -> ContextManager[Any]:
    """``model.no_sync()`` for all but the last of ``count`` passes: gradients accumulate locally and the
    last backward all-reduces their sum once, so ranks may differ in real micro-batches."""
    if index < count - 1 and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def zero_backward(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device) -> None:
    """A pass that adds nothing to the gradients but takes part in DDP's reduction: a one-token forward
    whose output is multiplied by 0 (every parameter gets a zero gradient)."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    (forward(ids, torch.ones_like(ids)).sum() * 0.0).backward()


def _split_every_rank(world_size: int, args: tuple, kwargs: dict) -> list[RankCall]:
    return split_batches("a DP_SPLIT_EVERY_RANK method", world_size, args, kwargs, call_empty=True)


DP_SPLIT_EVERY_RANK = (_split_every_rank, concat_results)
"""``DP_SPLIT`` for collective methods: every rank is called, an empty share included (plain DP_SPLIT
skips it); the results of the ranks that return something are concatenated in rank order."""
