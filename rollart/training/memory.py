"""What a train rank holds, estimated from the model's config before anything is loaded.

A trainer keeps, per parameter, its fp32 weight (4 bytes), its fp32 gradient (4) and AdamW's two fp32
moments (8): 16 bytes, before activations. ``train.sharding: ddp`` holds all of them on every rank;
``fsdp`` splits them across the ``dp`` data-parallel ranks, and ``tensor_parallel: tp`` splits the decoder
layers' linear weights ``tp`` ways on top. :func:`state_bytes_per_rank` is that arithmetic;
:func:`param_counts` counts a Qwen2/Llama-style model's parameters from its ``config.json`` (no torch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BYTES_PER_PARAM = 16
"""fp32 weight + fp32 gradient + AdamW's two fp32 moments."""


def param_counts(config: Mapping[str, Any]) -> tuple[int, int]:
    """(all parameters, those tensor parallelism splits: the decoder layers' linear weights and biases) of a
    Qwen2/Llama-style ``config.json``."""
    hidden = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    bias = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden + ((q + 2 * kv) if bias else 0)
    mlp = 3 * hidden * inter
    split = layers * (attention + mlp)
    tied = bool(config.get("tie_word_embeddings", False))
    total = split + layers * 2 * hidden + hidden + vocab * hidden * (1 if tied else 2)
    return total, split


def model_param_counts(path: str | Path) -> tuple[int, int]:
    """:func:`param_counts` of a model folder's ``config.json``."""
    return param_counts(json.loads((Path(path) / "config.json").read_text()))


def state_bytes_per_rank(total: int, split: int, *, sharding: str, ranks: int, tensor_parallel: int = 1) -> float:
    """Bytes of weights, gradients and AdamW states one rank holds (see the module docstring)."""
    if sharding != "fsdp":
        return float(BYTES_PER_PARAM * total)
    dp = max(ranks // tensor_parallel, 1)
    return BYTES_PER_PARAM * (split / (dp * tensor_parallel) + (total - split) / dp)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def fit_problem(
    total: int, split: int, *, sharding: str, ranks: int, tensor_parallel: int, offload: bool, budget: float, where: str
) -> str | None:
    """What is wrong, with the fix, when ``ranks`` train ranks' states do not fit ``budget`` bytes: one device's
    memory (``ranks=1`` per device) or a machine's that holds all ``ranks``; None when they fit (or offload puts
    them in host memory)."""
    if offload:
        return None
    per_rank = state_bytes_per_rank(total, split, sharding=sharding, ranks=ranks, tensor_parallel=tensor_parallel)
    need = per_rank * (ranks if where.startswith("this machine") else 1)
    if need <= budget:
        return None
    fsdp = state_bytes_per_rank(total, split, sharding="fsdp", ranks=ranks, tensor_parallel=tensor_parallel)
    held = f"{ranks} ranks x {gib(per_rank)}" if where.startswith("this machine") else gib(per_rank)
    fix = (
        f"use train.sharding: fsdp ({gib(fsdp)} a rank over {ranks} ranks), add ranks, or a smaller model"
        if sharding != "fsdp"
        else "add train ranks (each holds 1/ranks of them), train.offload: cpu on GPUs, or a smaller model"
    )
    return (
        f"train: the weights, gradients and AdamW states of {total / 1e9:.2f} B parameters take {held} "
        f"(train.sharding: {sharding}, 16 bytes a parameter) but {where} has {gib(budget)}; {fix}"
    )


__all__ = ["BYTES_PER_PARAM", "fit_problem", "gib", "model_param_counts", "param_counts", "state_bytes_per_rank"]
