"""The names of the training batch's columns, declared once (every producer and consumer imports them).

Three kinds of log-probabilities flow through training, each under its own name:

* **behaviour** (``BEHAVIOUR_LOGPROBS``, a batch column): ``log mu``, what the inference engine that
  sampled the tokens reported (``Trajectory.logprobs``). Built by ``rollart.training.data``.
* **proximal** (``PROXIMAL_LOGPROBS``, a micro-batch tensor inside the trainer): ``log pi_old``, the
  trainer's own policy before this update, recomputed by the strategy only when the loss needs it.
* **current** (the loss's ``logprobs`` argument): ``log pi_theta`` with gradient.

``REF_LOGPROBS`` is the frozen reference policy's (KL term); ``VALUES`` / ``RETURNS`` the critic's scores
and regression targets. Rows are trajectories; per-token columns are lists aligned with ``INPUT_IDS``.
"""

from __future__ import annotations

from typing import Any

# per-token columns (one list per row, aligned with input_ids)
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
BEHAVIOUR_LOGPROBS = "behaviour_logprobs"
VERSIONS = "versions"
ADVANTAGES = "advantages"
TOKEN_REWARDS = "token_rewards"  # dense per-token credit, or None for a row whose env gives none
REF_LOGPROBS = "ref_logprobs"
VALUES = "values"
RETURNS = "returns"

# per-row columns
REWARDS = "rewards"
GROUP_INDEX = "group_index"
TAG = "tag"
TRAJ_ID = "traj_id"
PROMPT_KEY = "prompt_key"  # a digest of the first prompt's token ids (running-mean baseline)

# tensors the trainer derives inside a micro-batch (never batch columns)
ATTENTION_MASK = "attention_mask"
PROXIMAL_LOGPROBS = "proximal_logprobs"


def require(batch: Any, *names: str, who: str) -> None:
    """Raise a ``KeyError`` naming every missing column of ``batch`` and who needed it."""
    missing = [n for n in names if n not in batch]
    if missing:
        have = sorted(batch.keys()) if hasattr(batch, "keys") else []
        raise KeyError(f"{who} needs batch columns {missing} (rollart.training.columns); the batch has {have}")
