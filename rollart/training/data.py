"""Turn trajectory groups into a training ``Batch`` with advantages (seed 000 §2.2, seed 004 §5.3).

Columns (one row per trajectory): ``input_ids``, ``loss_mask``, ``old_logprobs`` (behaviour logprobs of
the action tokens, 0 elsewhere), ``versions``, ``advantages`` (per token), ``rewards``, ``group_index``,
``tag``. GRPO normalises rewards within each group; the sequence advantage is broadcast over the
sequence's action tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rollart.algorithms import grpo_advantages, normalise_group
from rollart.cluster.batch import Batch
from rollart.rollout.types import Trajectory


def token_group_advantages(groups: Sequence[Sequence[Trajectory]], eps: float = 1e-6) -> list[list[float]]:
    """Dense GRPO: the k-th action token of every member of a group is normalised against the k-th
    action tokens of the other members, ``A_ik = (c_ik - mean_i c_ik) / (std_i c_ik + eps)``, where
    ``c_ik`` is the token's credit (``Trajectory.token_rewards``). Per-token credit removes the noise
    of crediting every token with the whole sequence's reward. Computed in float64 per position; a
    position whose present members all have the same credit gets exact zeros."""
    out: list[list[float]] = []
    for group in groups:
        positions = [[i for i, m in enumerate(t.loss_mask) if m] for t in group]
        width = max((len(p) for p in positions), default=0)
        credit: list[list[float]] = [[] for _ in group]
        for r, (t, pos) in enumerate(zip(group, positions)):
            if t.token_rewards is None:
                raise ValueError(f"advantage=grpo_token needs token_rewards; trajectory {t.traj_id} ({t.tag}) has none")
            for k, i in enumerate(pos):
                credit[r].append(float(t.token_rewards[i]) if i < len(t.token_rewards) else 0.0)
        adv = torch.zeros((len(group), width), dtype=torch.float64)
        for k in range(width):
            present = [r for r in range(len(group)) if k < len(positions[r])]
            column = torch.tensor([credit[r][k] for r in present], dtype=torch.float64)
            adv[present, k] = normalise_group(column, eps=eps)
        for r, (t, pos) in enumerate(zip(group, positions)):
            row = [0.0] * len(t.token_ids)
            for k, i in enumerate(pos):
                row[i] = float(adv[r, k])
            out.append(row)
    return out


def trajectories_to_batch(groups: Sequence[Sequence[Trajectory]], *, norm_std: bool = True,
                          advantage: str = "grpo") -> Batch:
    """``advantage``: ``grpo`` (sequence reward, group-normalised), ``grpo_token`` (dense per-token
    credit, see :func:`token_group_advantages`, for groups whose env reports it; sequence GRPO for the
    others) or ``reinforce`` (leave-one-out baseline)."""
    trajs = [t for g in groups for t in g]
    if any(t.reward is None for t in trajs):
        raise ValueError("a trajectory without a reward reached the trainer; failed rewards must be dropped or requeued")
    rewards = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float64)  # type: ignore[arg-type]
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g])
    if advantage == "grpo_token":
        # dense credit where the env gives it (char_rewards); sequence GRPO for the other groups
        seq_adv = grpo_advantages(rewards, group_index, norm_std=norm_std).tolist()
        per_token, row = [], 0
        for group in groups:
            if all(t.token_rewards is not None for t in group):
                per_token += token_group_advantages([group])
            else:
                per_token += [[seq_adv[row + k]] * len(t.token_ids) for k, t in enumerate(group)]
            row += len(group)
    else:
        if advantage == "grpo":
            adv = grpo_advantages(rewards, group_index, norm_std=norm_std)
        elif advantage == "reinforce":
            from rollart.algorithms import reinforce_baseline_advantages

            adv = reinforce_baseline_advantages(rewards, group_index)
        else:
            raise ValueError(f"advantage={advantage!r}: use grpo, grpo_token or reinforce")
        per_token = [[float(a)] * len(t.token_ids) for a, t in zip(adv.tolist(), trajs)]
    return Batch(
        {
            "input_ids": [list(t.token_ids) for t in trajs],
            "loss_mask": [list(t.loss_mask) for t in trajs],
            "old_logprobs": [list(t.logprobs) for t in trajs],
            "versions": [list(t.versions) for t in trajs],
            "advantages": per_token,
            "rewards": rewards,
            "group_index": group_index,
            "tag": [t.tag for t in trajs],
        },
        meta={"num_groups": len(groups)},
    )
