"""Advantage estimators, pure functions over tensors (ROLL Flash §2.2, SAO §3 eq. 4–5), and the
registry of sequence-level estimators that ``advantage:`` names (``@register_advantage("name")`` or
``advantage: MODULE:FUNC``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from rollart.plugins import LazyModule

if TYPE_CHECKING:
    import torch
else:  # imported at first use: a config is checked against these functions without torch
    torch = LazyModule("torch", globals())


AdvantageFn = Callable[..., Any]
_ADVANTAGES: dict[str, AdvantageFn] = {}
# estimators the pipeline runs itself (they need per-token credit, a baseline kept across steps or a
# critic) and whose settings live in their own config sections, not in advantage_params
STATEFUL_ADVANTAGES = ("grpo_token", "running_mean", "gae")


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Add a sequence-level estimator ``fn(rewards, group_ids, **params) -> advantages`` for
    ``advantage: name``: ``rewards`` (float64) and ``group_ids`` are ``[B]`` tensors (one row per
    trajectory; rows of a group share an id), the result has one value per row (a tensor or a list),
    spread over the row's action tokens. ``params`` come from the config's ``advantage_params``."""

    def add(fn: AdvantageFn) -> AdvantageFn:
        if name in STATEFUL_ADVANTAGES:
            raise ValueError(f"register_advantage({name!r}): that is a built-in estimator; pick another name")
        _ADVANTAGES[name] = fn
        return fn

    return add


def registered_advantages() -> list[str]:
    """The names ``advantage:`` accepts besides ``MODULE:FUNC``."""
    return sorted({*_ADVANTAGES, *STATEFUL_ADVANTAGES})


def resolve_advantage(name: str, field: str = "advantage") -> AdvantageFn:
    """The estimator of a registered ``name`` or ``MODULE:FUNC`` spec (not the stateful built-ins);
    raises ``ValueError`` naming ``field``."""
    from rollart.plugins import lookup

    fn = lookup(name, {**dict.fromkeys(STATEFUL_ADVANTAGES), **_ADVANTAGES}, field, "advantage estimator")
    if fn is None:
        raise ValueError(f"{field}: {name!r} is computed by the pipeline itself, not by a registered function")
    if not callable(fn):
        raise ValueError(f"{field}: {name!r} is {type(fn).__name__}, not a function")
    return fn


def advantage_contract_problems(name: str) -> list[str]:
    """Why ``advantage: name`` cannot be called as ``fn(rewards, group_ids, **params)`` (empty when it
    can, and for the stateful built-ins); raises ``ValueError`` for an unknown name."""
    from rollart.plugins import signature_problems

    if name in STATEFUL_ADVANTAGES:
        return []
    bad = signature_problems(resolve_advantage(name), {}, leading=(None, None))
    return [f"{name!r} must take (rewards, group_ids, **params): {p}" for p in bad]


def advantage_params_problems(name: str, params: dict[str, Any]) -> list[str]:
    """What is wrong with ``advantage_params: params`` for ``advantage: name`` (empty when fine)."""
    from rollart.plugins import signature_problems

    if name in STATEFUL_ADVANTAGES:
        section = {"running_mean": "running_mean:", "gae": "critic:"}.get(name, "nothing: it has none")
        return (
            [f"advantage {name} takes no advantage_params (its settings go in {section}); remove them"]
            if params
            else []
        )
    return signature_problems(resolve_advantage(name), params, leading=(None, None))


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


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, norm_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the members of ``i``'s group, computed and
    returned in float64 (see :func:`normalise_group`); a group whose rewards are all equal gets exact
    zeros (never NaN). ``norm_std=False`` only centres."""
    rewards = rewards.to(torch.float64)
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        out[idx] = normalise_group(rewards[idx], norm_std=norm_std, eps=eps)
    return out


register_advantage("grpo")(grpo_advantages)


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


register_advantage("reinforce")(reinforce_baseline_advantages)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over valid tokens: ``delta_t = r_t + gamma V_{t+1} - V_t``,
    ``A_t = delta_t + gamma lam A_{t+1}``; returns ``(advantages, returns = A + V)``."""
    return skip_observation_gae(rewards, values, torch.ones_like(mask) * mask, gamma, lam)


def skip_observation_gae(
    rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation token GAE (SAO eq. 4–5): the recursion runs over action tokens only
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
            acc[idx[k]] = rewards[b, idx[k] : end].sum()
        for k in reversed(range(len(idx))):
            t = idx[k]
            delta = float(acc[t]) + gamma * next_value - float(values[b, t])
            carry = delta + gamma * lam * carry
            adv[b, t] = carry
            next_value = float(values[b, t])
    return adv, adv + values.to(torch.float32) * (loss_mask > 0)


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """Length-adaptive GAE lambda ``lam = 1 - 1 / (alpha * l)`` (clamped to [0, 1]): longer sequences
    use a lambda closer to 1 so the bias of bootstrapping does not grow with length. ``alpha = 0.05`` is
    VAPO's value; SAO (§4) uses ``alpha = 1.5`` for the policy (``CriticConfig(preset="sao")``)."""
    return (1.0 - 1.0 / (alpha * lengths.to(torch.float32)).clamp(min=1e-6)).clamp(0.0, 1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries (unmasked entries are returned as 0)."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) / torch.sqrt(var + eps) * m


class RunningMeanBaseline:
    """The critic-free single-rollout baseline SAO compares against (SAO §4 "single-rollout with
    Running-mean baseline", §5 "Running Mean Advantage Estimation"): ``A = r - b`` with ``b`` the mean
    of a sliding window of the most recent rewards, kept per prompt (``scope="prompt"``, the §4 ablation:
    a window of 8) or over all prompts (``scope="global"``, the §5 online setting: a window of 128).

    Each call of :meth:`advantages` scores a batch against the windows as they were *before* it (so a
    sample never baselines itself, and members of one batch sharing a prompt share its baseline), then
    appends the batch's rewards in order, the oldest falling out of a full window. A prompt with no
    history yet has no baseline (``b = 0``: plain REINFORCE for that sample). ``scope="prompt"`` pays off
    only when prompts recur (a dataset seen several times); for envs that draw a fresh prompt per
    episode use ``scope="global"``."""

    def __init__(self, window: int = 8, scope: Literal["prompt", "global"] = "prompt"):
        if window < 1:
            raise ValueError(f"RunningMeanBaseline(window={window}): the window needs at least 1 reward")
        if scope not in ("prompt", "global"):
            raise ValueError(f"RunningMeanBaseline(scope={scope!r}): use 'prompt' or 'global'")
        self.window = window
        self.scope = scope
        self._windows: dict[str, deque[float]] = {}

    def _key(self, key: str) -> str:
        return key if self.scope == "prompt" else "*"

    def baseline(self, key: str) -> float:
        """The mean of ``key``'s window (0 for a key with no history)."""
        w = self._windows.get(self._key(key))
        return sum(w) / len(w) if w else 0.0

    def advantages(self, keys: Sequence[str], rewards: Sequence[float]) -> list[float]:
        """``r_i - b(key_i)`` for the batch, then the batch's rewards join the windows."""
        if len(keys) != len(rewards):
            raise ValueError(f"RunningMeanBaseline: {len(keys)} keys for {len(rewards)} rewards")
        out = [float(r) - self.baseline(k) for k, r in zip(keys, rewards)]
        for k, r in zip(keys, rewards):
            self._windows.setdefault(self._key(k), deque(maxlen=self.window)).append(float(r))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain lists and strings (loadable by ``torch.load(weights_only=True)``)."""
        return {"window": self.window, "scope": self.scope, "windows": {k: list(w) for k, w in self._windows.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scope", self.scope) != self.scope:
            raise ValueError(
                f"RunningMeanBaseline: the checkpoint's scope is {state['scope']!r}, the config's "
                f"{self.scope!r}; resume with the same running_mean.scope"
            )
        self._windows = {k: deque((float(x) for x in w), maxlen=self.window) for k, w in state["windows"].items()}
