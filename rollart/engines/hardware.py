"""Per-hardware latency profiles for the simulated engine (RollArt paper §3.1, Table 2).

A roofline per engine step: the step's FLOPs over the device's dense BF16 throughput against the
bytes it reads (the weights once, plus the KV cache of every running sequence) over its HBM
bandwidth; the step takes the longer of the two. Prefill of ``n`` new prompt tokens costs
``2·params·n`` FLOPs, so it is compute-bound and scales with TFLOPs; one decode step of ``B``
sequences costs ``2·params·B`` FLOPs but reads all weights, so at the batch sizes of rollout it is
bandwidth-bound and scales with HBM bandwidth.

The figures are the datasheet ones the RollArt paper quotes (Table 2): H800 989.5
dense BF16 TFLOPs and 3.35 TB/s HBM; H20 148 TFLOPs and 4.0 TB/s. The relative cost per device hour
is the RollArt paper's "Normalized Cost" row (H20 1.00, H800 2.85, after MegaScale-Infer): the cost-equivalent
pools of Fig. 4 (2 H800 vs 6 H20) and Fig. 11a (72 H800 vs 208 H20 vs 64 H800 + 24 H20) follow from it.
The default model is the RollArt paper's Qwen3-8B in BF16 (8.2 B parameters; 36 layers, 8 KV heads of 128:
144 KiB of KV cache per token). Ideal utilisation on both devices: the ratios between devices, which
are what the affinity comparison rests on, do not depend on a common efficiency factor.

:data:`GPUS` holds the datasheet peaks of the GPUs rollart's benchmarks meet (dense BF16 tensor
TFLOPs, HBM bandwidth and size); :func:`gpu_for_device` finds the entry of a CUDA device by the name
the driver reports (``torch.cuda.get_device_name``), telling the SXM, PCIe and NVL variants apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    tflops: float  # dense BF16, 1e12 FLOP/s
    hbm_tb_s: float  # HBM bandwidth, 1e12 B/s
    hbm_gb: float
    cost: float | None = None  # relative cost per device hour (H20 = 1); the simulated profiles have one


HARDWARE: dict[str, Hardware] = {
    "H800": Hardware("H800", tflops=989.5, hbm_tb_s=3.35, hbm_gb=80.0, cost=2.85),
    "H20": Hardware("H20", tflops=148.0, hbm_tb_s=4.0, hbm_gb=96.0, cost=1.0),
}


GPUS: dict[str, Hardware] = {
    **HARDWARE,
    # NVIDIA datasheets: dense BF16 tensor-core TFLOPs (half the "with sparsity" figure), HBM TB/s, GB
    "H100": Hardware("H100", tflops=989.4, hbm_tb_s=3.35, hbm_gb=80.0),  # SXM5
    "H100-PCIe": Hardware("H100-PCIe", tflops=756.0, hbm_tb_s=2.0, hbm_gb=80.0),
    "H100-NVL": Hardware("H100-NVL", tflops=835.0, hbm_tb_s=3.9, hbm_gb=94.0),
    "H200": Hardware("H200", tflops=989.4, hbm_tb_s=4.8, hbm_gb=141.0),  # SXM
    "A100": Hardware("A100", tflops=312.0, hbm_tb_s=2.039, hbm_gb=80.0),  # SXM4 80GB
    "A100-40GB": Hardware("A100-40GB", tflops=312.0, hbm_tb_s=1.555, hbm_gb=40.0),
    "L40S": Hardware("L40S", tflops=362.0, hbm_tb_s=0.864, hbm_gb=48.0),
}


def gpu_for_device(device_name: str) -> Hardware | None:
    """The :data:`GPUS` entry of a CUDA device name (``NVIDIA H100 80GB HBM3`` → H100, ``NVIDIA H100
    PCIe`` → H100-PCIe, ``NVIDIA A100-SXM4-40GB`` → A100-40GB); None for a device not in the table."""
    name = device_name.upper()

    def has(model: str) -> bool:
        return re.search(rf"(?<![A-Z0-9]){model}(?![0-9])", name) is not None

    if has("H100"):
        return GPUS["H100-PCIe" if "PCIE" in name else "H100-NVL" if "NVL" in name else "H100"]
    if has("A100"):
        return GPUS["A100-40GB" if "40GB" in name else "A100"]
    for model in ("H200", "H800", "H20", "L40S"):
        if has(model):
            return GPUS[model]
    return None


@dataclass(frozen=True)
class ModelShape:
    """What the latency depends on: parameters and KV bytes per token (BF16 by default)."""

    name: str = "Qwen3-8B"
    params: float = 8.2e9
    bytes_per_param: float = 2.0
    kv_bytes_per_token: float = 36 * 2 * 8 * 128 * 2.0  # layers · (K, V) · kv heads · head dim · bytes


@dataclass(frozen=True)
class HardwareProfile:
    """The step-time model of one device running one model."""

    hardware: Hardware
    model: ModelShape = ModelShape()

    @property
    def name(self) -> str:
        return self.hardware.name

    @property
    def prefill_s_per_token(self) -> float:
        """Compute-bound prefill: 2·params FLOPs per prompt token over the device's FLOP/s."""
        return 2.0 * self.model.params / (self.hardware.tflops * 1e12)

    @property
    def decode_weights_s(self) -> float:
        """Bandwidth-bound decode: one read of all weights per step."""
        return self.model.params * self.model.bytes_per_param / (self.hardware.hbm_tb_s * 1e12)

    @property
    def kv_s_per_token(self) -> float:
        """Seconds to read one context token's KV cache in a decode step."""
        return self.model.kv_bytes_per_token / (self.hardware.hbm_tb_s * 1e12)

    def kv_capacity_tokens(self, memory_utilization: float = 0.9) -> int:
        """Tokens of KV cache the device holds next to the weights when the engine may use
        ``memory_utilization`` of its memory (vLLM's ``gpu_memory_utilization`` default 0.9)."""
        free = self.hardware.hbm_gb * 1e9 * memory_utilization - self.model.params * self.model.bytes_per_param
        if free <= 0:
            raise ValueError(
                f"{self.model.name} does not fit in one {self.name} at {memory_utilization:.0%} memory use"
            )
        return int(free // self.model.kv_bytes_per_token)

    def step_s(self, new_prompt_tokens: int, running: int, context_tokens: int) -> float:
        """One engine step: prefill of ``new_prompt_tokens``, one decoded token for each of ``running``
        sequences whose contexts hold ``context_tokens`` tokens in all; the longer of compute and memory."""
        compute = (new_prompt_tokens + running) * self.prefill_s_per_token
        memory = (self.decode_weights_s if running else 0.0) + context_tokens * self.kv_s_per_token
        return max(compute, memory)


def profile_for(hardware: str, model: ModelShape | None = None) -> HardwareProfile:
    """The profile of ``hardware`` (a name in :data:`HARDWARE`); a clear error for any other name."""
    if hardware not in HARDWARE:
        raise ValueError(
            f"engine.options.profile: no hardware profile for {hardware!r} (known: {sorted(HARDWARE)}); "
            "name one of them, or give decode_base_s / decode_per_seq_s / prefill_per_token_s instead"
        )
    return HardwareProfile(HARDWARE[hardware], model or ModelShape())
