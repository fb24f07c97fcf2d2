"""Torch training strategy: the actor trained with a policy loss, DDP or FSDP2 (``train.sharding``, with
tensor parallelism: :mod:`rollart.training.sharding`) over gloo (CPU) or NCCL (GPU).

``train_step`` takes a DP_SPLIT share of a batch of trajectories, cuts it into micro-batches under a
token budget, accumulates gradients, and takes one optimiser step per PPO epoch. A micro-batch runs
packed (``train.packing``: its rows as one sequence, no padding, :mod:`rollart.training.packing`),
with its rows' shared prompts once (``train.prefix_sharing``, :mod:`rollart.training.shared_prefix`;
with both on, a step takes whichever lays out fewer positions over the whole batch), or padded (rows of
similar lengths, right-padded to the longest). The loss of a micro-batch is weighted so the sum over
micro-batches and ranks equals the aggregation over the whole batch: for ``token-mean``,
``sum_tokens(loss) / global_tokens`` (DDP and FSDP average gradients over the data-parallel ranks, so
each rank scales by their number).

A sharded rank takes part in every collective of its peers: every forward pass gathers parameters, so
the ranks of a data-parallel group run the same number of passes in every method (the short ones pad
with one-token passes), and the ranks of a tensor-parallel group work on the same rows (each method
first gathers the group's rows; only the group's first rank reports metrics, each rank answers for its
own rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollart.algorithms import aggregation_unit, loss_uses_proximal
from rollart.cluster.batch import Batch
from rollart.cluster.devices import worker_device
from rollart.cluster.worker import Worker
from rollart.decorators.register import register
from rollart.decorators.specs import Dispatch
from rollart.training import columns as C
from rollart.training.accumulation import accumulate_step, global_sum, plan_share
from rollart.training.checkpoint_io import TRAINER_FILE, load_checkpoint_any, save_checkpoint_dir
from rollart.training.config import TrainConfig
from rollart.training.host_memory import set_mmap_threshold
from rollart.training.microbatch import pad_right, plan_microbatches
from rollart.training.packing import (
    PACKED_IDS,
    packed_layout,
    packed_token_logprobs,
    packing_on,
    plan_packed_microbatches,
    use_packed_attention,
)
from rollart.training.placement import (
    DP_SPLIT_EVERY_RANK,
    DataParallelRank,
    DataParallelTraining,
    apply_optimizer_settings,
    init_process_group,
    microbatch_count,
    model_path,
)
from rollart.training.sharding import (
    ShardLayout,
    all_gather_objects,
    clip_grad_norm,
    device_mesh,
    group_of,
    reshard,
    unique_state,
)
from rollart.training.shared_prefix import (
    LAYOUT_KEYS,
    SUFFIX_AT,
    SharedPrefixForward,
    plan_shared_microbatches,
    prefix_length,
    shared_layout,
    shared_positions,
    shared_token_logprobs,
)
from rollart.training.weights_out import DEFAULT_BUCKET_BYTES, EVERY_RANK, WeightsOut


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, with_entropy: bool = False
) -> Any:
    """``out[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` for ``t >= 1``; ``out[:, 0] = 0``.
    With ``with_entropy`` also the entropy of each of those next-token distributions (same layout)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    all_logp = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = torch.nn.functional.pad(all_logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0))
    if not with_entropy:
        return logp
    entropy = -(all_logp.exp() * all_logp).sum(-1)
    return logp, torch.nn.functional.pad(entropy, (1, 0))


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each layer's activations in the backward pass (non-reentrant checkpoints, no KV cache)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def peak_rss_bytes() -> int:
    """This process's peak resident memory (``VmHWM``; 0 where ``/proc`` does not say)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


ENTROPY_POSITIONS = 8  # train metrics report the policy entropy of the first 8 action tokens of a row


def _entropy_by_position(entropy: torch.Tensor, mask: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor) -> None:
    """Add the entropy at each row's k-th action token (``mask == 1``) to ``sums[k]`` / ``counts[k]``."""
    index = (mask.cumsum(-1) - 1).long()  # the action-token index of each position
    keep = (mask > 0) & (index < sums.numel())
    if keep.any():
        k = index[keep].cpu()
        sums.index_add_(0, k, entropy[keep].double().cpu())
        counts.index_add_(0, k, torch.ones_like(k, dtype=torch.float64))


@dataclass
class _StepTally:
    """What a train step adds up over its micro-batches and PPO epochs."""

    epoch: int = 0  # the PPO epoch running
    metrics: dict[str, float] = field(default_factory=dict)  # the losses' metrics, summed
    n_metric: int = 0  # micro-batch passes summed into ``metrics``
    # |pi_old - mu| over the action tokens: how far the engine that sampled is from the trainer (~0)
    drift: float = 0.0
    drift_tokens: float = 0.0
    # entropy of the policy at the k-th action token of a row (k < ENTROPY_POSITIONS), first epoch
    pos_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(ENTROPY_POSITIONS, dtype=torch.float64))
    pos_count: torch.Tensor = field(default_factory=lambda: torch.zeros(ENTROPY_POSITIONS, dtype=torch.float64))
    objective: float = 0.0  # this rank's part of the batch's loss, summed over the PPO epochs


def batch_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    max_tokens: int,
    device: torch.device,
    passes: Any = None,
    packed: bool = False,
) -> list[list[float]]:
    """``token_logprobs`` of every row of ``batch["input_ids"]``, micro-batched, each row cut to its length.
    ``passes(n)``, for a sharded model, turns this rank's micro-batch count into the count every rank runs
    (the missing ones are one-token passes). ``packed``: each micro-batch runs as one packed sequence
    (the model's attention must be :func:`rollart.training.packing.use_packed_attention`'s)."""
    lengths = [len(s) for s in batch[C.INPUT_IDS]] if len(batch) else []
    out: list[list[float] | None] = [None] * len(lengths)
    plans = plan_packed_microbatches(lengths, max_tokens) if packed else plan_microbatches(lengths, max_tokens)
    total = passes(len(plans)) if passes is not None else len(plans)
    with torch.no_grad():
        for idx in plans:
            ids = [batch[C.INPUT_IDS][i] for i in idx]
            if packed:
                layout = {k: v.to(device) for k, v in packed_layout(ids).items()}
                lp = packed_token_logprobs(model, layout, len(ids), max(len(s) for s in ids)).cpu()
            else:
                x = pad_right(ids, 0, torch.long).to(device)
                am = pad_right([[1] * len(s) for s in ids], 0, torch.long).to(device)
                lp = token_logprobs(model, x, am).cpu()
            for row, i in enumerate(idx):
                out[i] = lp[row, : lengths[i]].tolist()
        for _ in range(total - len(plans)):
            one_token_pass(model, device)
    return out  # type: ignore[return-value]


def step_seed(seed: int, optimizer_steps: int) -> int:
    """The seed of a train step: ``train.seed`` and the optimizer steps taken before it, mixed."""
    return (seed * 1_000_003 + optimizer_steps) % (2**63 - 1)


def one_token_pass(model: torch.nn.Module, device: torch.device) -> None:
    """A forward pass that computes nothing of use but takes part in a sharded model's gathers."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    model(input_ids=ids, attention_mask=torch.ones_like(ids))


class TorchTrainWorker(WeightsOut, DataParallelRank, Worker):
    """One rank of the actor: a data-parallel rank (``train.sharding: ddp``) or a shard of the model
    (``fsdp``, with ``tensor_parallel``), built in :meth:`setup_distributed`."""

    def __init__(self, config: TrainConfig | dict[str, Any] | None = None):
        self.config = TrainConfig.model_validate(config or {})
        cfg = self.config
        if cfg.host_mmap_threshold_mb is not None:
            set_mmap_threshold(cfg.host_mmap_threshold_mb << 20)
        torch.manual_seed(cfg.seed)
        self.device = worker_device(self.device_ids)
        if cfg.dtype == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"train.dtype: bf16: {torch.cuda.get_device_name(self.device)} does not support bfloat16; "
                "set train.dtype: fp32"
            )
        if self.world_size % cfg.tensor_parallel:
            raise ValueError(
                f"train.tensor_parallel={cfg.tensor_parallel} does not divide the train pool's {self.world_size} "
                "ranks; make the pool's devices a multiple of it"
            )
        self.layout = ShardLayout(cfg.sharding, cfg.tensor_parallel, self.world_size)
        if self.device.type == "cuda":
            self._check_device_memory()
        self.mesh: Any = None
        self.tp_group: Any = None  # the ranks that hold the other parts of this rank's layers
        # prefix sharing needs the prefix's KV cache in the graph; gradient checkpointing turns the cache off
        self.prefix_sharing = cfg.prefix_sharing and not cfg.gradient_checkpointing
        self.packing = packing_on(cfg.packing, model_path(cfg.model), self.device, cfg.dtype == "bf16")
        self.step_shared = self.prefix_sharing  # the current step's passes: shared-prefix ones (else packed or padded)
        self.version = 0
        if self.layout.sharded:  # built once the process group exists (setup_distributed)
            self.module: Any = None
            self.forward_module: Any = None
            return
        from rollart.models.shapes import load_causal_lm

        # fp32 master weights (and optimiser state) whatever train.dtype: bf16 is autocast in the passes
        model = load_causal_lm(model_path(cfg.model), dtype=torch.float32)
        if self.packing:
            use_packed_attention(model)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if cfg.lora is not None:
            from rollart.training.lora import apply_lora

            model = apply_lora(model, cfg.lora)
        self.module = model.to(self.device)
        self.module.train()
        self._start_training()

    def _check_device_memory(self) -> None:
        """Refuse, before loading anything, a model whose states this rank's GPU cannot hold."""
        from rollart.training.memory import fit_problem, model_param_counts

        try:
            total, split = model_param_counts(model_path(self.config.model))
        except (KeyError, OSError, ValueError):  # not a Qwen2/Llama-style config: nothing to estimate
            return
        problem = fit_problem(
            total,
            split,
            sharding=self.config.sharding,
            ranks=self.world_size,
            tensor_parallel=self.config.tensor_parallel,
            offload=self.config.offload == "cpu",
            budget=torch.cuda.get_device_properties(self.device).total_memory,
            where=f"rank {self.rank}'s GPU ({torch.cuda.get_device_name(self.device)})",
        )
        if problem is not None:
            raise ValueError(problem)

    def _start_training(self) -> None:
        """The forward module (the model, or the shared-prefix forward around it) and its optimiser."""
        cfg = self.config
        # what the training passes call (and what DDP wraps): the model, or the shared-prefix forward around it
        self.forward_module = SharedPrefixForward(self.module) if self.prefix_sharing else self.module
        self.training = DataParallelTraining(
            self.forward_module,
            device=self.device,
            lr=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            weight_decay=cfg.weight_decay,
            betas=cfg.betas,
        )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def setup_distributed(self, master_addr: str, master_port: int) -> str:
        """Join the data-parallel group (gloo on CPU, NCCL on GPU) and wrap the model in DDP; a sharded
        rank (``train.sharding: fsdp``) joins the group of every rank (also alone) and builds its shards."""
        if not self.layout.sharded:
            joined = DataParallelRank.setup_distributed(self, master_addr, master_port)
            self.load_peak_rss = peak_rss_bytes()
            return joined
        if self.module is not None:
            raise RuntimeError("setup_distributed was already called on this worker")
        cfg = self.config
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_process_group(
            backend, rank=self.rank, world_size=self.world_size, master_addr=master_addr, master_port=master_port
        )
        self.mesh = device_mesh(self.layout, self.device)
        self.module = self._build_sharded()
        self.load_peak_rss = peak_rss_bytes()  # the build and the weights' load, before any step
        self._start_training()
        self.training.sharded(group_of(self.mesh, "dp"))
        if self.layout.tensor_parallel > 1:
            self.tp_group = group_of(self.mesh, "tp")
        return backend

    def _build_sharded(self) -> torch.nn.Module:
        """The model with its parameters sharded (built on ``meta``, filled one tensor at a time)."""
        from rollart.models.streaming import empty_causal_lm, iter_weights
        from rollart.training.sharding import load_full_weights, materialize, shard_model, sparse_tied_embedding

        cfg = self.config
        path = model_path(cfg.model)
        model = empty_causal_lm(path)
        if self.packing:
            use_packed_attention(model)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        offload = cfg.offload == "cpu" and self.device.type == "cuda"
        if cfg.offload == "cpu" and not offload:
            self.logger.info("train.offload: cpu has no effect on a CPU rank (its shards are in host memory)")
        bf16_params = cfg.dtype == "bf16" and self.device.type == "cuda"
        shard_model(
            model,
            self.layout,
            self.mesh,
            device=self.device,
            param_dtype=torch.bfloat16 if bf16_params else None,
            offload=offload,
            reshard_after_forward=cfg.reshard_after_forward,
        )
        materialize(model, self.device, offload)
        load_full_weights(model, iter_weights(path))
        if self.device.type == "cpu" and sparse_tied_embedding(model):
            self.logger.debug("the tied input embedding's gradient is sparse (one vocab-sized tensor less)")
        model.train()
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast around the forward passes when ``train.dtype: bf16`` (weights stay fp32); a sharded
        GPU rank computes in bf16 through its mixed-precision policy instead."""
        if self.config.dtype == "bf16" and not (self.layout.sharded and self.device.type == "cuda"):
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ training
    def _microbatch_tensors(
        self, batch: Batch, idx: list[int], prefix_lens: list[int] | None = None
    ) -> dict[str, torch.Tensor]:
        """A micro-batch's tensors: the per-token columns right-padded to ``[rows, longest]`` (the loss's
        layout), and the layout of its passes: packed, shared-prefix (``prefix_lens``) or an attention mask."""
        ids = [batch[C.INPUT_IDS][i] for i in idx]
        out = {
            C.INPUT_IDS: pad_right(ids, 0, torch.long),
            C.LOSS_MASK: pad_right([batch[C.LOSS_MASK][i] for i in idx], 0, torch.float32),
            C.BEHAVIOUR_LOGPROBS: pad_right([batch[C.BEHAVIOUR_LOGPROBS][i] for i in idx], 0.0, torch.float32),
            C.ADVANTAGES: pad_right([batch[C.ADVANTAGES][i] for i in idx], 0.0, torch.float32),
        }
        if C.REF_LOGPROBS in batch:
            out[C.REF_LOGPROBS] = pad_right([batch[C.REF_LOGPROBS][i] for i in idx], 0.0, torch.float32)
        if prefix_lens is not None:  # the shared-prefix passes' layout
            out.update(shared_layout(ids, [prefix_lens[i] for i in idx]))
        elif self.packing:
            out.update(packed_layout(ids))
        else:
            out[C.ATTENTION_MASK] = pad_right([[1] * len(s) for s in ids], 0, torch.long)
        return {k: v.to(self.device) for k, v in out.items()}

    def _logprobs(self, model: torch.nn.Module, mb: dict[str, torch.Tensor], with_entropy: bool = False) -> Any:
        """``token_logprobs`` of a micro-batch through ``model``: its packed, shared-prefix or padded passes."""
        rows, width = mb[C.INPUT_IDS].shape
        if PACKED_IDS in mb:
            return packed_token_logprobs(model, mb, rows, width, with_entropy)
        if SUFFIX_AT in mb:
            return shared_token_logprobs(model, mb, width, with_entropy)
        return token_logprobs(model, mb[C.INPUT_IDS], mb[C.ATTENTION_MASK], with_entropy)

    def needs_proximal_pass(self) -> bool:
        """Whether ``train_step`` recomputes pi_old with an extra forward pass before the update. Not
        needed when ``ppo_epochs == 1`` (the policy before the update is the one every micro-batch's
        forward runs under, so ``pi_old = sg(pi_theta)`` and the ratio is 1 by construction), nor when
        the loss never reads pi_old (DIS) and no ``tis_cap`` does; ``proximal: recompute`` forces it."""
        cfg = self.config
        if cfg.proximal == "recompute":
            return True
        return cfg.ppo_epochs > 1 and (loss_uses_proximal(cfg.loss) or cfg.tis_cap is not None)

    def _shared_plans(self, batch: Batch, lengths: list[int]) -> tuple[list[int], list[list[int]]] | None:
        """Where each row is cut and the shared-prefix micro-batches (None when prefix sharing is off)."""
        if not (self.prefix_sharing and lengths):
            return None
        prefix_lens = [prefix_length(m, n) for m, n in zip(batch[C.LOSS_MASK], lengths)]
        plans = plan_shared_microbatches(batch[C.INPUT_IDS], prefix_lens, self.config.max_tokens_per_microbatch)
        return prefix_lens, plans

    def _layout_costs(self, batch: Batch, lengths: list[int], shared: Any) -> list[float]:
        """The positions this rank's passes run packed and shared-prefix (both 0 unless both are on)."""
        if not (self.packing and shared is not None):
            return [0.0, 0.0]
        return [float(sum(lengths)), float(shared_positions(batch[C.INPUT_IDS], *shared))]

    def _share(self, batch: Batch, lengths: list[int], shared: Any = None) -> Any:
        """This rank's micro-batches of ``batch``: the shared-prefix ones (``shared``, from
        :meth:`_shared_plans`) when this step runs them, else packed or padded."""
        cfg = self.config
        plans, prefix_lens = None, None
        if self.step_shared and shared is not None:
            prefix_lens, plans = shared
        elif self.packing:
            plans = plan_packed_microbatches(lengths, cfg.max_tokens_per_microbatch)
        return plan_share(
            lengths,
            cfg.max_tokens_per_microbatch,
            lambda idx: self._microbatch_tensors(batch, idx, prefix_lens),
            self.distributed,
            plans,
            self.training.group,
        )

    def _recompute_proximal(self, share: Any) -> None:
        """pi_old of every micro-batch: the policy before this update (forwards without grad; a sharded
        rank runs as many as its peers)."""
        with torch.no_grad(), self.autocast():
            for mb in share.microbatches:
                mb[C.PROXIMAL_LOGPROBS] = self._logprobs(self.forward_module, mb)
            if self.layout.sharded:
                for _ in range(share.passes - len(share.microbatches)):
                    self._padding_pass()
                reshard(self.module)

    def _padding_pass(self) -> torch.Tensor:
        """A pass over one dummy row that makes the same gathers as a real micro-batch's (the shared-prefix
        forward calls the model twice, a plain one once), for a sharded rank with fewer micro-batches than
        its peers; its output, times 0, gives every parameter a zero gradient."""
        if not self.step_shared:
            ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            return self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum()
        layout = {k: v.to(self.device) for k, v in shared_layout([[0, 0]], [1]).items()}
        last, suffix = self.model(**{k: layout[k] for k in LAYOUT_KEYS if k != SUFFIX_AT})
        return last.sum() + suffix.sum()

    # ------------------------------------------------------------------ tensor-parallel groups
    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group (0 without tensor parallelism)."""
        return self.rank % self.layout.tensor_parallel

    def _group_rows(self, batch: Batch) -> tuple[Batch, int, int]:
        """The rows of this rank's tensor-parallel group (every rank of it works on them), and where this
        rank's own rows are among them (``start``, ``stop``); the batch itself without tensor parallelism."""
        if self.tp_group is None:
            return batch, 0, len(batch)
        parts = all_gather_objects(batch, self.tp_group)
        start = sum(len(p) for p in parts[: self.tp_rank])
        rows = [p for p in parts if len(p)]
        return Batch.concat(rows) if rows else batch, start, start + len(batch)

    def _grad_scale(self) -> int:
        """Gradients are averaged over the data-parallel ranks: each rank scales its loss by their number."""
        if self.layout.sharded:
            return self.layout.dp
        return self.world_size if self.distributed else 1

    def _proximal(self, mb: dict[str, torch.Tensor], logp: torch.Tensor, recomputed: bool) -> torch.Tensor | None:
        """pi_old of a micro-batch: recomputed before the update, or with one PPO epoch the current
        log-probs detached (no update happened yet in this step), else None (the loss never reads it)."""
        if recomputed:
            return mb[C.PROXIMAL_LOGPROBS]
        if self.config.ppo_epochs == 1:
            return logp.detach()
        return None

    def _loss(
        self, mb: dict[str, torch.Tensor], logp: torch.Tensor, entropy: torch.Tensor, proximal: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss of one micro-batch: ``train.loss`` (with its parameters, ``tis_cap`` and ``loss_agg``),
        minus the entropy bonus, plus the KL penalty to the reference; and its metrics."""
        from rollart.algorithms import kl_penalty, policy_loss

        cfg = self.config
        mask = mb[C.LOSS_MASK]
        kwargs: dict[str, Any] = dict(cfg.loss_params)
        if cfg.tis_cap is not None:
            kwargs["tis_cap"] = cfg.tis_cap
        loss, m = policy_loss(
            cfg.loss,
            logp,
            mb[C.ADVANTAGES],
            mask,
            proximal_logprobs=proximal,
            behaviour_logprobs=mb[C.BEHAVIOUR_LOGPROBS],
            agg=cfg.loss_agg,
            **kwargs,
        )
        mean_entropy = (entropy * mask).sum() / mask.sum().clamp(min=1)
        m["entropy"] = float(mean_entropy.detach())
        if cfg.entropy_coef > 0:  # an entropy bonus keeps exploring positions not yet solved
            loss = loss - cfg.entropy_coef * mean_entropy
        if cfg.kl_coef > 0 and C.REF_LOGPROBS in mb:
            kl = kl_penalty(logp, mb[C.REF_LOGPROBS], kind=cfg.kl_kind)
            mean_kl = (kl * mask).sum() / mask.sum().clamp(min=1)
            m["kl_ref"] = float(mean_kl.detach())
            loss = loss + cfg.kl_coef * mean_kl
        return loss, m

    @register(dispatch=DP_SPLIT_EVERY_RANK)
    def train_step(self, batch: Batch) -> dict[str, float] | None:
        """One policy update on this rank's share; returns this rank's metrics (``None`` for an empty
        share, which still takes part in the step's collectives: see ``rollart.training.placement``).
        The step's random state (dropout, if the model has any) is seeded from ``train.seed`` and the
        optimizer steps taken so far (restored with a checkpoint), so a resumed run and ``rollart replay``
        draw what the run drew; the worker's own random state is left as it was."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(step_seed(self.config.seed, self.scheduler.last_epoch))
            return self._train_step(batch)

    def _train_step(self, batch: Batch) -> dict[str, float] | None:
        cfg = self.config
        seq_level = aggregation_unit(cfg.loss_agg) == "sequence"
        batch, lengths, tokens, total, share = self._plan_step(batch, seq_level)
        scale_world = self._grad_scale()
        recomputed = self.needs_proximal_pass()
        if recomputed:
            self._recompute_proximal(share)
        tally = _StepTally()

        def backward(mb: dict[str, torch.Tensor]) -> None:
            with self.autocast():
                logp, entropy = self._logprobs(self.model, mb, with_entropy=True)
            mask, behaviour = mb[C.LOSS_MASK], mb[C.BEHAVIOUR_LOGPROBS]
            proximal = self._proximal(mb, logp, recomputed)
            if tally.epoch == 0:
                old = logp.detach() if proximal is None else proximal
                tally.drift += float(((old - behaviour).abs() * mask).sum())
                tally.drift_tokens += float(mask.sum())
            loss, m = self._loss(mb, logp, entropy, proximal)
            if tally.epoch == 0:
                _entropy_by_position(entropy.detach(), mask, tally.pos_sum, tally.pos_count)
            weight = (mb[C.INPUT_IDS].shape[0] if seq_level else float(mask.sum())) / max(total, 1.0)
            (loss * weight * scale_world).backward()
            tally.objective += float(loss.detach()) * weight
            for k, v in m.items():
                tally.metrics[k] = tally.metrics.get(k, 0.0) + float(v)
            tally.n_metric += 1

        grad_norms: list[float] = []
        for epoch in range(cfg.ppo_epochs):
            tally.epoch = epoch  # `backward` reads it
            grad_norms.append(self._optimizer_step(share, backward))
            self.scheduler.step()
        self.version += 1
        batch_loss = global_sum([tally.objective], self.distributed, self.training.group)[0] / cfg.ppo_epochs
        if not lengths or self.tp_rank:  # a tensor-parallel group reports its rows once
            return None
        return self._step_metrics(tally, batch_loss, grad_norms, tokens, len(lengths), share, recomputed)

    def _plan_step(self, batch: Batch, seq_level: bool) -> tuple[Batch, list[int], float, float, Any]:
        """This rank's rows of a step (its tensor-parallel group's), their lengths, their loss tokens, the
        whole step's loss denominator (tokens, or rows for a sequence-level loss) and this rank's
        micro-batches; decides, with every rank of the group, whether the step shares prefixes."""
        batch = self._group_rows(batch)[0]
        if len(batch):
            C.require(batch, C.INPUT_IDS, C.LOSS_MASK, C.BEHAVIOUR_LOGPROBS, C.ADVANTAGES, who="train_step")
        lengths = [len(s) for s in batch[C.INPUT_IDS]] if len(batch) else []
        tokens = float(sum(sum(m) for m in batch[C.LOSS_MASK])) if lengths else 0.0
        local = float(len(lengths)) if seq_level else tokens
        shared = self._shared_plans(batch, lengths)
        total, packed_cost, shared_cost = global_sum(
            [local, *self._layout_costs(batch, lengths, shared)], self.distributed, self.training.group
        )
        # every rank of the group runs the same kind of passes (a sharded model's gathers must line up)
        self.step_shared = self.prefix_sharing and not (self.packing and packed_cost <= shared_cost)
        return batch, lengths, tokens, total, self._share(batch, lengths, shared)

    def _optimizer_step(self, share: Any, backward: Callable[[dict[str, torch.Tensor]], None]) -> float:
        """One PPO epoch: ``backward`` over every micro-batch of ``share``, then the optimizer step; the
        gradient norm before clipping."""
        cfg = self.config
        return accumulate_step(
            model=self.model,
            params=[p for p in self.model.parameters() if p.requires_grad],
            optimizer=self.optimizer,
            share=share,
            backward=backward,
            zero_forward=(
                (lambda ids, att: self._padding_pass())
                if self.layout.sharded
                else (lambda ids, att: self.model(input_ids=ids, attention_mask=att).logits)
            ),
            device=self.device,
            grad_clip=cfg.grad_clip,
            clip=clip_grad_norm if self.layout.sharded else None,
        )

    def _step_metrics(
        self,
        tally: _StepTally,
        batch_loss: float,
        grad_norms: list[float],
        tokens: float,
        rows: int,
        share: Any,
        recomputed: bool,
    ) -> dict[str, float]:
        """This rank's metrics of a step: the losses' metrics averaged over its micro-batches and epochs."""
        out = {k: v / max(tally.n_metric, 1) for k, v in tally.metrics.items()}
        out["loss"] = batch_loss  # the whole batch's (every rank reports it), mean over the PPO epochs
        out["rollout_abs_logprob_diff"] = tally.drift / max(tally.drift_tokens, 1.0)
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)  # before clipping, mean over the PPO epochs
        out.update(
            {
                "tokens": tokens,
                "rows": float(rows),
                "lr": self.scheduler.get_last_lr()[0],
                "microbatches": float(len(share.plans)),
                "proximal_recomputed": float(recomputed),
                "packed": float(self.packing and not self.step_shared),
            }
        )
        pos_sum, pos_count = tally.pos_sum, tally.pos_count
        out.update(
            {f"entropy_pos{k}": float(pos_sum[k] / pos_count[k]) for k in range(ENTROPY_POSITIONS) if pos_count[k] > 0}
        )
        return out

    @register(dispatch=DP_SPLIT_EVERY_RANK)
    def compute_logprobs(self, batch: Batch) -> list[list[float]]:
        """Per-token logprobs of each row under the current weights (every rank is called: a sharded
        rank's passes are collectives, and an empty share answers ``[]``)."""
        rows, start, stop = self._group_rows(batch)
        passes = None
        if self.layout.sharded:
            group = self.training.group
            passes = lambda n: microbatch_count(n, True, group)
        with self.autocast():
            out = batch_logprobs(
                self.module, rows, self.config.max_tokens_per_microbatch, self.device, passes, self.packing
            )
        if self.layout.sharded:
            reshard(self.module)
        return out[start:stop]

    # ------------------------------------------------------------------ weights and checkpoints
    def weight_items(self) -> list[tuple[str, torch.Tensor]]:
        """The weights in Hugging Face names (a LoRA model's adapters merged in, as CPU copies), each tensor
        once: what engines load and exports write."""
        if self.config.lora is not None:
            from rollart.training.lora import merged_state_dict

            return list(merged_state_dict(self.module).items())
        return unique_state(self.module)

    def weights_sharded(self) -> bool:
        return self.layout.sharded

    def weight_naming(self) -> str:
        """How the checkpoint's ``model.safetensors`` names its weights: ``hf``, ``peft`` (LoRA) or
        ``megatron``."""
        if self.config.strategy == "megatron":
            return "megatron"
        return "peft" if self.config.lora is not None else "hf"

    @register(dispatch=EVERY_RANK)
    def export_hf(self, out: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> str | None:
        """The current policy as a Hugging Face folder (see :meth:`WeightsOut.export_to`), gathered and written
        ``bucket_bytes`` at a time; rank 0 writes it and answers its path."""
        return self.export_to(out, model_path(self.config.model), bucket_bytes)

    def _checkpoint_meta(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "base_model": model_path(cfg.model),
            "strategy": cfg.strategy,
            "weights": self.weight_naming(),
            "lora": cfg.lora.model_dump() if cfg.lora is not None else None,
            "version": self.version,
            "layout": self.layout.as_dict(),
        }

    def _trainer_state(self, extra: dict | None) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "version": self.version, "extra": extra or {}}

    @register(dispatch=EVERY_RANK)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str | None:
        """A checkpoint folder at ``path`` (answered by rank 0): an unsharded trainer's rank 0 writes the
        module's weights in ``model.safetensors``, optimiser, scheduler, version and ``extra`` (e.g. consumed
        sample ids) in ``trainer.pt`` and ``meta.json`` (``rollart.training.checkpoint_io``); a sharded
        trainer's ranks each write their shards (``rollart.training.sharded_checkpoint``)."""
        if self.layout.sharded:
            from rollart.training.sharded_checkpoint import save_sharded

            return save_sharded(
                path,
                self.module,
                self.optimizer,
                rank=self.rank,
                trainer_state=self._trainer_state(extra),
                meta=self._checkpoint_meta(),
            )
        if self.rank != 0:
            return None
        return save_checkpoint_dir(
            path,
            self.module.state_dict(),
            {"optimizer": self.optimizer.state_dict(), **self._trainer_state(extra)},
            self._checkpoint_meta(),
        )

    def _check_layout(self, path: str, meta: dict[str, Any]) -> None:
        """Refuse a checkpoint whose weights this trainer cannot read: another naming (LoRA, megatron) or
        another ``train.sharding``."""
        from rollart.training.sharded_checkpoint import is_sharded_checkpoint

        saved = meta.get("weights", "hf" if meta["format"] == 1 else None)
        if meta["format"] > 1 and saved != self.weight_naming():
            raise ValueError(
                f"{path}: the checkpoint holds {saved} weights, this trainer trains {self.weight_naming()} "
                "ones (train.lora / train.strategy differ from the run that wrote it); resume with that config"
            )
        written = meta.get("layout", {}).get("sharding", "fsdp" if is_sharded_checkpoint(meta) else "ddp")
        if written != self.config.sharding:
            raise ValueError(
                f"{path}: the checkpoint was written with train.sharding: {written}, this run trains with "
                f"train.sharding: {self.config.sharding}; resume with train.sharding: {written} (the number of "
                "ranks may change), or start a new run from its export (rollart export)"
            )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        """Restore a checkpoint folder, or an earlier release's single ``last.pt`` file; neither is
        unpickled beyond tensors and plain containers. A sharded trainer reads its part of the saved shards,
        whatever the number of ranks that wrote them."""
        from rollart.training.checkpoint_io import load_checkpoint_file, read_meta

        meta = read_meta(path)
        self._check_layout(path, meta)
        if self.layout.sharded:
            from rollart.training.sharded_checkpoint import load_sharded

            load_sharded(path, self.module, self.optimizer)
            state = load_checkpoint_file(Path(path) / TRAINER_FILE, map_location="cpu")
        else:
            state = load_checkpoint_any(path, map_location=self.device)
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # the run's train.lr / weight_decay / betas, not the ones stored with the optimizer (a resume with
        # --set train.lr=... trains at the new rate from here, at the warm-up's current point)
        cfg = self.config
        changed = apply_optimizer_settings(
            self.optimizer, self.scheduler, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas
        )
        if changed and self.rank == 0:
            self.logger.info(
                "checkpoint %s: the run's %s replace the checkpoint's",
                path,
                ", ".join(f"train.{k}={new} (was {old})" for k, (old, new) in changed.items()),
            )
        self.version = int(state["version"])
        return {"version": self.version, "extra": state.get("extra", {})}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def set_version(self, version: int) -> int:
        """Label the current weights as policy ``version`` (after a restart reloaded a checkpoint, the
        reloaded weights go out under a version newer than any served before)."""
        self.version = int(version)
        return self.version

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def memory(self) -> dict[str, Any]:
        """What this rank holds: ``states_bytes`` (its parameters, gradients and optimizer states: local shards
        on a sharded rank), ``peak_rss_bytes`` (its process's peak resident memory), ``load_peak_rss_bytes``
        (the same when its model was built and loaded, before any step) and, on a GPU,
        ``peak_gpu_bytes`` (``torch.cuda.max_memory_allocated``)."""
        from rollart.training.sharding import local_bytes

        params = list(self.module.parameters())
        states = sum(local_bytes(p) for p in params) + sum(local_bytes(p.grad) for p in params if p.grad is not None)
        for state in self.optimizer.state.values():
            states += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        out: dict[str, Any] = {
            "rank": self.rank,
            "states_bytes": states,
            "peak_rss_bytes": peak_rss_bytes(),
            "load_peak_rss_bytes": getattr(self, "load_peak_rss", None),
        }
        if self.device.type == "cuda":
            out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def torch_threads(self) -> int:
        """The threads this rank's CPU operations use (a CPU rank's sums depend on it: ``rollart replay``
        trains with as many)."""
        return torch.get_num_threads()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def weight_checksum(self) -> float:
        """Sum of |w| over all parameters: equal across DDP ranks after every step (a sharded trainer's
        ranks all answer the sum over the whole model)."""
        from rollart.training.sharding import full_value

        with torch.no_grad():
            return float(sum(full_value(p.detach().abs().sum()) for p in self.module.parameters()))


__all__ = ["TorchTrainWorker", "batch_logprobs", "step_seed"]
