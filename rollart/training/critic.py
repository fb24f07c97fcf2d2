"""The critic (value model) and the GAE batch path (SAO §3, "Reducing Off-Policy with Single Rollout").

Value model. A causal-LM backbone (``AutoModel``: the transformer without its LM head) plus a scalar
head ``v = w·h + b``. ``V[:, t]`` is the value of the state in which token ``t`` is generated (the
prefix ``x_{<t}``), read from the hidden state at ``t - 1``; it is laid out like ``token_logprobs``
(``V[:, 0] = 0``: position 0 is prompt, never an action).

Advantages (SAO eq. 4–5, :func:`rollart.algorithms.skip_observation_gae`). A trajectory is
``[prompt, a_0, o_0, a_1, o_1, ...]`` with ``loss_mask`` 1 on the action tokens. The GAE recursion runs
over action tokens only; the successor of the last token of action ``i`` is the first token of action
``i + 1``, skipping the observation the environment produced::

    delta_t = r_t + gamma * V(next action token) - V_t        (V after the last action token = 0)
    A_t     = delta_t + gamma * lam * A_(next action token)
    R_t     = A_t + V_t                                       (the critic's regression target)

The sequence reward sits on the last action token (``r_t = 0`` elsewhere), so with ``gamma = lam = 1``
``A_t = reward - V_t`` on every action token. Observation and prompt tokens get ``A = R = 0``. With
``length_adaptive`` each trajectory gets ``lam = 1 - 1 / (alpha * l)`` for its ``l`` action tokens.
The returns use their own lambda, ``critic_lambda`` (SAO: ``lambda_critic = 1``, so ``R_t`` is the
Monte-Carlo return, while the policy uses the length-adaptive lambda with ``alpha = 1.5``).
Advantages are whitened over all action tokens of the batch after the returns are taken.

Critic loss (:func:`rollart.algorithms.value_loss`): ``0.5 * max((V - R)^2, (clip(V, V_old ± c) - R)^2)``,
token mean over the action tokens of the whole batch (each micro-batch and each DDP rank weighted by its
share of the tokens, as the actor's strategy does).

SAO §3 gives two value-training designs, both here:

* **K updates per actor step** ("Faster Value Update than Policy"): single-rollout RL has no group
  baseline, so the variance of the advantages is only as low as the critic is accurate, and the critic
  chases a policy that moves every step. For each policy update the value model takes ``K > 1``
  gradient updates (``CriticConfig.epochs``, ``K = 2`` in the paper) on the same batch, so its
  estimates adapt to the current policy before they are used for the next advantages. Each of the
  ``K`` passes is one optimiser step over the (micro-batched) batch; the clip of the value loss is
  always around the values the batch was scored with (``batch["values"]``).
* **Frozen attention** ("Stabilizing Value Model Training via Parameter Freezing"): the paper finds the
  critic's gradient norms much larger than the policy's, the instability coming from the attention
  layers. ``freeze_attention`` keeps every self-attention parameter at its pre-trained value (and out of
  the optimiser) and trains only the MLP/MoE projections, norms, embeddings and the value head: the
  pre-trained attention already attends to the right tokens, and holding it fixed keeps the critic's
  representation stable while it tracks the moving policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rollart.cluster.batch import Batch
from rollart.cluster.devices import worker_device
from rollart.cluster.worker import Worker
from rollart.decorators.register import register
from rollart.decorators.specs import Dispatch
from rollart.rollout.types import Trajectory
from rollart.training import columns as C
from rollart.training.accumulation import accumulate_step, global_sum, plan_share
from rollart.training.checkpoint_io import load_checkpoint_file, save_checkpoint_file
from rollart.training.config import CriticConfig
from rollart.training.microbatch import pad_right, plan_microbatches
from rollart.training.placement import (
    DP_SPLIT_EVERY_RANK,
    DataParallelRank,
    DataParallelTraining,
    apply_optimizer_settings,
    model_path,
)


class ValueModel(torch.nn.Module):
    """Backbone plus scalar head; ``forward`` returns ``[B, T]`` values (see the module docstring)."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.normal_(self.head.weight, std=0.02)  # small, not zero: the backbone learns from step 1
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        v = self.head(hidden.float()).squeeze(-1)
        return torch.nn.functional.pad(v[:, :-1], (1, 0))


class CriticWorker(DataParallelRank, Worker):
    """One data-parallel rank of the critic."""

    def __init__(self, config: CriticConfig | dict[str, Any] | None = None):
        from transformers import AutoModel

        from rollart.models.shapes import load_pretrained

        self.config = CriticConfig.model_validate(config or {})
        torch.manual_seed(self.config.seed)
        path = model_path(self.config.model)
        self.device = worker_device(self.device_ids)
        backbone = load_pretrained(AutoModel, path, dtype=torch.float32)
        self.module = ValueModel(backbone, int(backbone.config.hidden_size)).to(self.device)
        self.module.train()
        self.frozen_tensors = 0
        self.frozen_params = 0
        if self.config.freeze_attention:
            for name, p in self.module.named_parameters():
                if "self_attn" in name:
                    p.requires_grad_(False)
                    self.frozen_tensors += 1
                    self.frozen_params += p.numel()
            if not self.frozen_tensors:
                raise ValueError(f"freeze_attention: no parameter of {path} has 'self_attn' in its name")
        self.training = DataParallelTraining(
            self.module, device=self.device, lr=self.config.lr, warmup_steps=self.config.warmup_steps
        )
        self.steps = 0

    def value(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` value of each position under the current weights (with grad)."""
        return self.model(input_ids, attention_mask)

    def _tensors(self, batch: Batch, idx: list[int], with_targets: bool) -> dict[str, torch.Tensor]:
        ids = [batch[C.INPUT_IDS][i] for i in idx]
        out = {
            C.INPUT_IDS: pad_right(ids, 0, torch.long),
            C.ATTENTION_MASK: pad_right([[1] * len(s) for s in ids], 0, torch.long),
        }
        if with_targets:
            out[C.LOSS_MASK] = pad_right([batch[C.LOSS_MASK][i] for i in idx], 0, torch.float32)
            out[C.VALUES] = pad_right([batch[C.VALUES][i] for i in idx], 0.0, torch.float32)
            out[C.RETURNS] = pad_right([batch[C.RETURNS][i] for i in idx], 0.0, torch.float32)
        return {k: v.to(self.device) for k, v in out.items()}

    # ------------------------------------------------------------------ values and training
    @register(dispatch=Dispatch.DP_SPLIT)
    def compute_values(self, batch: Batch) -> list[list[float]]:
        """Per-token values of each row under the current weights, each row cut to its length."""
        lengths = [len(s) for s in batch[C.INPUT_IDS]]
        out: list[list[float] | None] = [None] * len(lengths)
        with torch.no_grad():
            for idx in plan_microbatches(lengths, self.config.max_tokens_per_microbatch):
                mb = self._tensors(batch, idx, with_targets=False)
                v = self.module(mb[C.INPUT_IDS], mb[C.ATTENTION_MASK]).cpu()
                for row, i in enumerate(idx):
                    out[i] = v[row, : lengths[i]].tolist()
        return out  # type: ignore[return-value]

    def _value_backward(self, mb: dict[str, torch.Tensor], total: float, scale_world: int, acc: list[float]) -> None:
        """The value loss of one micro-batch, backward (weighted by its share of the ``total`` action
        tokens of the step); its sums (loss, clipped, n, R, R^2, R-V, (R-V)^2 over the action tokens) are
        added to ``acc``."""
        from rollart.algorithms import value_loss

        cfg = self.config
        values = self.value(mb[C.INPUT_IDS], mb[C.ATTENTION_MASK])
        mask, old, ret = mb[C.LOSS_MASK], mb[C.VALUES], mb[C.RETURNS]
        n = float(mask.sum())
        loss = value_loss(values, old, ret, mask, clip=cfg.value_clip)
        (loss * (n / max(total, 1.0)) * scale_world).backward()
        with torch.no_grad():
            v = values.detach()
            clipped = 0.0
            if cfg.value_clip is not None:
                vc = old + (v - old).clamp(-cfg.value_clip, cfg.value_clip)
                clipped = float((((vc - ret) ** 2 > (v - ret) ** 2).float() * mask).sum())
            err = ret - v
            sums = [
                float(loss) * n,
                clipped,
                n,
                float((ret * mask).sum()),
                float((ret**2 * mask).sum()),
                float((err * mask).sum()),
                float((err**2 * mask).sum()),
            ]
            acc[:] = [a + b for a, b in zip(acc, sums)]

    @register(dispatch=DP_SPLIT_EVERY_RANK)
    def train_step(self, batch: Batch) -> dict[str, float] | None:
        """K (``epochs``) value updates on this rank's share of ``batch`` (``input_ids``, ``loss_mask``,
        ``values``: the values the batch was scored with, ``returns``); returns this rank's metrics.
        ``value_loss``, ``value_clipfrac`` and ``explained_variance`` are measured before each update and
        averaged over the K passes; ``value_loss_first`` / ``value_loss_last`` are the first and last.
        An empty share returns ``None`` but still takes part in every collective of the step."""
        cfg = self.config
        if len(batch):
            C.require(batch, C.INPUT_IDS, C.LOSS_MASK, C.VALUES, C.RETURNS, who="CriticWorker.train_step")
        lengths = [len(s) for s in batch[C.INPUT_IDS]] if len(batch) else []
        local = float(sum(sum(m) for m in batch[C.LOSS_MASK])) if lengths else 0.0
        total = global_sum([local], self.distributed)[0]
        share = plan_share(
            lengths,
            cfg.max_tokens_per_microbatch,
            lambda idx: self._tensors(batch, idx, with_targets=True),
            self.distributed,
        )
        scale_world = self.world_size if self.distributed else 1
        params = [p for p in self.module.parameters() if p.requires_grad]
        losses, clipfracs, evs, norms = [], [], [], []
        # sums over the action tokens of one pass: loss, clipped, n, R, R^2, R-V, (R-V)^2
        acc = [0.0] * 7

        def backward(mb: dict[str, torch.Tensor]) -> None:
            self._value_backward(mb, total, scale_world, acc)

        for _ in range(cfg.epochs):
            acc[:] = [0.0] * 7
            norm = accumulate_step(
                model=self.model,
                params=params,
                optimizer=self.optimizer,
                share=share,
                backward=backward,
                zero_forward=self.value,
                device=self.device,
                grad_clip=cfg.grad_clip,
            )
            # the metrics are all-reduced after the optimiser step: the same collective order on every rank
            s_loss, s_clip, s_n, s_r, s_r2, s_e, s_e2 = global_sum(acc, self.distributed)
            n = max(s_n, 1.0)
            var_r = s_r2 / n - (s_r / n) ** 2
            var_e = s_e2 / n - (s_e / n) ** 2
            losses.append(s_loss / n)
            clipfracs.append(s_clip / n)
            evs.append(1.0 - var_e / var_r if var_r > 1e-12 else 0.0)
            norms.append(norm)
        self.steps += 1
        self.scheduler.step()  # the warm-up counts train_steps (actor steps), not the K updates within one
        if not lengths:
            return None
        k = float(cfg.epochs)
        return {
            "value_loss": sum(losses) / k,
            "value_loss_first": losses[0],
            "value_loss_last": losses[-1],
            "value_clipfrac": sum(clipfracs) / k,
            "explained_variance": sum(evs) / k,
            "grad_norm": sum(norms) / k,
            "epochs": k,
            "frozen_params": float(self.frozen_params),
            "frozen_tensors": float(self.frozen_tensors),
            "tokens": local,
            "rows": float(len(lengths)),
            "microbatches": float(len(share.plans)),
            "lr": self.scheduler.get_last_lr()[0],
        }

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch=Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str, step: int) -> str:
        """Value model, optimiser, warm-up schedule and step counters in one file (tensors, dicts, lists and
        numbers only: ``torch.load(weights_only=True)`` reads it). ``step`` is the pipeline step it
        belongs to, checked on resume against the actor's checkpoint."""
        return save_checkpoint_file(
            {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "steps": self.steps,
                "step": int(step),
            },
            path,
        )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict[str, int]:
        """Restore :meth:`save_checkpoint`'s file on every rank; returns its ``step`` and ``steps``."""
        state = load_checkpoint_file(path, map_location=self.device)  # weights_only: no arbitrary unpickling
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # the run's critic.lr, not the one stored with the optimizer (a resume with --set critic.lr=...
        # trains the critic at the new rate from here, at the warm-up's current point)
        group = self.optimizer.param_groups[0]
        changed = apply_optimizer_settings(
            self.optimizer, self.scheduler, lr=self.config.lr, weight_decay=group["weight_decay"], betas=group["betas"]
        )
        if changed and self.rank == 0:
            old, new = changed["lr"]
            self.logger.info(
                "critic checkpoint %s: the run's critic.lr=%s replaces the checkpoint's %s", path, new, old
            )
        self.steps = int(state["steps"])
        return {"step": int(state["step"]), "steps": self.steps}

    # ------------------------------------------------------------------ inspection
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def param_checksum(self, kind: str = "all") -> float:
        """Sum of ``|w|`` (float64) over the parameters of ``kind``: ``all``, ``attention`` (names with
        ``self_attn``), ``mlp`` (names with ``mlp``) or ``head`` (the value head)."""
        keep = {
            "all": lambda n: True,
            "attention": lambda n: "self_attn" in n,
            "mlp": lambda n: ".mlp." in n,
            "head": lambda n: n.startswith("head."),
        }[kind]
        with torch.no_grad():
            return float(sum(p.detach().double().abs().sum() for n, p in self.module.named_parameters() if keep(n)))

    @register(dispatch=Dispatch.RANK_ZERO)
    def state_summary(self) -> dict[str, list[float]]:
        """Every parameter of rank 0 as a flat list, by name (for exact comparisons in tests; small models)."""
        return {n: p.detach().cpu().flatten().tolist() for n, p in self.module.named_parameters()}


def gae_batch(
    groups: Sequence[Sequence[Trajectory]],
    values: Sequence[Sequence[float]],
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    critic_lam: float | None = None,
    length_adaptive: bool = False,
    alpha: float = 0.05,
    whiten: bool = True,
) -> Batch:
    """:func:`rollart.training.data.trajectories_to_batch` then :func:`rollart.training.data.add_advantages`
    with ``gae`` under the critic's ``values`` (one row per trajectory, in group order, e.g. the output of
    ``CriticWorker.compute_values``): the batch plus ``advantages``, ``values`` and ``returns``."""
    from rollart.training.data import add_advantages, trajectories_to_batch

    return add_advantages(
        trajectories_to_batch(groups, advantage=None),
        "gae",
        values=values,
        gamma=gamma,
        lam=lam,
        critic_lam=critic_lam,
        length_adaptive=length_adaptive,
        alpha=alpha,
        whiten=whiten,
    )
