"""What a device can do at best, for the roofline fractions of ``rollart bench engine`` and ``train-step``.

A GPU's memory bandwidth and dense BF16 FLOP/s come from the datasheet table
(:data:`rollart.engines.hardware.GPUS`, found by the device's name). A CPU has no such table here: its
bandwidth is measured with a copy kernel (``dst.copy_(src)`` over buffers far larger than the caches:
bytes read plus bytes written per second) and its peak FLOP/s with a large float32 matmul, both with
the thread count the bench runs with, timed in this process's CPU seconds (on a shared machine the wall
clock also counts other people's work; the benches report both for the CPU). The copy kernel is also
measured on a GPU, as a second reference.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rollart.engines.hardware import gpu_for_device


@dataclass(frozen=True)
class DevicePeaks:
    device: str  # "cpu" or "cuda:0"
    name: str  # the model name the driver or the OS reports
    bandwidth_B_s: float  # the bandwidth the roofline uses
    bandwidth_source: str
    peak_flops: float  # the FLOP/s the MFU uses
    peak_flops_source: str
    copy_B_s: float  # measured with the copy kernel

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> Any:
    """The clock a device's kernels are timed with: CPU seconds of this process on the CPU, else the wall."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def copy_bandwidth(device: torch.device, mib: int = 512, repeats: int = 5) -> float:
    """Best of ``repeats`` copies of a ``mib`` MiB float32 buffer: (read + write) bytes per second."""
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages
    now = clock(device)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = now()
        dst.copy_(src)
        _sync(device)
        best = min(best, now() - t0)
    return 2 * n * 4 / best


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Best of ``repeats`` ``size``-cubed matmuls: FLOP/s (2·n³ per product)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    (a @ b).sum()
    now = clock(device)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = now()
        a @ b
        _sync(device)
        best = min(best, now() - t0)
    return 2 * size**3 / best


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def device_peaks(device: torch.device) -> DevicePeaks:
    """The peaks of ``device``: the datasheet's for a known GPU, measured ones for the CPU (or a GPU not
    in the table). Call it with the thread count the bench runs with."""
    copy = copy_bandwidth(device, mib=1024 if device.type == "cuda" else 256)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = gpu_for_device(name)
        if gpu is not None:
            return DevicePeaks(
                str(device),
                name,
                gpu.hbm_tb_s * 1e12,
                f"datasheet {gpu.name}: {gpu.hbm_tb_s:g} TB/s",
                gpu.tflops * 1e12,
                f"datasheet {gpu.name}: {gpu.tflops:g} dense BF16 TFLOP/s",
                copy,
            )
        flops = matmul_flops(device, torch.bfloat16, size=8192)
        return DevicePeaks(str(device), name, copy, "measured copy kernel", flops, "measured bf16 matmul 8192^3", copy)
    threads = torch.get_num_threads()
    flops = matmul_flops(device, torch.float32)
    return DevicePeaks(
        "cpu",
        cpu_name(),
        copy,
        f"measured copy kernel, {threads} thread(s), CPU time",
        flops,
        f"measured fp32 matmul 2048^3, {threads} thread(s), CPU time",
        copy,
    )


def pick_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when torch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(name)
