"""Training configuration (pydantic)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rollart.plugins import checked as _plain


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
    model); ``loss`` names a policy loss of ``rollart.algorithms`` (or a user's: a name registered with
    ``@register_loss``, or ``MODULE:FUNC``) with ``loss_params`` (checked against its signature);
    ``loss_agg`` a built-in aggregation, one registered with ``@register_loss_agg`` or ``MODULE:FUNC``.

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
    # train the rows that share a prompt on its tokens once (rollart.training.shared_prefix): the same
    # log-probs and gradients, far fewer positions for n samples per prompt; off with gradient_checkpointing
    prefix_sharing: bool = True
    lora: LoraSettings | None = None  # train.lora: {r, alpha, target_modules} (extra `lora`: peft)

    # filled from the pipeline config (not written by hand): the modules of its top-level ``plugins:``
    # and the folders they are looked up in (the config's folder, the working directory). Each training
    # worker imports them before it looks up ``loss`` / ``loss_agg``, so names a user's module
    # registers (``@register_loss("my_loss")``) and ``MODULE:FUNC`` specs resolve there too.
    plugins: list[str] = Field(default_factory=list)
    plugin_paths: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        """Import the plug-in modules first (a failure is reported by the pipeline config's ``plugins``
        field; here it only leaves the names it would register unknown)."""
        if isinstance(data, dict):
            from rollart.plugins import FAILED_IMPORTS, PluginError, add_search_path, import_module

            add_search_path(data.get("plugin_paths") or [])
            for module in data.get("plugins") or []:
                if str(module) in FAILED_IMPORTS:  # reported already (the pipeline config's plugins field)
                    continue
                try:
                    import_module(str(module), "plugins")
                except PluginError as err:
                    logging.getLogger(__name__).warning("%s", err)
        return data

    @field_validator("loss")
    @classmethod
    def _loss_exists(cls, name: str) -> str:
        from rollart.algorithms.losses import loss_contract_problems

        _plain(loss_contract_problems, name)
        return name

    @field_validator("loss_params")
    @classmethod
    def _loss_params_fit(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "loss" not in info.data:  # the loss itself failed; reported there
            return params
        from rollart.algorithms.losses import loss_params_problems

        _plain(loss_params_problems, info.data["loss"], params, prefix=f"loss {info.data['loss']!r}: ")
        return params

    @field_validator("loss_agg")
    @classmethod
    def _loss_agg_exists(cls, mode: str) -> str:
        from rollart.algorithms.aggregation import loss_agg_problems

        _plain(loss_agg_problems, mode)
        return mode

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
