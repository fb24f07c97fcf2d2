"""What every training-side worker (actor, critic, reference) sets up the same way: its model folder,
its device, and its data-parallel group (DDP over gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist


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
    return torch.nn.parallel.DistributedDataParallel(module), backend
