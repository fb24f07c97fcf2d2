"""Torch training strategy: the actor trained with a policy loss, DDP over gloo (CPU) or NCCL (GPU).

``train_step`` takes a DP_SPLIT share of a batch of trajectories, packs it into micro-batches of
similar lengths under a token budget (no padded rows, little padding), accumulates gradients, and
takes one optimiser step per PPO epoch. The loss of a micro-batch is weighted so the sum over
micro-batches and ranks equals the aggregation over the whole batch: for ``token-mean``,
``sum_tokens(loss) / global_tokens`` (DDP averages gradients over ranks, so each rank scales by
``world_size``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

import rollart as ra
from rollart.training.config import TrainConfig
from rollart.training.microbatch import pad_right, plan_microbatches
from rollart.training.placement import (
    DP_SPLIT_EVERY_RANK, DataParallelRank, free_port, join_data_parallel, microbatch_count, model_path,
    sync_grads_on_last, worker_device,
    zero_backward,
)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   with_entropy: bool = False) -> Any:
    """``out[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` for ``t >= 1``; ``out[:, 0] = 0``.
    With ``with_entropy`` also the entropy of each of those next-token distributions (same layout)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    all_logp = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = torch.nn.functional.pad(all_logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0))
    if not with_entropy:
        return logp
    entropy = -(all_logp.exp() * all_logp).sum(-1)
    return logp, torch.nn.functional.pad(entropy, (1, 0))


def batch_logprobs(model: torch.nn.Module, batch: ra.Batch, max_tokens: int, device: torch.device
                   ) -> list[list[float]]:
    """``token_logprobs`` of every row of ``batch["input_ids"]``, micro-batched, each row cut to its length."""
    lengths = [len(s) for s in batch["input_ids"]]
    out: list[list[float] | None] = [None] * len(lengths)
    with torch.no_grad():
        for idx in plan_microbatches(lengths, max_tokens):
            ids = [batch["input_ids"][i] for i in idx]
            x = pad_right(ids, 0, torch.long).to(device)
            am = pad_right([[1] * len(s) for s in ids], 0, torch.long).to(device)
            lp = token_logprobs(model, x, am).cpu()
            for row, i in enumerate(idx):
                out[i] = lp[row, : lengths[i]].tolist()
    return out  # type: ignore[return-value]


class TorchTrainWorker(DataParallelRank, ra.Worker):
    """One data-parallel rank of the actor."""

    def __init__(self, config: TrainConfig | dict[str, Any] | None = None):
        from transformers import AutoModelForCausalLM

        self.config = TrainConfig.model_validate(config or {})
        torch.manual_seed(self.config.seed)
        self.device = worker_device(self.device_ids)
        self.model = AutoModelForCausalLM.from_pretrained(model_path(self.config.model), dtype=torch.float32
                                                          ).to(self.device)
        self.model.train()
        self.module = self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay, betas=self.config.betas)
        warm = self.config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0)
        self.version = 0
        self.distributed = False

    # ------------------------------------------------------------------ set-up
    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def setup_distributed(self, master_addr: str, master_port: int) -> str:
        """Join the data-parallel group (gloo on CPU, NCCL on GPU) and wrap the model in DDP."""
        self.model, backend = join_data_parallel(self.module, rank=self.rank, world_size=self.world_size,
                                                 backend=self.config.backend, device=self.device,
                                                 master_addr=master_addr, master_port=master_port)
        self.distributed = backend != "single"
        return backend

    # ------------------------------------------------------------------ training
    def _global_sum(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def _microbatch_tensors(self, batch: ra.Batch, idx: list[int]) -> dict[str, torch.Tensor]:
        ids = [batch["input_ids"][i] for i in idx]
        out = {
            "input_ids": pad_right(ids, 0, torch.long),
            "attention_mask": pad_right([[1] * len(s) for s in ids], 0, torch.long),
            "loss_mask": pad_right([batch["loss_mask"][i] for i in idx], 0, torch.float32),
            "rollout_logprobs": pad_right([batch["old_logprobs"][i] for i in idx], 0.0, torch.float32),
            "advantages": pad_right([batch["advantages"][i] for i in idx], 0.0, torch.float32),
        }
        if "ref_logprobs" in batch:
            out["ref_logprobs"] = pad_right([batch["ref_logprobs"][i] for i in idx], 0.0, torch.float32)
        return {k: v.to(self.device) for k, v in out.items()}

    @ra.register(dispatch=DP_SPLIT_EVERY_RANK)
    def train_step(self, batch: ra.Batch) -> dict[str, float] | None:
        """One policy update on this rank's share; returns this rank's metrics (``None`` for an empty
        share, which still takes part in the step's collectives: see ``rollart.training.placement``)."""
        from rollart.algorithms import kl_penalty, policy_loss

        cfg = self.config
        lengths = [len(s) for s in batch["input_ids"]] if len(batch) else []
        plans = plan_microbatches(lengths, cfg.max_tokens_per_microbatch)
        mbs = [self._microbatch_tensors(batch, idx) for idx in plans]
        seq_level = cfg.loss_agg.startswith("seq")
        local = float(len(lengths)) if seq_level else float(sum(sum(m) for m in batch["loss_mask"])) if lengths else 0.0
        total = self._global_sum(local)
        passes = microbatch_count(len(mbs), self.distributed)
        scale_world = self.world_size if self.distributed else 1
        with torch.no_grad():  # the policy before this update: the PPO "old" policy (local forwards)
            for mb in mbs:
                mb["old_logprobs"] = token_logprobs(self.module, mb["input_ids"], mb["attention_mask"])
        metrics: dict[str, float] = {}
        with torch.no_grad():  # how far the engine that sampled is from the trainer (should be ~0)
            num = sum(float(((mb["old_logprobs"] - mb["rollout_logprobs"]).abs() * mb["loss_mask"]).sum()) for mb in mbs)
            den = sum(float(mb["loss_mask"].sum()) for mb in mbs)
            metrics["rollout_abs_logprob_diff"] = num / max(den, 1.0) * len(mbs) * cfg.ppo_epochs
        n_metric = 0
        grad_norms: list[float] = []
        for _ in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i in range(passes):
                with sync_grads_on_last(self.model, i, passes):
                    if i >= len(mbs):  # this rank has fewer micro-batches than another: a zero pass
                        zero_backward(lambda ids, att: self.model(input_ids=ids, attention_mask=att).logits,
                                      self.device)
                        continue
                    mb = mbs[i]
                    logp, entropy = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"],
                                                   with_entropy=True)
                    mask = mb["loss_mask"]
                    kwargs: dict[str, Any] = dict(cfg.loss_params)
                    if cfg.tis_cap is not None:
                        kwargs["tis_cap"] = cfg.tis_cap
                    old, rollout = mb["old_logprobs"], mb["rollout_logprobs"]
                    if cfg.loss == "decoupled_ppo":
                        loss, m = policy_loss(cfg.loss, logp, rollout, mb["advantages"], mask, prox_logprobs=old,
                                              agg=cfg.loss_agg, **kwargs)
                    else:
                        loss, m = policy_loss(cfg.loss, logp, old, mb["advantages"], mask, rollout_logprobs=rollout,
                                              agg=cfg.loss_agg, **kwargs)
                    mean_entropy = (entropy * mask).sum() / mask.sum().clamp(min=1)
                    m["entropy"] = float(mean_entropy.detach())
                    if cfg.entropy_coef > 0:  # an entropy bonus keeps exploring positions not yet solved
                        loss = loss - cfg.entropy_coef * mean_entropy
                    if cfg.kl_coef > 0 and "ref_logprobs" in mb:
                        kl = kl_penalty(logp, mb["ref_logprobs"], kind=cfg.kl_kind)
                        mean_kl = (kl * mask).sum() / mask.sum().clamp(min=1)
                        m["kl_ref"] = float(mean_kl.detach())
                        loss = loss + cfg.kl_coef * mean_kl
                    weight = (mb["input_ids"].shape[0] if seq_level else float(mask.sum())) / max(total, 1.0)
                    (loss * weight * scale_world).backward()
                for k, v in m.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v)
                n_metric += 1
            if cfg.grad_clip:
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)))
            self.optimizer.step()
            self.scheduler.step()
        self.version += 1
        if not lengths:
            return None
        out = {k: v / max(n_metric, 1) for k, v in metrics.items()}
        if grad_norms:  # the total gradient norm before clipping, mean over the PPO epochs
            out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out.update({"tokens": local if not seq_level else float(sum(sum(m) for m in batch["loss_mask"])),
                    "rows": float(len(lengths)), "lr": self.scheduler.get_last_lr()[0],
                    "microbatches": float(len(plans))})
        return out

    @ra.register(dispatch=ra.Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: ra.Batch) -> list[list[float]]:
        """Per-token logprobs of each row under the current weights."""
        return batch_logprobs(self.module, batch, self.config.max_tokens_per_microbatch, self.device)

    # ------------------------------------------------------------------ weights and checkpoints
    def cpu_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    @ra.register(dispatch=ra.Dispatch.RANK_ZERO)
    def publish_weights(self) -> list:
        """Rank 0 puts its weights into the Ray object store; returns ``[ObjectRef, version]``."""
        return [ray.put(self.cpu_state_dict()), self.version]

    @ra.register(dispatch=ra.Dispatch.RANK_ZERO)
    def publish_to(self, channel: Any, wait: bool = True) -> int:
        """Rank 0 publishes its weights to a weight channel (Mooncake, torch.distributed) as its current
        version. With ``wait=False`` the snapshot is copied to CPU and written in the background while
        this worker goes on training; the next publish (or :meth:`wait_published`) surfaces its error."""
        self.wait_published()
        if wait:
            channel.publish(self.cpu_state_dict(), self.version)
        else:
            self._publishing = channel.publish_async(self.cpu_state_dict(), self.version, copy=False)
        return self.version

    @ra.register(dispatch=ra.Dispatch.RANK_ZERO)
    def wait_published(self) -> None:
        """Block until the last background publish is written; re-raise its error if it failed."""
        pending = getattr(self, "_publishing", None)
        self._publishing = None
        if pending is not None:
            pending.result()

    @ra.register(dispatch=ra.Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        """Model, optimiser, scheduler, version and ``extra`` (e.g. consumed sample ids) in one file."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "version": self.version, "extra": extra or {}}, tmp)
        os.replace(tmp, target)  # a crash mid-write never leaves a torn checkpoint
        return str(target)

    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        return {"version": self.version, "extra": state.get("extra", {})}

    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def weight_checksum(self) -> float:
        """Sum of |w| over all parameters: equal across DDP ranks after every step."""
        with torch.no_grad():
            return float(sum(p.detach().abs().sum() for p in self.module.parameters()))


__all__ = ["TorchTrainWorker", "batch_logprobs", "free_port"]  # free_port: rollart.training.placement's


