"""What every training-side worker (actor, critic, reference) sets up the same way: its model folder,
its device, and its data-parallel group (DDP over gloo on CPU, NCCL on GPU).

Devices: :func:`rollart.cluster.devices.worker_device` (the same for inference workers).

Rendezvous (multi-host): rank 0 finds its own node IP and a port free there
(:meth:`DataParallelRank.rendezvous_address`); every rank joins ``tcp://<that IP>:<port>``; the gloo and
NCCL socket interface of each rank is the one carrying its node IP (``lo`` only when that IP is a
loopback address). :func:`start_data_parallel` does both steps from the driver.

The data-parallel invariant: every rank takes part in every collective of a training step in the same
order, whatever its share of the batch. ``DP_SPLIT_EVERY_RANK`` calls a rank even when its share is
empty; ``microbatch_count`` makes all ranks run the same number of micro-batches (the short ones pad
with :func:`zero_backward` passes); ``sync_grads_on_last`` lets only the last micro-batch's backward
all-reduce the accumulated gradients (DDP ``no_sync`` for the others); DDP does not broadcast
buffers in forward (the only buffers of these models are the rotary caches, equal on every rank)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from rollart.cluster.dispatch import RankCall, concat_results, split_batches
from rollart.decorators.register import register
from rollart.decorators.specs import Dispatch
from rollart.resource_manager.net import free_port, interface_of, node_ip

log = logging.getLogger(__name__)


def model_path(path: str | None) -> str:
    """``path``, or the built-in tiny model (built offline on first use) when it is None."""
    if path is not None:
        return path
    from rollart.models import default_tiny_path

    return str(default_tiny_path())


def set_socket_interface(ip: str) -> str:
    """Point gloo and NCCL at the interface carrying ``ip`` (unless the user set them); return its name."""
    name = interface_of(ip)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if os.environ.setdefault(var, name) != name:
            log.info("%s=%s kept from the environment (the interface of %s is %s)", var, os.environ[var], ip, name)
    return name


def join_data_parallel(
    module: torch.nn.Module,
    *,
    rank: int,
    world_size: int,
    backend: str,
    device: torch.device,
    master_addr: str,
    master_port: int,
) -> tuple[torch.nn.Module, str]:
    """Join the default process group and wrap ``module`` in DDP; ``("single")`` for one rank.
    ``backend="auto"`` picks NCCL on CUDA and gloo otherwise."""
    if world_size == 1:
        return module, "single"
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    init_process_group(backend, rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port)
    return wrap_ddp(module), backend


def init_process_group(backend: str, *, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join the default process group at ``tcp://master_addr:master_port`` over this node's interface."""
    iface = set_socket_interface(node_ip())
    log.info("rank %d/%d joins %s at %s:%d (interface %s)", rank, world_size, backend, master_addr, master_port, iface)
    if backend == "nccl":  # the step's sums and the gathered objects are CPU tensors: gloo carries those
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size)


def linear_warmup(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate rises linearly over the first ``steps`` optimizer steps (none for 0), then stays."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / steps) if steps > 0 else 1.0)


def apply_optimizer_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    *,
    lr: float,
    weight_decay: float,
    betas: Sequence[float],
) -> dict[str, tuple[Any, Any]]:
    """Give a restored AdamW (whose state dict brought the checkpoint's settings) the run's ``lr``,
    ``weight_decay`` and ``betas``, at the warm-up's current point; the moments and the step count stay.
    Returns what changed, ``{name: (checkpoint's, run's)}`` (empty when they were equal)."""
    groups = optimizer.param_groups
    before = {
        "lr": groups[0].get("initial_lr", lr),
        "weight_decay": groups[0]["weight_decay"],
        "betas": groups[0]["betas"],
    }
    after = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas)}
    changed = {k: (before[k], after[k]) for k in after if _floats(before[k]) != _floats(after[k])}
    if not changed:
        return {}
    scheduler.base_lrs = [lr for _ in groups]
    for group, factor in zip(groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
        group["weight_decay"] = weight_decay
        group["betas"] = tuple(betas)
    scheduler._last_lr = [g["lr"] for g in groups]  # type: ignore[attr-defined]
    return changed


def _floats(value: Any) -> list[float]:
    """A number or a sequence of numbers as a list of floats (settings compared by value)."""
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]


class DataParallelTraining:
    """What one data-parallel rank trains with (the actor's strategies and the critic compose it):
    ``forward_module``, the module its local passes call; ``model``, what its training passes call (that
    module, or its DDP wrapper once :meth:`join` put the rank in a group of more than one); AdamW over
    the trainable parameters with a linear learning-rate warm-up; ``distributed``."""

    def __init__(
        self,
        forward_module: torch.nn.Module,
        *,
        device: torch.device,
        lr: float,
        warmup_steps: int,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
    ):
        self.forward_module = forward_module
        self.model: torch.nn.Module = forward_module
        self.device = device
        self.optimizer = torch.optim.AdamW(
            [p for p in forward_module.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay, betas=betas
        )
        self.scheduler = linear_warmup(self.optimizer, warmup_steps)
        self.distributed = False
        self.group: Any = None  # the data-parallel process group (None: the default, every rank)

    def join(self, *, rank: int, world_size: int, backend: str, master_addr: str, master_port: int) -> str:
        """Join the data-parallel group (gloo on CPU, NCCL on GPU; ``backend="auto"`` picks) and train
        through DDP; returns the backend (``"single"`` for one rank)."""
        self.model, backend = join_data_parallel(
            self.forward_module,
            rank=rank,
            world_size=world_size,
            backend=backend,
            device=self.device,
            master_addr=master_addr,
            master_port=master_port,
        )
        self.distributed = backend != "single"
        return backend

    def wrapped(self, model: torch.nn.Module) -> None:
        """Train through ``model``, a DDP wrapper made elsewhere (megatron joins its own groups)."""
        self.model = model
        self.distributed = True

    def sharded(self, group: Any) -> None:
        """The module is sharded already (``fully_shard``, see :mod:`rollart.training.sharding`): it is called
        as it is, and the step's sums and pass counts go over ``group``, the data-parallel ranks."""
        self.distributed = True
        self.group = group


class DataParallelRank:
    """Mixin of the data-parallel workers (actor, critic, megatron): rank 0 names the rendezvous, every
    rank joins with ``setup_distributed``, and the worker's ``model``, ``optimizer``, ``scheduler`` and
    ``distributed`` are those of its :class:`DataParallelTraining` (``self.training``, made in its
    ``__init__``; ``self.config.backend`` names the backend)."""

    training: DataParallelTraining
    config: Any
    rank: int
    world_size: int

    @register(dispatch=Dispatch.RANK_ZERO)
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node IP and a port free there: where every rank's ``setup_distributed`` meets."""
        ip = node_ip()
        return ip, free_port(ip)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def setup_distributed(self, master_addr: str, master_port: int) -> str:
        """Join the data-parallel group (gloo on CPU, NCCL on GPU) and wrap the model in DDP."""
        return self.training.join(
            rank=self.rank,
            world_size=self.world_size,
            backend=self.config.backend,
            master_addr=master_addr,
            master_port=master_port,
        )

    @property
    def model(self) -> torch.nn.Module:
        """What the training passes call (DDP once joined)."""
        return self.training.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.training.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.training.scheduler

    @property
    def distributed(self) -> bool:
        return self.training.distributed


def start_data_parallel(cluster: Any) -> list[str]:
    """From the driver: ask rank 0 of ``cluster`` for the rendezvous, then ``setup_distributed`` on every
    rank with it; returns each rank's backend (``"single"`` for one rank)."""
    ip, port = cluster.rendezvous_address()
    return cluster.setup_distributed(ip, port)


def wrap_ddp(module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
    """DDP without forward-time buffer broadcasts: forwards are then local, and only backward passes
    (see :func:`sync_grads_on_last`) communicate."""
    return torch.nn.parallel.DistributedDataParallel(module, broadcast_buffers=False)


def microbatch_count(local: int, distributed: bool, group: Any = None) -> int:
    """The largest micro-batch count over the ranks of ``group`` (default: all; at least 1): every rank
    runs that many passes. A single process runs just its own."""
    if not distributed:
        return local
    t = torch.tensor([max(local, 1)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def sync_grads_on_last(model: torch.nn.Module, index: int, count: int) -> AbstractContextManager[Any]:
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
