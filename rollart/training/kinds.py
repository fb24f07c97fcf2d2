"""The training strategies a config can name (``train.strategy``), each with what it can do.

A strategy is a :class:`StrategyKind`: its name, the train worker class (``"module:Class"`` for the
built-ins, so that reading a config imports neither torch nor megatron-core) and its capabilities, which the
config checks before anything starts:

- ``features``: the ``train:`` settings it implements beyond plain data-parallel fp32 training, out of
  :data:`TRAIN_FEATURES`; a config that sets another one is refused naming it.
- ``colocates``: its ranks can hold an inference engine (colocated mode).
- ``replays``: ``rollart replay`` can train a recorded batch with it.
- ``requires``: a module it needs, and the extra that installs it.

Your own strategy is one module listed under ``plugins:`` whose train worker (a subclass of
:class:`rollart.training.torch_strategy.TorchTrainWorker`) is registered with :func:`register_strategy`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T", bound=type)

TRAIN_FEATURES = ("dtype", "gradient_checkpointing", "lora", "sharding", "tensor_parallel", "offload", "packing")
"""The ``train:`` settings a strategy may implement (each named by its field)."""


@dataclass(frozen=True)
class StrategyKind:
    """A training strategy: its name, its train worker (a class or ``"module:Class"``) and its capabilities."""

    name: str
    worker: str | type
    features: frozenset[str] = frozenset()
    """The ``train:`` settings of :data:`TRAIN_FEATURES` it implements."""
    colocates: bool = False
    """Its ranks can hold an inference engine (colocated mode)."""
    replays: bool = False
    """``rollart replay`` can train with it."""
    requires: tuple[str, str] | None = None
    """``(module, extra)``: a module it imports, and the pip extra that installs it."""

    def worker_class(self) -> type:
        """The train worker class (imported on first use for the built-ins)."""
        if isinstance(self.worker, type):
            return self.worker
        from rollart.plugins import import_object

        cls: type = import_object(self.worker, "train.strategy")
        return cls


STRATEGIES: dict[str, StrategyKind] = {
    "torch": StrategyKind(
        "torch",
        "rollart.training.torch_strategy:TorchTrainWorker",
        features=frozenset(TRAIN_FEATURES),
        colocates=True,
        replays=True,
    ),
    "megatron": StrategyKind(
        "megatron",
        "rollart.training.megatron_strategy:MegatronTrainWorker",
        requires=("megatron.core", "megatron"),
    ),
}
"""Every strategy by name: the built-ins, then those your plug-ins register."""


def register_strategy(
    name: str, *, features: Iterable[str] = (), colocates: bool = False, replays: bool = False
) -> Callable[[T], T]:
    """Class decorator: ``train.strategy: NAME`` trains with this train worker, which implements the
    ``train:`` ``features`` named (out of :data:`TRAIN_FEATURES`). Registering a name again replaces it."""
    feats = frozenset(features)
    unknown = sorted(feats - set(TRAIN_FEATURES))
    if unknown:
        raise ValueError(f"register_strategy({name!r}): unknown features {unknown}; known: {', '.join(TRAIN_FEATURES)}")

    def deco(cls: T) -> T:
        if name in STRATEGIES:
            log.warning("train.strategy %r registered again: %s replaces %s", name, cls, STRATEGIES[name].worker)
        STRATEGIES[name] = StrategyKind(name, cls, features=feats, colocates=colocates, replays=replays)
        return cls

    return deco


def strategy_kind(name: Any) -> StrategyKind | None:
    """The strategy registered as ``name``; None when there is none (``train.strategy`` reports it)."""
    return STRATEGIES.get(name) if isinstance(name, str) else None


def strategy_name_problem(name: str) -> str | None:
    """Why ``train.strategy: name`` names no strategy, or None."""
    if name in STRATEGIES:
        return None
    from rollart.plugins import closest_hint

    hint = closest_hint(name, STRATEGIES)
    return (
        f"unknown training strategy {name!r}; {hint}use one of {', '.join(STRATEGIES)}, or register yours with "
        "@register_strategy in a module listed under plugins:"
    )
