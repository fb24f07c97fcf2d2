"""Resolve ``MODULE:FUNC`` (or ``name=MODULE:FUNC``) into named reward functions."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_functions(specs: list[str]) -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        name, _, target = spec.rpartition("=") if "=" in spec else ("", "", spec)
        if ":" not in target:
            raise ValueError(
                f"{spec!r}: give MODULE:FUNC (e.g. rollart.reward.builtin:math_answer) or name=MODULE:FUNC"
            )
        module, attr = target.split(":", 1)
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"{spec!r}: cannot load {target} ({err})") from None
        if not callable(fn):
            raise ValueError(f"{spec!r}: {target} is not callable")
        key = name or attr
        if key in out:
            raise ValueError(f"two reward functions are named {key!r}; rename one with name=MODULE:FUNC")
        out[key] = fn
    return out
