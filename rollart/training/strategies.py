"""Which worker class trains the actor for ``train.strategy`` (``TrainConfig``): the registered
strategy's (:mod:`rollart.training.kinds`)."""

from __future__ import annotations

import sys

from rollart.training.kinds import strategy_kind, strategy_name_problem
from rollart.training.torch_strategy import TorchTrainWorker


def train_worker_class(strategy: str) -> type[TorchTrainWorker]:
    """``torch`` → ``TorchTrainWorker``; ``megatron`` → ``MegatronTrainWorker`` (imported only then, so
    megatron-core stays an optional extra); a registered strategy's worker. All expose the same methods
    and results."""
    kind = strategy_kind(strategy)
    if kind is None:
        raise ValueError(f"train.strategy: {strategy_name_problem(strategy)}")
    cls = kind.worker_class()
    if not (isinstance(cls, type) and issubclass(cls, TorchTrainWorker)):
        raise ValueError(f"train.strategy: {strategy}: {cls!r} is not a TorchTrainWorker subclass")
    if not cls.__module__.startswith("rollart."):
        # a plug-in's worker (a module next to the config): Ray ships it by value, as the train workers may
        # not find that module before their config tells them where it is
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[cls.__module__])
    return cls
