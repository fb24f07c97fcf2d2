"""Loss aggregation over tokens, sequences and groups (ROLL Flash §2.2), and the registry of
user-defined aggregations (``@register_loss_agg("name", unit=...)`` or ``train.loss_agg: MODULE:FUNC``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from rollart.plugins import LazyModule

if TYPE_CHECKING:
    import torch
else:  # imported at first use: a config is checked against these functions without torch
    torch = LazyModule("torch", globals())


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "group-mean")
AggFn = Callable[..., "torch.Tensor"]
Unit = Literal["token", "sequence"]
_AGGS: dict[str, tuple[AggFn, Unit]] = {}


def register_loss_agg(name: str, *, unit: Unit = "token") -> Callable[[AggFn], AggFn]:
    """Add an aggregation ``fn(loss, mask, group_ids=None) -> scalar`` for ``train.loss_agg: name``.
    ``unit`` is what the trainer weighs each micro-batch by when it sums them to the step's loss:
    ``token`` (its share of the step's action tokens; for token means) or ``sequence`` (its share of
    the rows; for per-sequence means)."""
    if unit not in ("token", "sequence"):
        raise ValueError(f"register_loss_agg({name!r}, unit={unit!r}): use 'token' or 'sequence'")

    def add(fn: AggFn) -> AggFn:
        if name in AGG_MODES:
            raise ValueError(f"register_loss_agg({name!r}): that is a built-in aggregation; pick another name")
        _AGGS[name] = (fn, unit)
        return fn

    return add


def registered_loss_aggs() -> list[str]:
    """The names ``train.loss_agg`` accepts besides ``MODULE:FUNC``."""
    return [*AGG_MODES, *sorted(_AGGS)]


def _resolve(mode: str, field: str) -> tuple[AggFn | None, Unit]:
    """``(None, unit)`` for a built-in mode, ``(fn, unit)`` for a registered or ``MODULE:FUNC`` one."""
    if mode in AGG_MODES:
        return None, "sequence" if mode.startswith("seq") else "token"
    from rollart.plugins import lookup

    known: dict[str, object] = {**dict.fromkeys(AGG_MODES), **_AGGS}
    found = lookup(mode, known, field, "loss aggregation")
    if isinstance(found, tuple):
        return found
    if not callable(found):
        raise ValueError(f"{field}: {mode!r} is {type(found).__name__}, not a function")
    for fn, unit in _AGGS.values():  # a registered function named by MODULE:FUNC keeps its unit
        if fn is found:
            return fn, unit
    return found, "token"


def aggregation_unit(mode: str) -> Unit:
    """``token`` or ``sequence``: what one micro-batch of ``mode`` is weighed by (see
    :func:`register_loss_agg`)."""
    return _resolve(mode, "train.loss_agg")[1]


def loss_agg_problems(mode: str) -> list[str]:
    """Why ``train.loss_agg: mode`` cannot be used (empty when it can); raises when it is unknown."""
    from rollart.plugins import signature_problems

    fn, _ = _resolve(mode, "train.loss_agg")
    if fn is None:
        return []
    bad = signature_problems(fn, {}, leading=(None, None), fixed={"group_ids": None})
    return [f"{mode!r} must take (loss, mask, group_ids=None): {bad[0]}"] if bad else []


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss over the tokens where ``mask`` is 1.

    - ``token-mean``: ``sum(loss * mask) / sum(mask)``
    - ``seq-mean-token-sum``: mean over sequences of ``sum_t loss * mask``
    - ``seq-mean-token-mean``: mean over sequences of the per-sequence token mean
    - ``group-mean``: mean over groups (``group_ids``) of each group's token mean
    """
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if mode == "group-mean":
        if group_ids is None:
            raise ValueError("aggregate(mode='group-mean') needs group_ids")
        groups = torch.unique(group_ids)
        per = [
            (loss[group_ids == g] * mask[group_ids == g]).sum() / mask[group_ids == g].sum().clamp(min=1.0)
            for g in groups
        ]
        return torch.stack(per).mean()
    fn, _ = _resolve(mode, "loss_agg")
    if fn is None:  # unreachable: every built-in mode is handled above
        raise ValueError(f"unknown aggregation {mode!r}; use one of {AGG_MODES}")
    return fn(loss, mask, group_ids=group_ids)
