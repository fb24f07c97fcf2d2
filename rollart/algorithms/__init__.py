"""Policy losses, loss aggregations and advantage estimators: pure functions over tensors (imports only
torch), each with a registry a user adds to by name (``register_loss``, ``register_loss_agg``,
``register_advantage``)."""

from rollart.algorithms.advantages import (
    RunningMeanBaseline,
    gae,
    grpo_advantages,
    length_adaptive_lambda,
    normalise_group,
    register_advantage,
    registered_advantages,
    reinforce_baseline_advantages,
    skip_observation_gae,
    whiten,
)
from rollart.algorithms.aggregation import (
    AGG_MODES,
    aggregate,
    aggregation_unit,
    register_loss_agg,
    registered_loss_aggs,
)
from rollart.algorithms.losses import (
    kl_penalty,
    loss_uses_proximal,
    policy_loss,
    register_loss,
    register_policy_loss,
    registered_losses,
    value_loss,
)

__all__ = [
    "AGG_MODES",
    "RunningMeanBaseline",
    "aggregate",
    "aggregation_unit",
    "gae",
    "grpo_advantages",
    "kl_penalty",
    "length_adaptive_lambda",
    "loss_uses_proximal",
    "normalise_group",
    "policy_loss",
    "register_advantage",
    "register_loss",
    "register_loss_agg",
    "register_policy_loss",
    "registered_advantages",
    "registered_loss_aggs",
    "registered_losses",
    "reinforce_baseline_advantages",
    "skip_observation_gae",
    "value_loss",
    "whiten",
]
