"""Advantage estimators, pure functions over tensors (seed 000 §2.2, seed 003 §3 eq. 4–5)."""

from __future__ import annotations

import torch


def normalise_group(rewards: torch.Tensor, *, norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of one group, in float64: ``(r_i - mean) / (std + eps)`` (population std).

    A group whose rewards are all *exactly* equal gets exact zeros (not ``(r - fl(mean)) / eps``, which
    is a nonzero constant whenever the float mean of equal non-dyadic rewards is an ulp off). A group of
    two gets ``±d / (|d| + eps)`` with ``d = (r_0 - r_1) / 2``, exactly antisymmetric."""
    r = rewards.to(torch.float64)
    n = r.numel()
    if n == 0 or bool((r == r[0]).all()):
        return torch.zeros_like(r)
    if n == 2:
        d = (r[0] - r[1]) / 2  # exact up to one rounding, shared by both members
        a = d / (d.abs() + eps) if norm_std else d
        return torch.stack([a, -a])
    centred = r - r.mean()
    if norm_std:
        centred = centred / (centred.pow(2).mean().sqrt() + eps)
    return centred


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, norm_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the members of ``i``'s group, computed and
    returned in float64 (see :func:`normalise_group`); a group whose rewards are all equal gets exact
    zeros (never NaN). ``norm_std=False`` only centres."""
    rewards = rewards.to(torch.float64)
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        out[idx] = normalise_group(rewards[idx], norm_std=norm_std, eps=eps)
    return out


def reinforce_baseline_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: ``A_i = r_i - mean_{j in g, j != i} r_j`` (0 for a group of one and for
    a group of equal rewards), computed and returned in float64."""
    rewards = rewards.to(torch.float64)
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        n = r.numel()
        if n > 1:
            # r_i - (S - r_i) / (n - 1) = n / (n - 1) * (r_i - S / n): the centred group, scaled
            out[idx] = normalise_group(r, norm_std=False) * (n / (n - 1))
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over valid tokens: ``delta_t = r_t + gamma V_{t+1} - V_t``,
    ``A_t = delta_t + gamma lam A_{t+1}``; returns ``(advantages, returns = A + V)``."""
    return skip_observation_gae(rewards, values, torch.ones_like(mask) * mask, gamma, lam)


def skip_observation_gae(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor,
                         gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation token GAE (seed 003 eq. 4–5): the recursion runs over action tokens only
    (``loss_mask == 1``); the next value of an action token is the value of the next *action* token,
    skipping the observation tokens between turns, so one TD step links consecutive actions across an
    environment observation. Rewards on observation tokens are carried to the preceding action token."""
    B, T = rewards.shape
    adv = torch.zeros_like(values, dtype=torch.float32)
    for b in range(B):
        idx = torch.nonzero(loss_mask[b] > 0).flatten().tolist()
        carry = 0.0
        next_value = 0.0
        # rewards on non-action tokens after action k belong to action k
        acc = rewards[b].to(torch.float32).clone()
        for k in range(len(idx)):
            end = idx[k + 1] if k + 1 < len(idx) else T
            acc[idx[k]] = rewards[b, idx[k]:end].sum()
        for k in reversed(range(len(idx))):
            t = idx[k]
            delta = float(acc[t]) + gamma * next_value - float(values[b, t])
            carry = delta + gamma * lam * carry
            adv[b, t] = carry
            next_value = float(values[b, t])
    return adv, adv + values.to(torch.float32) * (loss_mask > 0)


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """Length-adaptive GAE lambda ``lam = 1 - 1 / (alpha * l)`` (clamped to [0, 1]): longer sequences
    use a lambda closer to 1 so the bias of bootstrapping does not grow with length."""
    return (1.0 - 1.0 / (alpha * lengths.to(torch.float32)).clamp(min=1e-6)).clamp(0.0, 1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries (unmasked entries are returned as 0)."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) / torch.sqrt(var + eps) * m
