"""Trajectory groups → a training ``Batch``, then advantages as a step over that batch (ROLL Flash §2.2,
SAO §3, RollArt paper §5.3).

:func:`trajectories_to_batch` builds the columns (names in ``rollart.training.columns``), one row per
trajectory: ``input_ids``, ``loss_mask``, ``behaviour_logprobs`` (the sampling engine's log-probs of the
action tokens, 0 elsewhere), ``versions``, ``rewards``, ``group_index``, ``tag``, ``traj_id``,
``prompt_key`` and, when an env reports dense credit, ``token_rewards``. :func:`add_advantages` then adds
``advantages`` (per token) with one estimator: ``grpo`` (group-normalised sequence reward broadcast over
the sequence), ``grpo_token`` (dense per-token credit), ``reinforce`` (leave-one-out), ``running_mean``
(a window of past rewards, :class:`rollart.algorithms.RunningMeanBaseline`) or ``gae`` (skip-observation
GAE under a critic's values, which also adds ``values`` and ``returns``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollart.algorithms import grpo_advantages, normalise_group
from rollart.algorithms.advantages import RunningMeanBaseline
from rollart.cluster.batch import Batch
from rollart.rollout.types import Trajectory
from rollart.training import columns as C

ADVANTAGE_METHODS = ("grpo", "grpo_token", "reinforce", "running_mean", "gae")


def token_group_advantages(groups: Sequence[Sequence[Trajectory]], eps: float = 1e-6) -> list[list[float]]:
    """Dense GRPO: the k-th action token of every member of a group is normalised against the k-th
    action tokens of the other members, ``A_ik = (c_ik - mean_i c_ik) / (std_i c_ik + eps)``, where
    ``c_ik`` is the token's credit (``Trajectory.token_rewards``). Per-token credit removes the noise
    of crediting every token with the whole sequence's reward. Computed in float64 per position; a
    position whose present members all have the same credit gets exact zeros."""
    out: list[list[float]] = []
    for group in groups:
        rows = [(t.traj_id, t.tag, len(t.token_ids), t.loss_mask, t.token_rewards) for t in group]
        out += _dense_group_advantages(rows, eps)
    return out


def _dense_group_advantages(
    rows: Sequence[tuple[str, str, int, Sequence[int], Sequence[float] | None]], eps: float = 1e-6
) -> list[list[float]]:
    """:func:`token_group_advantages` of one group, each member as ``(traj_id, tag, length, loss_mask,
    token_rewards)``."""
    positions = [[i for i, m in enumerate(mask) if m] for _, _, _, mask, _ in rows]
    width = max((len(p) for p in positions), default=0)
    credit: list[list[float]] = [[] for _ in rows]
    for r, ((tid, tag, _, _, token_rewards), pos) in enumerate(zip(rows, positions)):
        if token_rewards is None:
            raise ValueError(f"advantage=grpo_token needs token_rewards; trajectory {tid} ({tag}) has none")
        for i in pos:
            credit[r].append(float(token_rewards[i]) if i < len(token_rewards) else 0.0)
    adv = torch.zeros((len(rows), width), dtype=torch.float64)
    for k in range(width):
        present = [r for r in range(len(rows)) if k < len(positions[r])]
        column = torch.tensor([credit[r][k] for r in present], dtype=torch.float64)
        adv[present, k] = normalise_group(column, eps=eps)
    out = []
    for r, ((_, _, length, _, _), pos) in enumerate(zip(rows, positions)):
        row = [0.0] * length
        for k, i in enumerate(pos):
            row[i] = float(adv[r, k])
        out.append(row)
    return out


def prompt_key(token_ids: Sequence[int], loss_mask: Sequence[int]) -> str:
    """A digest of the tokens before the first action token (the first prompt): equal prompts, equal keys."""
    first = next((i for i, m in enumerate(loss_mask) if m), len(token_ids))
    return hashlib.sha1(",".join(str(int(x)) for x in token_ids[:first]).encode()).hexdigest()[:16]


def trajectories_to_batch(
    groups: Sequence[Sequence[Trajectory]], *, norm_std: bool = True, advantage: str | None = "grpo"
) -> Batch:
    """The training batch of ``groups`` (see the module docstring). With ``advantage`` set (``grpo``,
    ``grpo_token`` or ``reinforce``, the estimators that need nothing but the batch) the advantages are
    added by :func:`add_advantages`; ``advantage=None`` leaves them to a later :func:`add_advantages`."""
    trajs = [t for g in groups for t in g]
    if any(t.reward is None for t in trajs):
        raise ValueError(
            "a trajectory without a reward reached the trainer; failed rewards must be dropped or requeued"
        )
    columns = {
        C.INPUT_IDS: [list(t.token_ids) for t in trajs],
        C.LOSS_MASK: [list(t.loss_mask) for t in trajs],
        C.BEHAVIOUR_LOGPROBS: [list(t.logprobs) for t in trajs],
        C.VERSIONS: [list(t.versions) for t in trajs],
        C.REWARDS: torch.tensor([float(t.reward) for t in trajs], dtype=torch.float64),  # type: ignore[arg-type]
        C.GROUP_INDEX: torch.tensor([gi for gi, g in enumerate(groups) for _ in g]),
        C.TAG: [t.tag for t in trajs],
        C.TRAJ_ID: [t.traj_id for t in trajs],
        C.PROMPT_KEY: [prompt_key(t.token_ids, t.loss_mask) for t in trajs],
    }
    if any(t.token_rewards is not None for t in trajs):
        columns[C.TOKEN_REWARDS] = [None if t.token_rewards is None else list(t.token_rewards) for t in trajs]
    batch = Batch(columns, meta={"num_groups": len(groups)})
    if advantage is not None:
        if advantage in ("running_mean", "gae"):
            raise ValueError(
                f"trajectories_to_batch(advantage={advantage!r}): this estimator needs state "
                "(a baseline or the critic's values); build with advantage=None, then call "
                "add_advantages(batch, ...)"
            )
        add_advantages(batch, advantage, norm_std=norm_std)
    return batch


def _rows_of_groups(batch: Batch) -> list[list[int]]:
    index = [int(g) for g in batch[C.GROUP_INDEX].tolist()]
    rows: dict[int, list[int]] = {}
    for r, g in enumerate(index):
        rows.setdefault(g, []).append(r)
    return list(rows.values())


def _broadcast(batch: Batch, seq_adv: Sequence[float]) -> list[list[float]]:
    return [[float(a)] * len(ids) for a, ids in zip(seq_adv, batch[C.INPUT_IDS])]


def _grpo_token_advantages(batch: Batch, inputs: AdvantageInputs) -> list[list[float]]:
    """``grpo_token``: dense credit (``token_rewards``) normalised per action position within each group
    whose env gives it; sequence GRPO broadcast over the rows of the other groups."""
    seq_adv = grpo_advantages(batch[C.REWARDS], batch[C.GROUP_INDEX], norm_std=inputs.norm_std).tolist()
    credit = batch[C.TOKEN_REWARDS] if C.TOKEN_REWARDS in batch else [None] * len(batch)
    per_token: list[list[float]] = [[]] * len(batch)
    for rows in _rows_of_groups(batch):
        if all(credit[r] is not None for r in rows):
            members = [
                (batch[C.TRAJ_ID][r], batch[C.TAG][r], len(batch[C.INPUT_IDS][r]), batch[C.LOSS_MASK][r], credit[r])
                for r in rows
            ]
            for r, adv in zip(rows, _dense_group_advantages(members)):
                per_token[r] = adv
        else:
            for r in rows:
                per_token[r] = [seq_adv[r]] * len(batch[C.INPUT_IDS][r])
    return per_token


def _running_mean_advantages(batch: Batch, inputs: AdvantageInputs) -> list[list[float]]:
    """``running_mean``: ``r - b`` with ``b`` from the baseline kept across steps (its window is then
    updated with the batch's rewards), broadcast over the sequence."""
    if inputs.baseline is None:
        raise ValueError(
            "add_advantages(method='running_mean') needs a RunningMeanBaseline (baseline=...), kept across steps"
        )
    return _broadcast(batch, inputs.baseline.advantages(list(batch[C.PROMPT_KEY]), batch[C.REWARDS].tolist()))


def _gae(batch: Batch, inputs: AdvantageInputs) -> list[list[float]]:
    """``gae``: skip-observation GAE under the critic's values (also adds ``values`` and ``returns``)."""
    if inputs.values is None:
        raise ValueError("add_advantages(method='gae') needs the critic's values (values=...)")
    return gae_advantages(batch, inputs.values, **inputs.gae)[C.ADVANTAGES]


def _plugin_advantages(batch: Batch, method: str, params: Mapping[str, Any] | None) -> list[float]:
    """One advantage per row from a registered advantage or ``MODULE:FUNC``:
    ``fn(rewards, group_ids, **params)``."""
    from rollart.algorithms.advantages import resolve_advantage

    try:
        fn = resolve_advantage(method, "advantage")
    except ValueError as err:
        raise ValueError(f"advantage={method!r}: use one of {', '.join(ADVANTAGE_METHODS)}; {err}") from None
    seq = fn(batch[C.REWARDS].to(torch.float64), batch[C.GROUP_INDEX], **dict(params or {}))
    seq = seq.tolist() if isinstance(seq, torch.Tensor) else list(seq)
    if len(seq) != len(batch):
        raise ValueError(f"advantage {method!r} returned {len(seq)} values for {len(batch)} rows; return one per row")
    return seq


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator that needs more than the batch's rewards and groups is given."""

    norm_std: bool = True
    values: Sequence[Sequence[float]] | None = None  # gae: the critic's values, one row per batch row
    baseline: RunningMeanBaseline | None = None  # running_mean: kept across steps
    gae: Mapping[str, Any] = field(default_factory=dict)  # gae: gamma, lam, critic_lam, length_adaptive, ...


BATCH_ESTIMATORS: dict[str, Callable[[Batch, AdvantageInputs], list[list[float]]]] = {
    "grpo_token": _grpo_token_advantages,
    "running_mean": _running_mean_advantages,
    "gae": _gae,
}
"""The built-in estimators that need the batch itself (per-token credit, prompt keys, a baseline kept across
steps, the critic's values): ``fn(batch, inputs) -> advantages per token``. Every other name (``grpo``,
``reinforce``, a registered one, ``MODULE:FUNC``) is a sequence-level estimator of the advantage registry
(:func:`rollart.algorithms.register_advantage`)."""


def add_advantages(
    batch: Batch,
    method: str,
    *,
    norm_std: bool = True,
    values: Sequence[Sequence[float]] | None = None,
    baseline: RunningMeanBaseline | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    critic_lam: float | None = None,
    length_adaptive: bool = False,
    alpha: float = 0.05,
    whiten: bool = True,
    params: Mapping[str, Any] | None = None,
) -> Batch:
    """Add the ``advantages`` column to ``batch`` (in place; returned for chaining) with ``method``:

    * ``grpo``: ``(r - mean_g r) / (std_g r + eps)`` within each group (``norm_std=False`` only centres);
    * ``grpo_token``: dense credit (``token_rewards``) normalised per action position within each group
      whose env reports it, sequence GRPO for the other groups;
    * ``reinforce``: leave-one-out group baseline;
    * ``running_mean``: ``r - b`` with ``b`` from ``baseline`` (its window is then updated with the
      batch's rewards), broadcast over the sequence;
    * ``gae``: skip-observation GAE under the critic's ``values`` (see :func:`gae_advantages`);
    * any other name registered with :func:`rollart.algorithms.register_advantage`, or ``MODULE:FUNC``:
      ``fn(rewards, group_ids, **params)``, one advantage per row broadcast over the sequence.

    ``grpo_token``, ``running_mean`` and ``gae`` are :data:`BATCH_ESTIMATORS`; the others come from the
    advantage registry, where ``grpo`` and ``reinforce`` are registered as any estimator is."""
    estimator = BATCH_ESTIMATORS.get(method)
    if estimator is not None:
        gae = {"gamma": gamma, "lam": lam, "critic_lam": critic_lam, "length_adaptive": length_adaptive}
        inputs = AdvantageInputs(norm_std, values, baseline, {**gae, "alpha": alpha, "whiten": whiten})
        batch[C.ADVANTAGES] = estimator(batch, inputs)
        return batch
    if method == "grpo" and not params:
        params = {"norm_std": norm_std}
    batch[C.ADVANTAGES] = _broadcast(batch, _plugin_advantages(batch, method, params))
    return batch


def gae_advantages(
    batch: Batch,
    values: Sequence[Sequence[float]],
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    critic_lam: float | None = None,
    length_adaptive: bool = False,
    alpha: float = 0.05,
    whiten: bool = True,
) -> Batch:
    """Skip-observation GAE (SAO eq. 4–5) under the critic's ``values`` (one row per batch row, each
    as long as the row). The sequence reward sits on the last action token. Adds ``advantages`` with the
    policy's lambda (``lam``, or ``1 - 1/(alpha * l)`` per row of ``l`` action tokens with
    ``length_adaptive``), ``returns`` (the critic's regression targets ``A + V``) computed with
    ``critic_lam`` (None: the policy's lambda), and ``values``. Returns are taken before whitening;
    advantages are whitened over all action tokens of the batch; all three are 0 off the action tokens."""
    from rollart.algorithms import length_adaptive_lambda, skip_observation_gae
    from rollart.algorithms import whiten as whiten_fn

    n = len(batch)
    if len(values) != n:
        raise ValueError(f"gae_advantages: {len(values)} value rows for {n} trajectories")
    advs: list[torch.Tensor] = []
    rets: list[torch.Tensor] = []
    vals: list[list[float]] = []
    masks: list[torch.Tensor] = []
    for r in range(n):
        ids, mask_row, v = batch[C.INPUT_IDS][r], batch[C.LOSS_MASK][r], values[r]
        T = len(ids)
        if len(v) != T or len(mask_row) != T:
            tid = batch[C.TRAJ_ID][r] if C.TRAJ_ID in batch else r
            raise ValueError(
                f"gae_advantages: trajectory {tid} has {T} tokens, {len(mask_row)} mask entries and {len(v)} values"
            )
        mask = torch.tensor(list(mask_row), dtype=torch.float32)
        value = torch.tensor(list(v), dtype=torch.float32) * (mask > 0)
        rewards = torch.zeros(T)
        actions = torch.nonzero(mask > 0).flatten()
        if len(actions):
            rewards[actions[-1]] = float(batch[C.REWARDS][r])
        lam_t = lam
        if length_adaptive:
            lam_t = float(length_adaptive_lambda(torch.tensor([float(len(actions))]), alpha=alpha)[0])
        adv, ret = skip_observation_gae(rewards[None], value[None], mask[None], gamma, lam_t)
        if critic_lam is not None and critic_lam != lam_t:
            _, ret = skip_observation_gae(rewards[None], value[None], mask[None], gamma, critic_lam)
        advs.append(adv[0])
        rets.append(ret[0])
        vals.append(value.tolist())
        masks.append(mask)
    if whiten and advs:
        flat = whiten_fn(torch.cat(advs), torch.cat(masks))
        advs = list(torch.split(flat, [len(a) for a in advs]))
    batch[C.ADVANTAGES] = [a.tolist() for a in advs]
    batch[C.VALUES] = vals
    batch[C.RETURNS] = [r.tolist() for r in rets]
    return batch
