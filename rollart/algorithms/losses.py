"""Policy losses, pure functions over ``[B, T]`` tensors (ROLL Flash §2.2, eq. 12; SAO §3).

Notation (one name per meaning, as in ``rollart.training.columns``): ``logprobs`` log pi_theta, the
current policy (with gradient); ``proximal_logprobs`` log pi_old, the trainer's policy before this
update (the PPO trust-region centre); ``behaviour_logprobs`` log mu, the inference engine that sampled
the tokens; ``A`` advantages; ``r = exp(logprobs - proximal_logprobs)`` the importance ratio; ``sg``
stop-gradient. Every loss returns the per-token loss matrix aggregated by :func:`aggregate` and a
metrics dict.

Train/inference mismatch (ROLL Flash eq. 12): with ``behaviour_logprobs`` and ``tis_cap=C`` every loss
is multiplied per token by ``w = sg(min(exp(proximal_logprobs - behaviour_logprobs), C))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollart.algorithms.aggregation import aggregate
from rollart.plugins import LazyModule

if TYPE_CHECKING:
    import torch
else:  # imported at first use: a config is checked against these functions without torch
    torch = LazyModule("torch", globals())

LossFn = Callable[..., tuple["torch.Tensor", dict[str, float]]]
_LOSSES: dict[str, LossFn] = {}
_USES_PROXIMAL: dict[str, bool] = {}


def register_policy_loss(name: str, *, uses_proximal: bool = True) -> Callable[[LossFn], LossFn]:
    """Add a loss ``fn(logprobs, advantages, mask, *, proximal_logprobs, behaviour_logprobs, **params)
    -> (per_token_loss, metrics)``; either log-prob argument may be ``None`` when the caller has none.
    ``uses_proximal=False`` says the loss never reads ``proximal_logprobs`` (the trainer then skips
    recomputing pi_old when nothing else needs it)."""

    def add(fn: LossFn) -> LossFn:
        _LOSSES[name] = fn
        _USES_PROXIMAL[name] = uses_proximal
        return fn

    return add


register_loss = register_policy_loss  # the name the plug-in docs use: ``@register_loss("my_loss")``


def registered_losses() -> list[str]:
    """The names ``train.loss`` accepts besides ``MODULE:FUNC``."""
    return sorted(_LOSSES)


def resolve_loss(name: str, field: str = "train.loss") -> LossFn:
    """The loss function of a registered ``name`` or a ``MODULE:FUNC`` spec (imported; the module is
    looked up as :func:`rollart.plugins.import_object` does). Raises ``ValueError`` naming ``field``."""
    from rollart.plugins import lookup

    fn = lookup(name, _LOSSES, field, "policy loss")
    if not callable(fn):
        raise ValueError(f"{field}: {name!r} is {type(fn).__name__}, not a function")
    return fn


# what the trainer passes every loss besides loss_params: (logprobs, advantages, mask) and these
_LOSS_FIXED = {"proximal_logprobs": None, "behaviour_logprobs": None}


def loss_contract_problems(name: str) -> list[str]:
    """Why the loss ``name`` (registered or ``MODULE:FUNC``) cannot be called the way the trainer calls
    every loss, ``fn(logprobs, advantages, mask, *, proximal_logprobs, behaviour_logprobs, **params)``;
    empty when it can. Raises ``ValueError`` when ``name`` is unknown."""
    from rollart.plugins import signature_problems

    bad = signature_problems(resolve_loss(name), {}, leading=(None, None, None), fixed=_LOSS_FIXED)
    return [
        f"{name!r} must take (logprobs, advantages, mask, *, proximal_logprobs, behaviour_logprobs, **params): {p}"
        for p in bad
    ]


def loss_params_problems(name: str, params: dict[str, Any]) -> list[str]:
    """What is wrong with ``train.loss_params: params`` for the loss ``name``: unknown or missing
    arguments, values that do not fit an annotation. Empty when fine."""
    from rollart.plugins import signature_problems

    return signature_problems(resolve_loss(name), params, leading=(None, None, None), fixed=_LOSS_FIXED)


def loss_uses_proximal(name: str) -> bool:
    """Whether the loss ``name`` (or ``MODULE:FUNC``) reads ``proximal_logprobs`` (log pi_old); a
    function that was never registered is assumed to."""
    if name in _USES_PROXIMAL:
        return _USES_PROXIMAL[name]
    fn = resolve_loss(name)
    for key, registered in _LOSSES.items():
        if registered is fn:
            return _USES_PROXIMAL[key]
    return True


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


def _needs(x: torch.Tensor | None, what: str, loss: str, meaning: str) -> torch.Tensor:
    if x is None:
        raise ValueError(f"policy_loss({loss!r}) needs {what} ({meaning})")
    return x


def _ppo_terms(
    logprobs: torch.Tensor,
    proximal: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    lo: float,
    hi: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    ratio = torch.exp(logprobs - proximal)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1 - lo, 1 + hi) * advantages
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss, {"clip_frac": _masked_mean((clipped > unclipped).float(), mask)}


_PROX = "proximal_logprobs", "log pi_old: the trainer's policy before this update"
_BEHAVE = "behaviour_logprobs", "log mu: the inference engine's logprobs of the sampled tokens"


@register_policy_loss("ppo")
def _ppo(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    eps: float = 0.2,
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``; with ``dual_clip=c`` and
    ``A < 0`` the loss is further capped at ``-c A``."""
    prox = _needs(proximal_logprobs, _PROX[0], "ppo", _PROX[1])
    lo, hi = eps if eps_low is None else eps_low, eps if eps_high is None else eps_high
    return _ppo_terms(logprobs, prox, advantages, mask, lo, hi, dual_clip)


@register_policy_loss("decoupled_ppo")
def _decoupled_ppo(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    eps: float = 0.2,
    behave_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled objective (ROLL Flash §2.2): the trust region is centred on the proximal policy while the
    behaviour policy (which sampled the tokens) is corrected by ``w = sg(exp(proximal - behaviour))``
    (optionally capped): ``-w * min(r A, clip(r, 1±eps) A)``, ``r = exp(logprobs - proximal)``."""
    prox = _needs(proximal_logprobs, _PROX[0], "decoupled_ppo", _PROX[1])
    behave = _needs(behaviour_logprobs, _BEHAVE[0], "decoupled_ppo", _BEHAVE[1])
    w = torch.exp(prox - behave).detach()
    if behave_cap is not None:
        w = w.clamp(max=behave_cap)
    loss, m = _ppo_terms(logprobs, prox, advantages, mask, eps, eps, None)
    return w * loss, {**m, "behave_weight_mean": _masked_mean(w, mask)}


@register_policy_loss("tis")
def _tis(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling REINFORCE: ``-sg(min(r, cap)) * A * logprobs``."""
    prox = _needs(proximal_logprobs, _PROX[0], "tis", _PROX[1])
    w = torch.exp(logprobs - prox).clamp(max=cap).detach()
    return -w * advantages * logprobs, {"tis_weight_mean": _masked_mean(w, mask)}


@register_policy_loss("cispo")
def _cispo(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: the IS weight is clipped and stop-gradiented, every token keeps a gradient:
    ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logprobs``."""
    prox = _needs(proximal_logprobs, _PROX[0], "cispo", _PROX[1])
    ratio = torch.exp(logprobs - prox)
    w = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    return -w * advantages * logprobs, {"clip_frac": _masked_mean((w != ratio.detach()).float(), mask)}


def _topr(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    cap: float = 1.0,
    positive_weight: float = 1.0,
    negative_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Tapered off-policy REINFORCE: positive-advantage tokens get the plain (SFT-like) gradient
    ``-A * logprobs``; negative ones a truncated IS weight ``-sg(min(r, cap)) * A * logprobs``.
    ``weighted_topr`` sets ``positive_weight``/``negative_weight``."""
    prox = _needs(proximal_logprobs, _PROX[0], "topr", _PROX[1])
    w = torch.exp(logprobs - prox).clamp(max=cap).detach()
    pos = advantages > 0
    loss = torch.where(pos, -positive_weight * advantages * logprobs, -negative_weight * w * advantages * logprobs)
    return loss, {"positive_frac": _masked_mean(pos.float(), mask)}


register_policy_loss("topr")(_topr)
register_policy_loss("weighted_topr")(_topr)


@register_policy_loss("dis", uses_proximal=False)
def _dis(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Double-sided token IS masking (SAO eq. 1–3): with ``rho = exp(logprobs - behaviour_logprobs)``
    tokens whose ratio leaves ``[low, high]`` are masked out; kept tokens contribute
    ``-sg(rho) * A * logprobs``. The proximal policy plays no part."""
    behave = _needs(behaviour_logprobs, _BEHAVE[0], "dis", _BEHAVE[1])
    rho = torch.exp(logprobs - behave).detach()
    keep = ((rho >= low) & (rho <= high)).to(logprobs.dtype)
    return -keep * rho * advantages * logprobs, {"mask_frac": 1.0 - _masked_mean(keep, mask)}


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    agg: str = "token-mean",
    group_ids: torch.Tensor | None = None,
    tis_cap: float | None = None,
    **params: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``(aggregated loss, metrics)`` of the loss ``name`` (see the module docstring). The ratio metrics
    (``ratio_*``, ``kl_k1``, ``kl_k3``) compare ``logprobs`` with the proximal policy, or with the
    behaviour policy when no proximal log-probs are given."""
    loss_fn = resolve_loss(name, "loss")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    mask = mask.to(logprobs.dtype)
    try:
        loss_mat, metrics = loss_fn(
            logprobs,
            advantages,
            mask,
            proximal_logprobs=proximal_logprobs,
            behaviour_logprobs=behaviour_logprobs,
            **params,
        )
    except TypeError as err:
        raise ValueError(f"policy_loss({name!r}): {err}") from None
    if tis_cap is not None:
        behave = _needs(behaviour_logprobs, _BEHAVE[0], f"{name}, tis_cap={tis_cap}", _BEHAVE[1])
        prox = _needs(proximal_logprobs, _PROX[0], f"{name}, tis_cap={tis_cap}", _PROX[1])
        w = torch.exp(prox - behave).clamp(max=tis_cap).detach()
        loss_mat = loss_mat * w
        metrics["mismatch_is_mean"] = _masked_mean(w, mask)
    anchor = proximal_logprobs if proximal_logprobs is not None else behaviour_logprobs
    if anchor is not None:
        with torch.no_grad():
            log_r = (logprobs - anchor).detach()
            ratio = torch.exp(log_r)
            valid = mask > 0
            metrics.update(
                {
                    "ratio_mean": _masked_mean(ratio, mask),
                    "ratio_max": float(ratio[valid].max()) if valid.any() else 1.0,
                    "ratio_min": float(ratio[valid].min()) if valid.any() else 1.0,
                    "kl_k1": _masked_mean(-log_r, mask),
                    "kl_k3": _masked_mean(torch.exp(log_r) - 1 - log_r, mask),
                }
            )
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


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float | None = 0.2
) -> torch.Tensor:
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old ± c) - R)^2)``, token mean."""
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * aggregate(err, mask, "token-mean")
