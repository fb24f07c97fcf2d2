"""Megatron-core training strategy for the actor: the policy as a ``megatron.core`` ``GPTModel``.

What it does
    :class:`MegatronTrainWorker` trains the same Hugging Face causal LM as
    :class:`~rollart.training.torch_strategy.TorchTrainWorker`, but runs it as megatron-core's
    ``GPTModel`` built from the local (non-Transformer-Engine) layer spec. The HF checkpoint is
    converted on load (:func:`hf_to_megatron`) and converted back whenever weights leave the worker
    (:func:`megatron_to_hf`: ``cpu_state_dict``, ``snapshot_weights``, ``publish_to``), so inference
    engines load what it publishes unchanged. The conversion is exact in both directions (it only
    moves and concatenates tensors): the fused ``linear_qkv`` holds, per query group, that group's
    query heads, then its key head, then its value head (megatron's interleaving); ``linear_fc1`` is
    ``[gate; up]``; the RMSNorm weights are separate modules in the local spec
    (``input_layernorm`` / ``pre_mlp_layernorm``) or ``layer_norm_weight`` inside the fused linear
    layers of the Transformer-Engine spec (``fused_norms=True``); ``output_layer`` exists only when the
    embeddings are untied.

    The worker subclasses ``TorchTrainWorker`` and keeps its ``train_step`` unchanged: micro-batching
    (``rollart.training.microbatch``), the proximal log-probs when needed, ``rollart.algorithms.policy_loss`` with
    ``TrainConfig``'s ``loss`` / ``loss_params`` / ``loss_agg``, entropy and KL terms, the global token
    weighting, grad clipping, AdamW and the warm-up schedule are the very same code. What differs is
    the model behind ``self.model``: :class:`GPTCausalLM` presents the ``GPTModel`` with the Hugging
    Face call convention (``model(input_ids=, attention_mask=).logits``, ``[b, s, v]``).
    Inside, megatron works sequence-first (``[s, b, h]`` hidden states); ``GPTModel`` transposes its
    logits back to ``[b, s, v]`` when no labels are given. :func:`gpt_logits` builds the position ids
    and the boolean attention mask (causal, and pad keys masked as Hugging Face does, ``True`` = masked)
    explicitly; from the ``[b, s, v]`` logits on, log-probs and entropies come from
    ``torch_strategy.token_logprobs`` itself (``out[:, t] = log p(x_t | x_<t)``, ``out[:, 0] = 0``).

What runs where
    * CPU (tests, CI, a laptop): tensor = pipeline parallel = 1, float32, one
      ``GPTModel`` per process; data parallelism is torch DDP over gloo (on the interface of rank 0's node IP), as for the torch
      strategy. A single rank still needs a process group for megatron's ``parallel_state``: it gets a
      private one-rank gloo group over an in-memory ``HashStore`` (no port). The CPU patches below
      are applied explicitly, by :func:`cpu_patches`, in the worker's ``__init__`` when it runs on CPU.
    * GPU: the same code on CUDA with NCCL, no patches, ``model_parallel_cuda_manual_seed`` seeding
      megatron's CUDA RNG tracker (written for, but not yet run on, a GPU: the machines this was
      developed on have none). ``tensor_parallel`` / ``pipeline_parallel`` > 1 are refused by
      ``TrainConfig`` before any actor starts: on CPU megatron's tensor-parallel layers and pipeline
      schedules allocate on ``torch.cuda.current_device()``; on GPU sharding the HF
      weights across tensor ranks, gathering them back for publishing and the pipeline schedule are not
      implemented here (and could not be tested on this project's machines). Megatron's own DDP and
      distributed optimizer are not used (they hard-code ``device="cuda"``); optimisation is torch
      AdamW as in the torch strategy.

The CPU patches (megatron-core 0.16.1; never applied at import, only inside :func:`cpu_patches`)
    1. ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on the first
       forward whenever it is on the CPU; the patched version computes the same embedding where
       ``inv_freq`` is.
    2. ``GlobalMemoryBuffer.get_tensor`` (the scratch tensor ``DotProductAttention`` hands to
       ``torch.baddbmm`` with ``beta=0``) allocates on ``torch.cuda.current_device()``; the patched
       version allocates the same cached buffer on the CPU.
    Besides these two monkeypatches, ``model_parallel_cuda_manual_seed`` cannot run on CPU (it reads and
    writes ``torch.cuda`` RNG states); :func:`cpu_patches` installs megatron's no-op RNG tracker
    instead (``initialize_rng_tracker(inference_rng_tracker=True)``), so the dropout calls that fork
    the tracker use torch's CPU generator (Qwen2's dropouts are 0 anyway). The default causal mask
    (``get_default_causal_mask``, ``device="cuda"``) needs no patch because :func:`gpt_logits` always
    passes an explicit mask. All three are restored when the context exits.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import namedtuple
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from rollart.cluster.devices import worker_device
from rollart.decorators.register import register
from rollart.decorators.specs import Dispatch
from rollart.training.config import TrainConfig
from rollart.training.host_memory import set_mmap_threshold
from rollart.training.megatron_weights import _cfg, _ignored, _shape, hf_to_megatron, load_hf_state_dict, megatron_to_hf
from rollart.training.placement import DataParallelTraining, init_process_group, model_path, wrap_ddp
from rollart.training.sharding import ShardLayout
from rollart.training.torch_strategy import TorchTrainWorker

__all__ = [
    "GPTCausalLM",
    "MegatronConfig",
    "MegatronTrainWorker",
    "build_gpt_model",
    "cpu_patches",
    "gpt_logits",
    "hf_to_megatron",
    "init_megatron_parallel",
    "load_hf_state_dict",
    "megatron_to_hf",
    "transformer_config",
]


class MegatronConfig(TrainConfig):
    """``TrainConfig`` with ``strategy: megatron`` (data parallel: ``sharding``, ``tensor_parallel`` and
    ``pipeline_parallel`` are refused above their defaults by ``TrainConfig``; tensor parallelism is the torch
    strategy's)."""

    strategy: Literal["torch", "megatron"] = "megatron"


# ---------------------------------------------------------------------------------------------------- CPU patches
def _cpu_get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` of megatron-core 0.16.1 without its move of ``inv_freq`` to CUDA."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _cpu_get_tensor(
    self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
) -> torch.Tensor:
    """``GlobalMemoryBuffer.get_tensor`` of megatron-core 0.16.1 with its cached buffer on the CPU."""
    required = functools.reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required:
        buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
    return buf[0:required].view(*tensor_shape)


@contextlib.contextmanager
def cpu_patches() -> Iterator[None]:
    """Let megatron-core 0.16.1's ``GPTModel`` (local spec) run forward and backward on the CPU.

    Two monkeypatches (``RotaryEmbedding.get_emb``, ``GlobalMemoryBuffer.get_tensor``) and megatron's
    no-op RNG tracker in place of ``model_parallel_cuda_manual_seed``; see the module docstring. All
    are undone on exit. Not re-entrant across threads; meant for a whole test or a whole CPU worker.
    """
    from megatron.core import utils as mcore_utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mcore_random

    rope_cls, buffer_cls = rotary_pos_embedding.RotaryEmbedding, mcore_utils.GlobalMemoryBuffer
    saved = (
        rope_cls.__dict__["get_emb"],
        buffer_cls.__dict__["get_tensor"],
        mcore_random._CUDA_RNG_STATE_TRACKER,
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
    )
    rope_cls.get_emb = _cpu_get_emb
    buffer_cls.get_tensor = _cpu_get_tensor
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield
    finally:
        rope_cls.get_emb, buffer_cls.get_tensor = saved[0], saved[1]
        mcore_random._CUDA_RNG_STATE_TRACKER, mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved[2], saved[3]


# ---------------------------------------------------------------------------------------------------- model
def init_megatron_parallel(
    *,
    backend: str,
    rank: int = 0,
    world_size: int = 1,
    init_method: str | None = None,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> None:
    """Join the default process group (a private in-memory one for a single rank when ``init_method`` is
    None) and initialise megatron's ``parallel_state``; the data-parallel size is what remains."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if init_method is None:
            if world_size != 1:
                raise ValueError("more than one rank needs an init_method (tcp://host:port)")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            addr, _, port = init_method.removeprefix("tcp://").rpartition(":")
            init_process_group(backend, rank=rank, world_size=world_size, master_addr=addr, master_port=int(port))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
        )


def transformer_config(hf_config: Any, *, params_dtype: torch.dtype = torch.float32) -> Any:
    """Megatron ``TransformerConfig`` of a Qwen2 / Llama HF config: RMSNorm, SwiGLU, RoPE, GQA, q/k/v biases
    for Qwen2, no other biases, no fused kernels (they need Transformer Engine or Apex)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_type = _cfg(hf_config, "model_type")
    if model_type not in ("qwen2", "llama"):
        raise NotImplementedError(f"megatron strategy: model_type {model_type!r} (only qwen2 and llama)")
    if _cfg(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"megatron strategy: hidden_act {_cfg(hf_config, 'hidden_act')!r} (only silu)")
    rope = _cfg(hf_config, "rope_parameters") or _cfg(hf_config, "rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise NotImplementedError(f"megatron strategy: rope scaling {rope!r} (only the default RoPE)")
    if _cfg(hf_config, "use_sliding_window", False):
        raise NotImplementedError("megatron strategy: sliding-window attention")
    _, heads, groups, head_dim, _ = _shape(hf_config)
    return TransformerConfig(
        num_layers=int(_cfg(hf_config, "num_hidden_layers")),
        hidden_size=int(_cfg(hf_config, "hidden_size")),
        ffn_hidden_size=int(_cfg(hf_config, "intermediate_size")),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(_cfg(hf_config, "rms_norm_eps")),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=bool(_cfg(hf_config, "mlp_bias", False)),
        add_qkv_bias=bool(_cfg(hf_config, "attention_bias", model_type == "qwen2")),
        hidden_dropout=0.0,
        attention_dropout=float(_cfg(hf_config, "attention_dropout", 0.0) or 0.0),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=params_dtype,
    )


def _rope_theta(hf_config: Any) -> float:
    rope = _cfg(hf_config, "rope_parameters") or {}
    return float(rope.get("rope_theta", _cfg(hf_config, "rope_theta", 10000.0)))


def build_gpt_model(hf_config: Any, *, params_dtype: torch.dtype = torch.float32) -> Any:
    """An (uninitialised) ``GPTModel`` with the local layer spec shaped like ``hf_config``; needs
    :func:`init_megatron_parallel` first (and :func:`cpu_patches` to run on CPU)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=transformer_config(hf_config, params_dtype=params_dtype),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=int(_cfg(hf_config, "vocab_size")),
        max_sequence_length=int(_cfg(hf_config, "max_position_embeddings")),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=_rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(_cfg(hf_config, "tie_word_embeddings", True)),
    )


def gpt_logits(
    gpt: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits ``[b, s, v]`` of a ``GPTModel`` for ``input_ids`` ``[b, s]``.

    Position ids are ``0..s-1`` (as Hugging Face uses without explicit positions); the boolean mask
    ``[b, 1, s, s]`` (``True`` = masked) is causal and hides keys where ``attention_mask`` is 0. Megatron
    runs ``[s, b, h]`` inside and returns ``[b, s, v]`` when no labels are given."""
    b, s = input_ids.shape
    device = input_ids.device
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
    if attention_mask is not None:
        mask = mask | (attention_mask == 0)[:, None, None, :]
    return gpt(input_ids, position_ids, mask)


CausalLMLogits = namedtuple("CausalLMLogits", ["logits"])


class GPTCausalLM(torch.nn.Module):
    """A ``GPTModel`` behind the Hugging Face causal-LM call: ``model(input_ids=, attention_mask=).logits``
    is ``[b, s, v]``, so the torch strategy's loss path (``token_logprobs``, ``batch_logprobs``) runs on it."""

    def __init__(self, gpt: torch.nn.Module):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> CausalLMLogits:
        return CausalLMLogits(gpt_logits(self.gpt, input_ids, attention_mask))


# ---------------------------------------------------------------------------------------------------- worker
class MegatronTrainWorker(TorchTrainWorker):
    """One data-parallel rank of the actor as a megatron-core ``GPTModel``.

    Same methods, dispatch modes and results as ``TorchTrainWorker`` (``setup_distributed``,
    ``train_step``, ``compute_logprobs``, ``snapshot_weights``, ``publish_to``, ``wait_published``,
    ``save_checkpoint``, ``load_checkpoint``, ``weight_checksum``); weights leave it in Hugging Face
    names. A single rank builds its model at once; several ranks build it in ``setup_distributed``.
    Checkpoints hold megatron names (and the optimiser state in megatron's parameter order).
    """

    def __init__(self, config: MegatronConfig | dict[str, Any] | None = None):
        from transformers import AutoConfig

        self.config = MegatronConfig.model_validate(config or {})
        cfg = self.config
        if cfg.host_mmap_threshold_mb is not None:
            set_mmap_threshold(cfg.host_mmap_threshold_mb << 20)
        torch.manual_seed(cfg.seed)
        self.device = worker_device(self.device_ids)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._path = model_path(cfg.model)
        self.hf_config = AutoConfig.from_pretrained(self._path)
        self._cpu_patches: contextlib.ExitStack | None = None
        if self.device.type == "cpu":  # explicit, for this worker process's lifetime (module docstring)
            self._cpu_patches = contextlib.ExitStack()
            self._cpu_patches.enter_context(cpu_patches())
            self.logger.info("megatron-core on CPU: rollart.training.megatron_strategy.cpu_patches() applied")
        self._model: torch.nn.Module | None = None
        self._module: GPTCausalLM | None = None
        self.prefix_sharing = False  # the shared-prefix passes need a Hugging Face KV cache (torch strategy)
        self.packing = False  # the packed passes need the Hugging Face attention interface (torch strategy)
        self.step_shared = False
        self.layout = ShardLayout("ddp", 1, self.world_size)  # data parallel only
        self.mesh = None
        self.tp_group = None
        self.version = 0
        self.training: DataParallelTraining | None = None  # made with the model (see _build)
        self.backend = cfg.backend if cfg.backend != "auto" else ("nccl" if self.device.type == "cuda" else "gloo")
        if self.world_size == 1:
            init_megatron_parallel(backend=self.backend)
            self._build()

    # the torch strategy's code reads self.model / self.module: say clearly when they are not built yet
    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError(
                f"MegatronTrainWorker rank {self.rank}/{self.world_size}: call setup_distributed "
                "first (several ranks build their model once the process group exists)"
            )
        return self._model

    @model.setter
    def model(self, value: torch.nn.Module) -> None:
        self._model = value

    @property
    def module(self) -> GPTCausalLM:
        if self._module is None:
            return self.model  # type: ignore[return-value]  # raises the message above
        return self._module

    @property
    def distributed(self) -> bool:
        return self.training is not None and self.training.distributed

    @property
    def forward_module(self) -> torch.nn.Module:
        """What the local (non-DDP) passes call: the model itself (no shared-prefix forward here)."""
        return self.module

    def _build(self) -> None:
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(self.config.seed)
        gpt = build_gpt_model(self.hf_config)
        state = hf_to_megatron(load_hf_state_dict(self._path), self.hf_config)
        expected = {k for k in gpt.state_dict() if not _ignored(k)}
        if set(state) != expected:
            raise KeyError(
                f"converted weights do not fit the GPTModel: missing {sorted(expected - set(state))[:3]}, "
                f"unexpected {sorted(set(state) - expected)[:3]}"
            )
        gpt.load_state_dict(state, strict=False)  # strict apart from the weightless _extra_state entries
        self._module = GPTCausalLM(gpt).to(self.device)
        self._module.train()
        self._model = self._module
        cfg = self.config
        self.training = DataParallelTraining(
            self._module,
            device=self.device,
            lr=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            weight_decay=cfg.weight_decay,
            betas=cfg.betas,
        )

    # ------------------------------------------------------------------ set-up
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def setup_distributed(self, master_addr: str, master_port: int) -> str:
        """Join the data-parallel group (gloo on CPU, NCCL on GPU), initialise megatron's parallel state,
        build the model and wrap it in DDP; ``"single"`` for one rank (its model exists already)."""
        if self.world_size == 1:
            return "single"
        if self._model is not None:
            raise RuntimeError("setup_distributed was already called on this worker")
        init_megatron_parallel(
            backend=self.backend,
            rank=self.rank,
            world_size=self.world_size,
            init_method=f"tcp://{master_addr}:{master_port}",
        )
        self._build()
        self._model = wrap_ddp(self._module)
        assert self.training is not None
        self.training.wrapped(self._model)
        return self.backend

    # ------------------------------------------------------------------ weights in Hugging Face names
    def megatron_state_dict(self) -> dict[str, torch.Tensor]:
        """The ``GPTModel``'s own weights (megatron names, on the worker's device)."""
        return {k: v for k, v in self.module.gpt.state_dict().items() if not _ignored(k)}

    def publish_state(self) -> dict[str, torch.Tensor]:
        """Converted to Hugging Face names (a copy of its own)."""
        return self.cpu_state_dict()

    def weight_items(self) -> list[tuple[str, torch.Tensor]]:
        """The weights converted to Hugging Face names (a copy of its own)."""
        return list(self.cpu_state_dict().items())

    def cpu_state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights in Hugging Face names (each tensor its own storage)."""
        with torch.no_grad():
            hf = megatron_to_hf({k: v.detach() for k, v in self.megatron_state_dict().items()}, self.hf_config)
            return {k: v.to("cpu", copy=True) for k, v in hf.items()}
