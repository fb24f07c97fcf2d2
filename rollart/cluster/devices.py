"""A worker's torch devices from the device ids Ray gave it.

Inside an actor that Ray gave GPUs, ``CUDA_VISIBLE_DEVICES`` lists exactly those GPUs (Ray's documented
semantics), so the worker's devices are ``cuda:0 .. cuda:n-1`` whatever their physical ids. Inference
and training workers both place their models with these. A worker's ``device_ids`` hold only the GPUs
Ray assigned it (:mod:`rollart.cluster.worker`); a worker without them (a CPU pool, logical devices)
gets the CPU, and its process sees no CUDA device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def worker_devices(device_ids: Sequence[int], cuda: bool | None = None) -> list[torch.device]:
    """The worker's devices: ``cuda:0 .. cuda:n-1`` for its ``n`` GPUs (``Worker.device_ids``: the GPUs Ray
    assigned it, made visible as exactly those, so their physical ids do not matter here); ``[cpu]``
    without CUDA or without GPUs."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda or not device_ids:
        return [torch.device("cpu")]
    return [torch.device("cuda", i) for i in range(len(device_ids))]


def worker_device(device_ids: Sequence[int], cuda: bool | None = None) -> torch.device:
    """The worker's main device: ``cuda:0`` when it has GPUs (see :func:`worker_devices`), else the CPU."""
    return worker_devices(device_ids, cuda)[0]
