"""Metadata the three decorators attach to worker methods (RollArt paper §5.1).

The decorators never wrap or change a method: they set one attribute on the function object, and the
:class:`~rollart.cluster.Cluster` reads it when it binds the worker class onto itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

REGISTER_ATTR = "__rollart_register__"
HW_MAPPING_ATTR = "__rollart_hw_mapping__"
SERVERLESS_ATTR = "__rollart_serverless__"

WILDCARD_TAG = "*"


class UnknownTagError(LookupError):
    """A ``tag_name`` that no ``@hw_mapping`` entry (nor ``"*"``) covers."""


class Dispatch(str, Enum):
    """How a Cluster call's arguments reach the ranks and how their results come back.

    - ``ONE_TO_ALL`` ("execute_all"): the same arguments go to every rank; a list of results, rank order.
    - ``ALL_TO_ALL``: every argument is a list of ``world_size`` items; rank ``i`` gets item ``i``.
    - ``DP_SPLIT``: every :class:`~rollart.Batch` argument is split into ``world_size`` contiguous
      chunks (sizes differ by at most one, no padding); other arguments are broadcast; results are
      concatenated in rank order.
    - ``RANK_ZERO``: only rank 0 runs; its result is returned as is.
    """

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_SPLIT = "dp_split"
    RANK_ZERO = "rank_zero"


class Execute(str, Enum):
    """Which ranks execute a dispatched call: every rank, or rank 0 alone."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


DispatchFn = Callable[[int, tuple, dict], Sequence[tuple[tuple, dict] | None]]
CollectFn = Callable[[list[Any]], Any]


@dataclass(frozen=True)
class RegisterSpec:
    """What ``@register`` attached: a dispatch mode, or a custom (dispatch_fn, collect_fn) pair."""

    dispatch: Dispatch | None
    execute: Execute
    dispatch_fn: DispatchFn | None = None
    collect_fn: CollectFn | None = None
    by_ref: bool = False  # the Cluster returns each rank's result as an ObjectRef the caller owns


@dataclass(frozen=True)
class HwMappingSpec:
    """Tag → ordered hardware preference. ``"*"`` covers every tag not named."""

    mapping: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def preference(self, tag_name: str) -> tuple[str, ...]:
        """The ordered hardware types for ``tag_name``; a clear error for an unknown tag."""
        if tag_name in self.mapping:
            return self.mapping[tag_name]
        if WILDCARD_TAG in self.mapping:
            return self.mapping[WILDCARD_TAG]
        known = ", ".join(sorted(self.mapping))
        raise UnknownTagError(
            f"tag_name {tag_name!r} has no hardware mapping (known tags: {known}); "
            f'add it to @hw_mapping or add a "*" entry for every other tag'
        )

    @property
    def hardware_types(self) -> set[str]:
        return {hw for prefs in self.mapping.values() for hw in prefs}


@dataclass(frozen=True)
class ServerlessSpec:
    """Where a ``@register_serverless`` method is served and how hard to try."""

    url: str
    timeout_s: float
    retries: int
    token_env: str | None
    backoff_base_s: float
    backoff_max_s: float
