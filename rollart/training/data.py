"""Turn trajectory groups into a training ``Batch`` with advantages (seed 000 §2.2, seed 004 §5.3).

Columns (one row per trajectory): ``input_ids``, ``loss_mask``, ``old_logprobs`` (behaviour logprobs of
the action tokens, 0 elsewhere), ``versions``, ``advantages`` (per token), ``rewards``, ``group_index``,
``tag``. GRPO normalises rewards within each group; the sequence advantage is broadcast over the
sequence's action tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rollart.cluster.batch import Batch
from rollart.rollout.types import Trajectory


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, norm_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)`` within each group (``std`` skipped if not ``norm_std``)."""
    try:
        from rollart.algorithms import grpo_advantages
    except ImportError:
        grpo_advantages = None
    if grpo_advantages is not None:
        return grpo_advantages(rewards, group_index, norm_std=norm_std, eps=eps)
    raise ImportError("rollart.algorithms.grpo_advantages is required")


def trajectories_to_batch(groups: Sequence[Sequence[Trajectory]], *, norm_std: bool = True) -> Batch:
    trajs = [t for g in groups for t in g]
    if any(t.reward is None for t in trajs):
        raise ValueError("a trajectory without a reward reached the trainer; failed rewards must be dropped or requeued")
    rewards = torch.tensor([float(t.reward) for t in trajs])  # type: ignore[arg-type]
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g])
    adv = group_advantages(rewards, group_index, norm_std=norm_std)
    return Batch(
        {
            "input_ids": [list(t.token_ids) for t in trajs],
            "loss_mask": [list(t.loss_mask) for t in trajs],
            "old_logprobs": [list(t.logprobs) for t in trajs],
            "versions": [list(t.versions) for t in trajs],
            "advantages": [[float(a)] * len(t.token_ids) for a, t in zip(adv.tolist(), trajs)],
            "rewards": rewards,
            "group_index": group_index,
            "tag": [t.tag for t in trajs],
        },
        meta={"num_groups": len(groups)},
    )
