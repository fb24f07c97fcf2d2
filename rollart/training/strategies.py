"""Which worker class trains the actor for ``train.strategy`` (``TrainConfig``)."""

from __future__ import annotations

from typing import Literal

from rollart.training.torch_strategy import TorchTrainWorker


def train_worker_class(strategy: Literal["torch", "megatron"]) -> type[TorchTrainWorker]:
    """``torch`` → ``TorchTrainWorker``; ``megatron`` → ``MegatronTrainWorker`` (imported only then, so
    megatron-core stays an optional extra). Both expose the same methods and results."""
    if strategy == "torch":
        return TorchTrainWorker
    if strategy == "megatron":
        from rollart.training.megatron_strategy import MegatronTrainWorker

        return MegatronTrainWorker
    raise ValueError(f"train.strategy={strategy!r}: use 'torch' or 'megatron'")
