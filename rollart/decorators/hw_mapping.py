"""``@hw_mapping``: route a call by its ``tag_name`` to the hardware that suits it (RollArt paper §4.1, §5.1)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from rollart.decorators.specs import HW_MAPPING_ATTR, HwMappingSpec

F = TypeVar("F", bound=Callable[..., Any])


def hw_mapping(mapping: Mapping[str, Sequence[str]]) -> Callable[[F], F]:
    """Declare, per tag, an ordered hardware preference for a worker method.

    ``{"FrozenLake": ["H800", "H20"], "*": ["H20", "H800"]}``: a call with ``tag_name="FrozenLake"``
    goes to an H800 worker when one is alive, else to H20; every other tag prefers H20. Within one
    hardware type the least-loaded worker (fewest calls in flight) serves the call. The method must
    take a ``tag_name`` parameter. The decorator only attaches metadata.
    """
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError('hw_mapping needs a non-empty dict {tag: [hardware, ...]}, e.g. {"*": ["H20"]}')
    clean: dict[str, tuple[str, ...]] = {}
    for tag, prefs in mapping.items():
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"hw_mapping: tag {tag!r} must be a non-empty string")
        if isinstance(prefs, str) or not isinstance(prefs, Sequence) or not prefs:
            raise ValueError(
                f"hw_mapping[{tag!r}] must be a non-empty list of hardware types such as ['H800', 'H20'], got {prefs!r}"
            )
        if not all(isinstance(hw, str) and hw for hw in prefs):
            raise ValueError(f"hw_mapping[{tag!r}]: every hardware type must be a non-empty string")
        if len(set(prefs)) != len(prefs):
            raise ValueError(f"hw_mapping[{tag!r}] lists a hardware type twice: {list(prefs)}")
        clean[tag] = tuple(prefs)
    spec = HwMappingSpec(mapping=clean)

    def mark(fn: F) -> F:
        if "tag_name" not in inspect.signature(fn).parameters:
            raise TypeError(f"@hw_mapping method {fn.__qualname__} must take a 'tag_name' parameter (the routing hint)")
        setattr(fn, HW_MAPPING_ATTR, spec)
        return fn

    return mark
