"""The weight channels a config can name (``weights.channel``), each with what it can do.

A channel is a :class:`WeightChannelKind`: its name, the pipeline part that moves the weights (a
:class:`rollart.pipeline.weight_sync.WeightSync` subclass, named ``"module:Class"`` for the built-ins so that
reading a config imports no channel) and its capabilities, which the config checks before anything starts:

- ``serves_joiners``: a worker that starts after the run did (a restarted one, or one joining an elastic
  pool) can load the version being served. ``dist`` broadcasts to a fixed group and ``inprocess`` keeps the
  weights inside each train rank, so neither can.
- ``colocated``: the channel moves the weights inside the ranks of colocated mode (and only there); every
  other channel needs a rollout pool of its own.

Your own channel is one module listed under ``plugins:``, whose ``WeightSync`` subclass is registered with
:func:`register_weight_channel`; ``weights.channel`` then takes its name. This module imports nothing heavy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class WeightChannelKind:
    """A weight channel: its name, its ``WeightSync`` (a class or ``"module:Class"``) and its capabilities."""

    name: str
    sync: str | type
    serves_joiners: bool = True
    """A worker started later (restarted, or joining an elastic pool) loads the served version."""
    colocated: bool = False
    """The channel moves the weights inside a colocated rank: it runs in colocated mode and only there."""
    summary: str = ""

    def sync_class(self) -> type:
        """The ``WeightSync`` class (imported on first use for the built-ins)."""
        if isinstance(self.sync, type):
            return self.sync
        from rollart.plugins import import_object

        cls: type = import_object(self.sync, "weights.channel")
        return cls


WEIGHT_CHANNELS: dict[str, WeightChannelKind] = {}
"""Every channel by name: the built-ins, then those your plug-ins register."""


def _builtin(name: str, cls: str, summary: str, **caps: bool) -> None:
    WEIGHT_CHANNELS[name] = WeightChannelKind(name, f"rollart.pipeline.weight_sync:{cls}", summary=summary, **caps)


_builtin("ray", "RaySync", "the Ray object store")
_builtin("mooncake", "MooncakeSync", "a Mooncake store, in the background")
_builtin("dist", "DistSync", "a torch.distributed broadcast", serves_joiners=False)
_builtin("inprocess", "InProcessSync", "inside each colocated rank", serves_joiners=False, colocated=True)
_builtin("none", "NoSync", "no transfer (benchmarks only)")


def register_weight_channel(name: str, *, serves_joiners: bool = True, colocated: bool = False) -> Callable[[T], T]:
    """Class decorator: ``weights.channel: NAME`` builds this ``WeightSync`` subclass (``cls.build(config,
    train, infer, name=..., out_dir=...)``), with the capabilities given here. Registering a name again
    replaces it (logged)."""

    def deco(cls: T) -> T:
        if name in WEIGHT_CHANNELS:
            log.warning("weights.channel %r registered again: %s replaces %s", name, cls, WEIGHT_CHANNELS[name].sync)
        WEIGHT_CHANNELS[name] = WeightChannelKind(
            name, cls, serves_joiners=serves_joiners, colocated=colocated, summary=(cls.__doc__ or "").strip()
        )
        return cls

    return deco


def channel_kind(name: Any) -> WeightChannelKind | None:
    """The kind registered as ``name``; None when there is none (the config's field reports it)."""
    return WEIGHT_CHANNELS.get(name) if isinstance(name, str) else None


def channel_name_problem(name: str) -> str | None:
    """Why ``weights.channel: name`` names no channel (with the registered names), or None."""
    if name in WEIGHT_CHANNELS:
        return None
    from rollart.plugins import closest_hint

    hint = closest_hint(name, WEIGHT_CHANNELS)
    return (
        f"unknown weight channel {name!r}; {hint}use one of {', '.join(WEIGHT_CHANNELS)}, or register yours with "
        "@register_weight_channel in a module listed under plugins:"
    )
