"""Policy losses and advantage estimators: pure functions over tensors (imports only torch)."""

from rollart.algorithms.advantages import (
    RunningMeanBaseline,
    gae,
    grpo_advantages,
    length_adaptive_lambda,
    normalise_group,
    reinforce_baseline_advantages,
    skip_observation_gae,
    whiten,
)
from rollart.algorithms.aggregation import AGG_MODES, aggregate
from rollart.algorithms.losses import (
    kl_penalty,
    loss_uses_proximal,
    policy_loss,
    register_policy_loss,
    value_loss,
)

__all__ = [
    "AGG_MODES",
    "RunningMeanBaseline",
    "aggregate",
    "gae",
    "grpo_advantages",
    "kl_penalty",
    "length_adaptive_lambda",
    "loss_uses_proximal",
    "normalise_group",
    "policy_loss",
    "register_policy_loss",
    "reinforce_baseline_advantages",
    "skip_observation_gae",
    "value_loss",
    "whiten",
]
