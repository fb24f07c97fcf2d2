"""Torch training strategy: the actor trained with a policy loss, DDP over gloo (CPU) or NCCL (GPU).

``train_step`` takes a DP_SPLIT share of a batch of trajectories, packs it into micro-batches of
similar lengths under a token budget (no padded rows, little padding), accumulates gradients, and
takes one optimiser step per PPO epoch. The loss of a micro-batch is weighted so the sum over
micro-batches and ranks equals the aggregation over the whole batch: for ``token-mean``,
``sum_tokens(loss) / global_tokens`` (DDP averages gradients over ranks, so each rank scales by
``world_size``).
"""

from __future__ import annotations

import contextlib
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
from rollart.training.checkpoint_io import load_checkpoint_any, save_checkpoint_dir
from rollart.training.config import TrainConfig
from rollart.training.microbatch import pad_right, plan_microbatches
from rollart.training.placement import (
    DP_SPLIT_EVERY_RANK,
    DataParallelRank,
    DataParallelTraining,
    model_path,
)
from rollart.training.shared_prefix import (
    SharedPrefixForward,
    plan_shared_microbatches,
    prefix_length,
    shared_layout,
    shared_token_logprobs,
)
from rollart.weights.base import WeightChannel


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


ENTROPY_POSITIONS = 8  # train metrics report the policy entropy of the first 8 action tokens of a row


def _entropy_by_position(entropy: torch.Tensor, mask: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor) -> None:
    """Add the entropy at each row's k-th action token (``mask == 1``) to ``sums[k]`` / ``counts[k]``."""
    index = (mask.cumsum(-1) - 1).long()  # the action-token index of each position
    keep = (mask > 0) & (index < sums.numel())
    if keep.any():
        k = index[keep].cpu()
        sums.index_add_(0, k, entropy[keep].double().cpu())
        counts.index_add_(0, k, torch.ones_like(k, dtype=torch.float64))


def batch_logprobs(model: torch.nn.Module, batch: Batch, max_tokens: int, device: torch.device) -> list[list[float]]:
    """``token_logprobs`` of every row of ``batch["input_ids"]``, micro-batched, each row cut to its length."""
    lengths = [len(s) for s in batch[C.INPUT_IDS]]
    out: list[list[float] | None] = [None] * len(lengths)
    with torch.no_grad():
        for idx in plan_microbatches(lengths, max_tokens):
            ids = [batch[C.INPUT_IDS][i] for i in idx]
            x = pad_right(ids, 0, torch.long).to(device)
            am = pad_right([[1] * len(s) for s in ids], 0, torch.long).to(device)
            lp = token_logprobs(model, x, am).cpu()
            for row, i in enumerate(idx):
                out[i] = lp[row, : lengths[i]].tolist()
    return out  # type: ignore[return-value]


class TorchTrainWorker(DataParallelRank, Worker):
    """One data-parallel rank of the actor."""

    def __init__(self, config: TrainConfig | dict[str, Any] | None = None):
        from rollart.models.shapes import load_causal_lm

        self.config = TrainConfig.model_validate(config or {})
        torch.manual_seed(self.config.seed)
        self.device = worker_device(self.device_ids)
        if self.config.dtype == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"train.dtype: bf16: {torch.cuda.get_device_name(self.device)} does not support bfloat16; "
                "set train.dtype: fp32"
            )
        # fp32 master weights (and optimiser state) whatever train.dtype: bf16 is autocast in the passes
        model = load_causal_lm(model_path(self.config.model), dtype=torch.float32)
        if self.config.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            model.config.use_cache = False
        if self.config.lora is not None:
            from rollart.training.lora import apply_lora

            model = apply_lora(model, self.config.lora)
        self.module = model.to(self.device)
        self.module.train()
        # prefix sharing needs the prefix's KV cache in the graph; gradient checkpointing turns the cache off
        self.prefix_sharing = self.config.prefix_sharing and not self.config.gradient_checkpointing
        # what the training passes call (and what DDP wraps): the model, or the shared-prefix forward around it
        self.forward_module: torch.nn.Module = SharedPrefixForward(self.module) if self.prefix_sharing else self.module
        self.training = DataParallelTraining(
            self.forward_module,
            device=self.device,
            lr=self.config.lr,
            warmup_steps=self.config.warmup_steps,
            weight_decay=self.config.weight_decay,
            betas=self.config.betas,
        )
        self.version = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast around the forward passes when ``train.dtype: bf16`` (weights stay fp32)."""
        if self.config.dtype == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ training
    def _microbatch_tensors(
        self, batch: Batch, idx: list[int], prefix_lens: list[int] | None = None
    ) -> dict[str, torch.Tensor]:
        ids = [batch[C.INPUT_IDS][i] for i in idx]
        out = {
            C.INPUT_IDS: pad_right(ids, 0, torch.long),
            C.ATTENTION_MASK: pad_right([[1] * len(s) for s in ids], 0, torch.long),
            C.LOSS_MASK: pad_right([batch[C.LOSS_MASK][i] for i in idx], 0, torch.float32),
            C.BEHAVIOUR_LOGPROBS: pad_right([batch[C.BEHAVIOUR_LOGPROBS][i] for i in idx], 0.0, torch.float32),
            C.ADVANTAGES: pad_right([batch[C.ADVANTAGES][i] for i in idx], 0.0, torch.float32),
        }
        if C.REF_LOGPROBS in batch:
            out[C.REF_LOGPROBS] = pad_right([batch[C.REF_LOGPROBS][i] for i in idx], 0.0, torch.float32)
        if prefix_lens is not None:  # the shared-prefix passes' layout
            out.update(shared_layout(ids, [prefix_lens[i] for i in idx]))
        return {k: v.to(self.device) for k, v in out.items()}

    def _logprobs(self, model: torch.nn.Module, mb: dict[str, torch.Tensor], with_entropy: bool = False) -> Any:
        """``token_logprobs`` of a micro-batch through ``model``: the shared-prefix passes when on."""
        if self.prefix_sharing:
            return shared_token_logprobs(model, mb, mb[C.INPUT_IDS].shape[1], with_entropy)
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

    def _share(self, batch: Batch, lengths: list[int]) -> Any:
        """This rank's micro-batches of ``batch`` (the shared-prefix layout when prefix sharing is on)."""
        cfg = self.config
        plans, prefix_lens = None, None
        if self.prefix_sharing and lengths:
            prefix_lens = [prefix_length(m, n) for m, n in zip(batch[C.LOSS_MASK], lengths)]
            plans = plan_shared_microbatches(batch[C.INPUT_IDS], prefix_lens, cfg.max_tokens_per_microbatch)
        return plan_share(
            lengths,
            cfg.max_tokens_per_microbatch,
            lambda idx: self._microbatch_tensors(batch, idx, prefix_lens),
            self.distributed,
            plans,
        )

    def _recompute_proximal(self, microbatches: list[dict[str, torch.Tensor]]) -> None:
        """pi_old of every micro-batch: the policy before this update (local forwards, no grad)."""
        with torch.no_grad(), self.autocast():
            for mb in microbatches:
                mb[C.PROXIMAL_LOGPROBS] = self._logprobs(self.forward_module, mb)

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
        share, which still takes part in the step's collectives: see ``rollart.training.placement``)."""
        cfg = self.config
        if len(batch):
            C.require(batch, C.INPUT_IDS, C.LOSS_MASK, C.BEHAVIOUR_LOGPROBS, C.ADVANTAGES, who="train_step")
        lengths = [len(s) for s in batch[C.INPUT_IDS]] if len(batch) else []
        seq_level = aggregation_unit(cfg.loss_agg) == "sequence"
        tokens = float(sum(sum(m) for m in batch[C.LOSS_MASK])) if lengths else 0.0
        local = float(len(lengths)) if seq_level else tokens
        total = global_sum([local], self.distributed)[0]
        share = self._share(batch, lengths)
        scale_world = self.world_size if self.distributed else 1
        recomputed = self.needs_proximal_pass()
        if recomputed:
            self._recompute_proximal(share.microbatches)
        metrics: dict[str, float] = {}
        n_metric = 0
        # |pi_old - mu| over the action tokens: how far the engine that sampled is from the trainer (~0)
        drift = [0.0, 0.0]
        epoch = 0
        # entropy of the policy at the k-th action token of a row (k < ENTROPY_POSITIONS), first epoch
        pos_sum = torch.zeros(ENTROPY_POSITIONS, dtype=torch.float64)
        pos_count = torch.zeros(ENTROPY_POSITIONS, dtype=torch.float64)

        def backward(mb: dict[str, torch.Tensor]) -> None:
            nonlocal n_metric
            with self.autocast():
                logp, entropy = self._logprobs(self.model, mb, with_entropy=True)
            mask, behaviour = mb[C.LOSS_MASK], mb[C.BEHAVIOUR_LOGPROBS]
            proximal = self._proximal(mb, logp, recomputed)
            if epoch == 0:
                old = logp.detach() if proximal is None else proximal
                drift[0] += float(((old - behaviour).abs() * mask).sum())
                drift[1] += float(mask.sum())
            loss, m = self._loss(mb, logp, entropy, proximal)
            if epoch == 0:
                _entropy_by_position(entropy.detach(), mask, pos_sum, pos_count)
            weight = (mb[C.INPUT_IDS].shape[0] if seq_level else float(mask.sum())) / max(total, 1.0)
            (loss * weight * scale_world).backward()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
            n_metric += 1

        grad_norms: list[float] = []
        for epoch in range(cfg.ppo_epochs):  # noqa: B007 (`backward` reads it)
            grad_norms.append(
                accumulate_step(
                    model=self.model,
                    params=[p for p in self.model.parameters() if p.requires_grad],
                    optimizer=self.optimizer,
                    share=share,
                    backward=backward,
                    zero_forward=lambda ids, att: self.model(input_ids=ids, attention_mask=att).logits,
                    device=self.device,
                    grad_clip=cfg.grad_clip,
                )
            )
            self.scheduler.step()
        self.version += 1
        if not lengths:
            return None
        out = {k: v / max(n_metric, 1) for k, v in metrics.items()}
        out["rollout_abs_logprob_diff"] = drift[0] / max(drift[1], 1.0)
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)  # before clipping, mean over the PPO epochs
        out.update(
            {
                "tokens": tokens,
                "rows": float(len(lengths)),
                "lr": self.scheduler.get_last_lr()[0],
                "microbatches": float(len(share.plans)),
                "proximal_recomputed": float(recomputed),
            }
        )
        out.update(
            {f"entropy_pos{k}": float(pos_sum[k] / pos_count[k]) for k in range(ENTROPY_POSITIONS) if pos_count[k] > 0}
        )
        return out

    @register(dispatch=Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: Batch) -> list[list[float]]:
        """Per-token logprobs of each row under the current weights."""
        with self.autocast():
            return batch_logprobs(self.module, batch, self.config.max_tokens_per_microbatch, self.device)

    # ------------------------------------------------------------------ weights and checkpoints
    def cpu_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights in Hugging Face names, as CPU copies: what engines load and exports write
        (a LoRA model's adapters merged in)."""
        if self.config.lora is not None:
            from rollart.training.lora import merged_state_dict

            return merged_state_dict(self.module)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def weight_naming(self) -> str:
        """How the checkpoint's ``model.safetensors`` names its weights: ``hf``, ``peft`` (LoRA) or
        ``megatron``."""
        if self.config.strategy == "megatron":
            return "megatron"
        return "peft" if self.config.lora is not None else "hf"

    @register(dispatch=Dispatch.RANK_ZERO)
    def export_hf(self, out: str) -> str:
        """Rank 0 writes the current policy as a Hugging Face folder (see ``rollart.training.export``)."""
        from rollart.training.export import export_hf

        return str(export_hf(self.cpu_state_dict(), model_path(self.config.model), out))

    @register(dispatch=Dispatch.RANK_ZERO, by_ref=True)
    def snapshot_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0's weights (CPU, Hugging Face names). Through the Cluster the answer is an ObjectRef
        that the caller owns: the snapshot stays in the object store, inference workers load it from
        there, and it is freed when the caller drops the ref. (A ``ray.put`` inside the trainer would
        make the trainer the owner: Ray then keeps ~2 KB of bookkeeping per snapshot in the trainer's
        process for as long as it lives, measured on Ray 2.60.)"""
        return self.cpu_state_dict()

    @register(dispatch=Dispatch.RANK_ZERO)
    def publish_to(self, channel: WeightChannel, wait: bool = True) -> int:
        """Rank 0 publishes its weights to a weight channel (Mooncake, torch.distributed) as its current
        version. With ``wait=False`` the snapshot is copied to CPU and written in the background while
        this worker goes on training; the next publish (or :meth:`wait_published`) surfaces its error."""
        self.wait_published()
        if wait:
            channel.publish(self.cpu_state_dict(), self.version)
        elif channel.packs_on_publish:
            # the channel packs the tensors into a buffer of its own before it returns: the module's
            # own tensors go as they are, no snapshot-sized copy per publish
            self._publishing = channel.publish_async(self.publish_state(), self.version, copy=True)
        else:
            self._publishing = channel.publish_async(self.cpu_state_dict(), self.version, copy=False)
        return self.version

    def publish_state(self) -> dict[str, torch.Tensor]:
        """The weights to publish in Hugging Face names, for a channel that copies them at once: the
        module's own tensors (on its device) unless adapters must be merged first."""
        if self.config.lora is not None:
            return self.cpu_state_dict()
        return dict(self.module.state_dict())

    @register(dispatch=Dispatch.RANK_ZERO)
    def wait_published(self) -> None:
        """Block until the last background publish is written; re-raise its error if it failed."""
        pending = getattr(self, "_publishing", None)
        self._publishing = None
        if pending is not None:
            pending.result()

    @register(dispatch=Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        """A checkpoint folder at ``path``: the module's weights in ``model.safetensors``; optimiser,
        scheduler, version and ``extra`` (e.g. consumed sample ids) in ``trainer.pt``; ``meta.json``
        (``rollart.training.checkpoint_io``)."""
        cfg = self.config
        return save_checkpoint_dir(
            path,
            self.module.state_dict(),
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "version": self.version,
                "extra": extra or {},
            },
            {
                "base_model": model_path(cfg.model),
                "strategy": cfg.strategy,
                "weights": self.weight_naming(),
                "lora": cfg.lora.model_dump() if cfg.lora is not None else None,
                "version": self.version,
            },
        )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        """Restore a checkpoint folder, or an earlier release's single ``last.pt`` file; neither is
        unpickled beyond tensors and plain containers."""
        state = load_checkpoint_any(path, map_location=self.device)
        saved = state["meta"].get("weights", "hf" if state["meta"]["format"] == 1 else None)
        if state["meta"]["format"] > 1 and saved != self.weight_naming():
            raise ValueError(
                f"{path}: the checkpoint holds {saved} weights, this trainer trains {self.weight_naming()} "
                "ones (train.lora / train.strategy differ from the run that wrote it); resume with that config"
            )
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        return {"version": self.version, "extra": state.get("extra", {})}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def set_version(self, version: int) -> int:
        """Label the current weights as policy ``version`` (after a restart reloaded a checkpoint, the
        reloaded weights go out under a version newer than any served before)."""
        self.version = int(version)
        return self.version

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def weight_checksum(self) -> float:
        """Sum of |w| over all parameters: equal across DDP ranks after every step."""
        with torch.no_grad():
            return float(sum(p.detach().abs().sum() for p in self.module.parameters()))


__all__ = ["TorchTrainWorker", "batch_logprobs"]
