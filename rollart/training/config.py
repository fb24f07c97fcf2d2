"""Training configuration (pydantic)."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


class LoraSettings(BaseModel):
    """``train.lora``: train low-rank adapters (``peft``) instead of the full weights. ``r`` is the rank,
    ``alpha`` the scale numerator (updates are scaled by ``alpha / r``), ``target_modules`` the linear
    layers that get an adapter (names as in the Hugging Face model). The inference engines and exports
    always get the merged full weights."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)


class TrainConfig(BaseModel):
    """How the actor is trained. ``model`` is a Hugging Face folder (default: the built-in tiny
    model); ``loss`` names a policy loss of ``rollart.algorithms`` with ``loss_params``.

    ``strategy`` picks the training worker: ``torch`` (``TorchTrainWorker``, the default) or
    ``megatron`` (``MegatronTrainWorker``: the same loop around a megatron-core ``GPTModel``, needs
    ``pip install 'rollart[megatron]'``). Data parallelism is the train pool's size in both;
    ``tensor_parallel`` / ``pipeline_parallel`` are megatron's model-parallel sizes and must be 1 in
    this version (checked here, before any actor starts)."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["torch", "megatron"] = "torch"
    tensor_parallel: int = Field(default=1, ge=1)
    pipeline_parallel: int = Field(default=1, ge=1)
    model: str | None = None
    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(default=0, ge=0)
    grad_clip: float | None = 1.0
    max_tokens_per_microbatch: int = Field(default=16384, gt=0)
    loss: str = "ppo"
    loss_params: dict[str, Any] = Field(default_factory=dict)
    loss_agg: str = "token-mean"
    tis_cap: float | None = None  # train/inference mismatch truncated IS (seed 000 eq. 12)
    kl_coef: float = Field(default=0.0, ge=0)
    entropy_coef: float = Field(default=0.0, ge=0)  # loss -= coef * mean entropy of the action tokens
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k3"
    ppo_epochs: int = Field(default=1, ge=1)
    # pi_old (the proximal policy): "auto" recomputes it with an extra forward pass only when it can
    # differ from the current policy's detached log-probs (ppo_epochs > 1) and the loss reads it;
    # "recompute" always does (one extra forward per micro-batch; for comparisons)
    proximal: Literal["auto", "recompute"] = "auto"
    seed: int = 0
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # bf16: forward/backward under bf16 autocast, fp32 master weights and optimiser state
    dtype: Literal["fp32", "bf16"] = "fp32"
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory)
    lora: LoraSettings | None = None  # train.lora: {r, alpha, target_modules} (extra `lora`: peft)

    @model_validator(mode="after")
    def _check_strategy(self) -> TrainConfig:
        for name in ("tensor_parallel", "pipeline_parallel"):
            size = getattr(self, name)
            if size > 1:
                hint = (
                    "model parallelism exists only in the megatron strategy, and " if self.strategy == "torch" else ""
                )
                raise ValueError(
                    f"train.{name}={size}: {hint}sharding the weights across model-parallel ranks is not "
                    f"implemented in this version; set train.{name}: 1 (data parallelism comes from the "
                    "train pool's size)"
                )
        if self.strategy == "megatron":
            for name, value in (
                ("dtype", self.dtype != "fp32"),
                ("gradient_checkpointing", self.gradient_checkpointing),
                ("lora", self.lora is not None),
            ):
                if value:
                    raise ValueError(
                        f"train.{name} is implemented for train.strategy: torch only in this version; "
                        f"remove train.{name} or use strategy: torch"
                    )
        if self.lora is not None and not _importable("peft"):
            raise ValueError("train.lora needs peft; install it with pip install 'rollart[lora]' or remove train.lora")
        if self.strategy == "megatron" and not _importable("megatron.core"):
            raise ValueError(
                "train.strategy: megatron needs megatron-core; install it with "
                "pip install 'rollart[megatron]' or set train.strategy: torch"
            )
        return self


class RunningMeanConfig(BaseModel):
    """``advantage: running_mean`` (seed 003's critic-free single-rollout baseline, see
    :class:`rollart.algorithms.RunningMeanBaseline`): ``A = r - mean(window)`` over the ``window`` most
    recent rewards of the same prompt (``scope: prompt``, the paper's ablation: 8) or of all prompts
    (``scope: global``, the paper's online setting: 128)."""

    model_config = ConfigDict(extra="forbid")

    window: int = Field(default=8, ge=1)
    scope: Literal["prompt", "global"] = "prompt"
