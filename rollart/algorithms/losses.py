"""Policy losses, pure functions over ``[B, T]`` tensors (seed 000 §2.2, eq. 12; seed 003 §3).

Notation: ``logprobs`` log pi_theta (with gradient), ``old_logprobs`` log pi_old (the policy before the
update), ``rollout_logprobs`` log mu (the inference engine that sampled the tokens), ``A`` advantages,
``r = exp(logprobs - old_logprobs)`` the importance ratio, ``sg`` stop-gradient. Every loss returns the
per-token loss matrix aggregated by :func:`aggregate` and a metrics dict.

Train/inference mismatch (seed 000 eq. 12): with ``rollout_logprobs`` and ``tis_cap=C`` every loss is
multiplied per token by ``w = sg(min(exp(old_logprobs - rollout_logprobs), C))``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rollart.algorithms.aggregation import aggregate

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
_LOSSES: dict[str, LossFn] = {}


def register_policy_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Add a loss ``fn(logprobs, old_logprobs, advantages, mask, **params) -> (per_token_loss, metrics)``."""
    def add(fn: LossFn) -> LossFn:
        _LOSSES[name] = fn
        return fn

    return add


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


@register_policy_loss("ppo")
def _ppo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         eps: float = 0.2, eps_low: float | None = None, eps_high: float | None = None,
         dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``; with ``dual_clip=c`` and
    ``A < 0`` the loss is further capped at ``-c A``."""
    lo, hi = eps if eps_low is None else eps_low, eps if eps_high is None else eps_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1 - lo, 1 + hi) * advantages
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    clip_frac = _masked_mean((clipped > unclipped).float(), mask)
    return loss, {"clip_frac": clip_frac}


@register_policy_loss("decoupled_ppo")
def _decoupled_ppo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, prox_logprobs: torch.Tensor | None = None, eps: float = 0.2,
                   behave_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled objective (seed 000 §2.2): the trust region is centred on the proximal policy
    ``prox`` while the behaviour policy ``old`` (which sampled the tokens) is corrected by
    ``w = sg(exp(prox - old))`` (optionally capped): ``-w * min(r' A, clip(r', 1±eps) A)``,
    ``r' = exp(logprobs - prox)``."""
    if prox_logprobs is None:
        raise ValueError("policy_loss('decoupled_ppo') needs prox_logprobs (the proximal policy's logprobs)")
    w = torch.exp(prox_logprobs - old_logprobs).detach()
    if behave_cap is not None:
        w = w.clamp(max=behave_cap)
    loss, m = _ppo(logprobs, prox_logprobs, advantages, mask, eps=eps)
    return w * loss, {**m, "behave_weight_mean": _masked_mean(w, mask)}


@register_policy_loss("tis")
def _tis(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling REINFORCE: ``-sg(min(r, cap)) * A * logprobs``."""
    w = torch.exp(logprobs - old_logprobs).clamp(max=cap).detach()
    return -w * advantages * logprobs, {"tis_weight_mean": _masked_mean(w, mask)}


@register_policy_loss("cispo")
def _cispo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
           eps_low: float = 1.0, eps_high: float = 0.28) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: the IS weight is clipped and stop-gradiented, every token keeps a gradient:
    ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logprobs``."""
    ratio = torch.exp(logprobs - old_logprobs)
    w = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    return -w * advantages * logprobs, {"clip_frac": _masked_mean((w != ratio.detach()).float(), mask)}


@register_policy_loss("topr")
def _topr(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          cap: float = 1.0, positive_weight: float = 1.0, negative_weight: float = 1.0
          ) -> tuple[torch.Tensor, dict[str, float]]:
    """Tapered off-policy REINFORCE: positive-advantage tokens get the plain (SFT-like) gradient
    ``-A * logprobs``; negative ones a truncated IS weight ``-sg(min(r, cap)) * A * logprobs``.
    ``weighted_topr`` sets ``positive_weight``/``negative_weight``."""
    w = torch.exp(logprobs - old_logprobs).clamp(max=cap).detach()
    pos = advantages > 0
    loss = torch.where(pos, -positive_weight * advantages * logprobs, -negative_weight * w * advantages * logprobs)
    return loss, {"positive_frac": _masked_mean(pos.float(), mask)}


register_policy_loss("weighted_topr")(_topr)


@register_policy_loss("dis")
def _dis(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         rollout_logprobs: torch.Tensor | None = None, low: float = 0.5, high: float = 2.0
         ) -> tuple[torch.Tensor, dict[str, float]]:
    """Double-sided token IS masking (seed 003 eq. 1–3): with ``rho = exp(logprobs - rollout_logprobs)``
    tokens whose ratio leaves ``[low, high]`` are masked out; kept tokens contribute
    ``-sg(rho) * A * logprobs``."""
    ref = rollout_logprobs if rollout_logprobs is not None else old_logprobs
    rho = torch.exp(logprobs - ref).detach()
    keep = ((rho >= low) & (rho <= high)).to(logprobs.dtype)
    return -keep * rho * advantages * logprobs, {"mask_frac": 1.0 - _masked_mean(keep, mask)}


def policy_loss(name: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, rollout_logprobs: torch.Tensor | None = None,
                prox_logprobs: torch.Tensor | None = None, agg: str = "token-mean",
                group_ids: torch.Tensor | None = None, tis_cap: float | None = None,
                **params: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """``(aggregated loss, metrics)`` of the loss ``name`` (see the module docstring)."""
    if name not in _LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(_LOSSES)}")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    mask = mask.to(logprobs.dtype)
    extra: dict[str, Any] = dict(params)
    if name == "decoupled_ppo":
        extra["prox_logprobs"] = prox_logprobs
    if name == "dis":
        extra["rollout_logprobs"] = rollout_logprobs
    try:
        loss_mat, metrics = _LOSSES[name](logprobs, old_logprobs, advantages, mask, **extra)
    except TypeError as err:
        raise ValueError(f"policy_loss({name!r}): {err}") from None
    if tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap needs rollout_logprobs (the inference engine's logprobs)")
        w = torch.exp(old_logprobs - rollout_logprobs).clamp(max=tis_cap).detach()
        loss_mat = loss_mat * w
        metrics["mismatch_is_mean"] = _masked_mean(w, mask)
    with torch.no_grad():
        ratio = torch.exp(logprobs - old_logprobs)
        valid = mask > 0
        log_r = (logprobs - old_logprobs).detach()
        metrics.update({
            "ratio_mean": _masked_mean(ratio, mask),
            "ratio_max": float(ratio[valid].max()) if valid.any() else 1.0,
            "ratio_min": float(ratio[valid].min()) if valid.any() else 1.0,
            "kl_k1": _masked_mean(-log_r, mask),
            "kl_k3": _masked_mean(torch.exp(log_r) - 1 - log_r, mask),
        })
    return aggregate(loss_mat, mask, agg, group_ids), metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of pi_theta from pi_ref: k1 ``log r``, k2 ``(log r)^2 / 2``,
    k3 ``exp(-log r) - 1 + log r`` (with ``log r = logprobs - ref``), abs ``|log r|``."""
    log_r = logprobs - ref_logprobs
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.exp(-log_r) - 1 + log_r
    if kind == "abs":
        return log_r.abs()
    raise ValueError(f"kl_penalty(kind={kind!r}): use k1, k2, k3 or abs")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2) -> torch.Tensor:
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old ± c) - R)^2)``, token mean."""
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * aggregate(err, mask, "token-mean")
