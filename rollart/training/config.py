"""Training configuration (pydantic)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

from pydantic import Field, StrictFloat, ValidationInfo, field_validator, model_validator

from rollart.config_model import ConfigModel
from rollart.plugins import checked as _plain
from rollart.training.kinds import STRATEGIES, strategy_kind, strategy_name_problem


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


PACKED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
"""Model types whose passes can run packed (``train.packing``; the same as the static-cache decoder's)."""


def packing_config_problem(config: dict[str, Any]) -> str | None:
    """Why a model of this ``config.json`` cannot train packed, read without torch or transformers (the
    trainer checks again on the loaded config), or None when it can as far as the file says."""
    kind = config.get("model_type")
    if kind not in PACKED_MODEL_TYPES:
        return f"model type {kind!r} (packed passes run {', '.join(PACKED_MODEL_TYPES)})"
    layer_types = config.get("layer_types") or []
    if config.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        return "layers with sliding-window attention"
    if kind == "mistral" and config.get("sliding_window"):
        return "Mistral's sliding window"
    return None


class LoraSettings(ConfigModel):
    """``train.lora``: train low-rank adapters (``peft``) instead of the full weights. ``r`` is the rank,
    ``alpha`` the scale numerator (updates are scaled by ``alpha / r``), ``target_modules`` the linear
    layers that get an adapter (names as in the Hugging Face model). The inference engines and exports
    always get the merged full weights."""

    r: int = Field(default=8, ge=1)
    """Rank of the low-rank adapters."""
    alpha: float = Field(default=16.0, gt=0)
    """Scale numerator: adapter updates are scaled by `alpha / r`."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    """The linear layers that get an adapter (names as in the Hugging Face model)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input."""


class TrainConfig(ConfigModel):
    """How the actor is trained. ``model`` is a Hugging Face folder (default: the built-in tiny
    model); ``loss`` names a policy loss of ``rollart.algorithms`` (or a user's: a name registered with
    ``@register_loss``, or ``MODULE:FUNC``) with ``loss_params`` (checked against its signature);
    ``loss_agg`` a built-in aggregation, one registered with ``@register_loss_agg`` or ``MODULE:FUNC``.

    ``strategy`` picks the training worker: ``torch`` (``TorchTrainWorker``, the default) or
    ``megatron`` (``MegatronTrainWorker``: the same loop around a megatron-core ``GPTModel``, needs
    ``pip install 'rollart[megatron]'``). The train pool's size is the number of ranks in both.
    ``sharding`` (torch strategy) says how the ranks hold the model: ``ddp`` (each rank a whole copy)
    or ``fsdp`` (parameters, gradients and optimizer states split across the ranks, see
    :mod:`rollart.training.sharding`); ``tensor_parallel`` splits each layer across that many ranks
    (with ``fsdp`` over the rest); ``pipeline_parallel`` is not built (must be 1). Every combination
    is checked here and against the pool, before any actor starts."""

    strategy: str = "torch"
    """The training worker: `torch` (the Hugging Face module), `megatron` (a megatron-core GPTModel; extra
    `megatron`), or one a plug-in registers with `@register_strategy`.
    """
    sharding: Literal["ddp", "fsdp"] = "ddp"
    """How the train ranks hold the model (torch strategy): `ddp`, a whole copy per rank (16 bytes per parameter
    with AdamW, before activations); `fsdp`, parameters, gradients and optimizer states split across the ranks
    (FSDP2, each decoder layer gathered in turn).
    """
    tensor_parallel: int = Field(default=1, ge=1)
    """Ranks each decoder layer's linear layers are split across (torch strategy with `sharding: fsdp`; FSDP runs
    over the remaining `ranks / tensor_parallel`); must divide the attention and KV heads.
    """
    pipeline_parallel: int = Field(default=1, ge=1)
    """Pipeline-parallel size; pipeline parallelism is not built, so it must be 1."""
    offload: Literal["none", "cpu"] = "none"
    """`cpu` keeps the sharded parameters, gradients and optimizer states in host memory and runs the optimizer
    step there (`sharding: fsdp` on GPUs; no effect on CPU ranks).
    """
    reshard_after_forward: bool = True
    """With `sharding: fsdp`, free each layer's gathered parameters after its forward pass and gather them again
    for its backward (less memory, one more all-gather per layer).
    """
    host_mmap_threshold_mb: int | None = Field(default=1, ge=1, le=32)
    """Host allocations of at least this many MB come from `mmap` and go back to the system when freed (glibc's
    mmap threshold, fixed). glibc otherwise raises its threshold as large tensors are freed and keeps the freed
    memory resident: a CPU rank's peak memory is then up to 1.3 GiB higher at the Qwen2.5-0.5B shape. Null
    keeps glibc's adaptive threshold.
    """
    model: str | None = None
    """A Hugging Face model folder to train; default: the pipeline's `model` (else the built-in tiny model)."""
    lr: float = Field(default=1e-3, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[StrictFloat, StrictFloat] = Field(default=(0.9, 0.999), strict=False)  # a YAML list
    """AdamW betas."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    grad_clip: float | None = 1.0
    """Clip the gradient norm to this value; null: no clipping."""
    max_tokens_per_microbatch: int = Field(default=16384, gt=0)
    """Token budget of one micro-batch; gradients accumulate over micro-batches. Packed (`packing`), the rows'
    lengths sum to at most this; padded, rows x the longest row does. A row longer than the budget gets a
    micro-batch of its own.
    """
    packing: bool | None = None
    """Padding-free training: the rows of a micro-batch run as one sequence, each attending only to itself
    (per-row positions, a block-diagonal causal mask), so no position is padding; log-probs, entropies, the loss
    and its gradients are those of the padded passes. Null: on with `strategy: torch` for Llama-family models
    (Llama, Qwen2, Qwen3, Mistral without a sliding window), else off; on a GPU only with `dtype: bf16` and
    where PyTorch's variable-length flash attention runs (checked at start-up; else padded, logged); `false`
    keeps the padded passes. With `prefix_sharing`, each step runs whichever of the two lays out fewer positions.
    """
    loss: str = "ppo"
    """The policy loss: `ppo`, `decoupled_ppo`, `tis`, `cispo`, `topr`, `weighted_topr`, `dis`, a name registered
    with `@register_loss`, or `MODULE:FUNC`.
    """
    loss_params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the loss (checked against its signature), e.g. `{eps: 0.2}`."""
    loss_agg: str = "token-mean"
    """How per-token losses are aggregated: `token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean`, `group-
    mean`, a registered name or `MODULE:FUNC`.
    """
    tis_cap: float | None = None
    """Truncated importance-sampling cap of the train/inference mismatch weight `min(pi_old/mu, cap)`, added to
    any loss; null: off.
    """
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty against the frozen initial policy (> 0 adds a reference cluster colocated with
    the trainer).
    """
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus: the loss subtracts this times the mean entropy of the action tokens."""
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k3"
    """The KL estimator: `k1`, `k2`, `k3` or `abs`."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each batch (optimizer updates per step)."""
    proximal: Literal["auto", "recompute"] = "auto"
    """The proximal policy pi_old: `auto` recomputes it with an extra forward pass only when it can differ from
    the current policy (`ppo_epochs > 1`) and the loss reads it; `recompute` always does.
    """
    seed: int = 0
    """Seed of the trainer's random state."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of data-parallel training: `auto` (NCCL on GPUs, gloo on CPU), `gloo` or `nccl`."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Training precision: `fp32`, or `bf16` (forward and backward under bf16 autocast, fp32 master weights and
    optimizer state).
    """
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about one extra forward)."""
    prefix_sharing: bool = True
    """Train the rows that share a prompt on its tokens once (same log-probs and gradients, far fewer positions);
    off with `gradient_checkpointing`.
    """
    lora: LoraSettings | None = None
    """Train LoRA adapters instead of the full weights (extra `lora`); null: full fine-tuning."""

    plugins: list[str] = Field(default_factory=list)
    """Filled from the pipeline's `plugins:` (not written by hand): modules each training worker imports before
    it looks up `loss` / `loss_agg`.
    """
    plugin_paths: list[str] = Field(default_factory=list)
    """Filled by the config loader (not written by hand): the folders the plug-in modules are looked up in (the
    config's folder, the working directory).
    """

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

    @field_validator("strategy")
    @classmethod
    def _strategy_exists(cls, name: str) -> str:
        problem = strategy_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        return name

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
        if self.pipeline_parallel > 1:
            raise ValueError(
                f"train.pipeline_parallel={self.pipeline_parallel}: pipeline parallelism is not built in this version; "
                "set train.pipeline_parallel: 1 and split a large model with train.sharding: fsdp (and "
                "train.tensor_parallel)"
            )
        kind = strategy_kind(self.strategy)
        used = {
            "dtype": self.dtype != "fp32",
            "gradient_checkpointing": self.gradient_checkpointing,
            "lora": self.lora is not None,
            "sharding": self.sharding != "ddp",
            "tensor_parallel": self.tensor_parallel > 1,
            "offload": self.offload != "none",
            "packing": self.packing is True,
        }
        for name, value in used.items():
            if kind is not None and value and name not in kind.features:
                can = [k for k, c in STRATEGIES.items() if name in c.features]
                raise ValueError(
                    f"train.{name} is implemented for train.strategy: {' or '.join(can) or '(none)'} only in this "
                    f"version (strategy {self.strategy} does not declare it); remove train.{name} or use strategy: "
                    f"{can[0] if can else 'torch'}"
                )
        if self.tensor_parallel > 1 and self.sharding != "fsdp":
            raise ValueError(
                f"train.tensor_parallel={self.tensor_parallel} runs with FSDP over the remaining ranks: set "
                "train.sharding: fsdp (or train.tensor_parallel: 1)"
            )
        if self.offload != "none" and self.sharding != "fsdp":
            raise ValueError(
                f"train.offload: {self.offload} offloads the shards of sharded training: set train.sharding: fsdp, "
                "or remove train.offload"
            )
        if self.sharding == "fsdp" and self.lora is not None:
            raise ValueError(
                "train.lora with train.sharding: fsdp is not supported in this version (adapters on a sharded base "
                "are not built); remove train.lora or use train.sharding: ddp"
            )
        if self.lora is not None and not _importable("peft"):
            raise ValueError("train.lora needs peft; install it with pip install 'rollart[lora]' or remove train.lora")
        if kind is not None and kind.requires is not None and not _importable(kind.requires[0]):
            module, extra = kind.requires
            raise ValueError(
                f"train.strategy: {self.strategy} needs {module}; install it with "
                f"pip install 'rollart[{extra}]' or set train.strategy: torch"
            )
        return self


class RunningMeanConfig(ConfigModel):
    """``advantage: running_mean`` (the critic-free single-rollout baseline of SAO, see
    :class:`rollart.algorithms.RunningMeanBaseline`): ``A = r - mean(window)`` over the ``window`` most
    recent rewards of the same prompt (``scope: prompt``, the paper's ablation: 8) or of all prompts
    (``scope: global``, the paper's online setting: 128)."""

    window: int = Field(default=8, ge=1)
    """How many of the most recent rewards the baseline averages."""
    scope: Literal["prompt", "global"] = "prompt"
    """Whose rewards: the same prompt's (`prompt`) or every prompt's (`global`)."""


SAO_PRESET: dict[str, Any] = {
    "epochs": 2,  # K = 2 value updates per actor step
    "freeze_attention": True,
    "gamma": 1.0,
    "length_adaptive_lambda": True,  # lambda_policy = 1 - 1 / (alpha * l)
    "lambda_alpha": 1.5,
    "critic_lambda": 1.0,  # lambda_critic = 1: the value targets are the Monte-Carlo returns
    "warmup_steps": 10,
}
"""What ``preset: sao`` sets (SAO §4 "Implementation details"); a field given explicitly wins. The
paper's critic learning rate (5e-6, for a 30B model) is not part of it: set ``lr`` for your model."""


class CriticConfig(ConfigModel):
    """How the critic trains and how its values become advantages. ``model`` is a Hugging Face causal-LM
    folder (default: the built-in tiny model); ``epochs`` is K, the value updates per actor step.

    Lambdas: ``lam`` is the policy's GAE lambda (the advantages), or with ``length_adaptive_lambda``
    ``1 - 1 / (lambda_alpha * l)`` per trajectory of ``l`` action tokens; ``critic_lambda`` is the lambda of
    the critic's regression targets (the returns), ``None`` for the policy's. ``preset: sao`` fills in
    :data:`SAO_PRESET` for every field the config does not give."""

    preset: Literal["sao"] | None = None
    """`sao` fills in the SAO recipe for every field not given."""
    model: str | None = None
    """A Hugging Face causal-LM folder for the critic; default: the built-in tiny model."""
    lr: float = Field(default=1e-3, gt=0)
    """The critic's AdamW learning rate."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up, in actor steps."""
    epochs: int = Field(default=2, ge=1)
    """K: value updates per actor step."""
    freeze_attention: bool = False
    """Keep the self-attention weights at their pre-trained values."""
    value_clip: float | None = 0.2
    """Clip range of the value loss around the old values; null: no clipping."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """The policy's GAE lambda (the advantages)."""
    length_adaptive_lambda: bool = False
    """Per trajectory, lambda = 1 - 1/(`lambda_alpha` * l) for l action tokens."""
    lambda_alpha: float = Field(default=0.05, gt=0)
    """Alpha of the length-adaptive lambda."""
    critic_lambda: float | None = Field(default=None, ge=0, le=1)
    """Lambda of the critic's regression targets (the returns); null: the policy's."""
    max_tokens_per_microbatch: int = Field(default=16384, gt=0)
    """Token budget of one critic micro-batch."""
    grad_clip: float | None = 1.0
    """Clip the critic's gradient norm to this value; null: no clipping."""
    seed: int = 0
    """Seed of the critic's random state."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of the critic's data-parallel group: `auto`, `gloo` or `nccl`."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            if data["preset"] != "sao":
                raise ValueError(f"critic.preset={data['preset']!r}: the only preset is 'sao' (or leave it out)")
            data = {**SAO_PRESET, **data}
        return data

    def gae_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`rollart.training.data.add_advantages` (``gae``) this config names."""
        return {
            "gamma": self.gamma,
            "lam": self.lam,
            "critic_lam": self.critic_lambda,
            "length_adaptive": self.length_adaptive_lambda,
            "alpha": self.lambda_alpha,
        }
