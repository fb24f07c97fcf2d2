"""Find the decorated methods of a worker class and check they make sense together."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollart.decorators.specs import (
    HW_MAPPING_ATTR,
    REGISTER_ATTR,
    SERVERLESS_ATTR,
    HwMappingSpec,
    RegisterSpec,
    ServerlessSpec,
)

log = logging.getLogger(__name__)

RESERVED_PARAMETERS = ("blocking",)


@dataclass(frozen=True)
class ExposedMethod:
    name: str
    fn: Callable[..., Any]
    is_async: bool
    register: RegisterSpec | None
    hw_mapping: HwMappingSpec | None
    serverless: ServerlessSpec | None


def exposed_methods(worker_cls: type) -> dict[str, ExposedMethod]:
    """Every method of ``worker_cls`` (and its bases) carrying rollart decorator metadata."""
    out: dict[str, ExposedMethod] = {}
    for name in dir(worker_cls):
        if name.startswith("__"):
            continue
        fn = inspect.getattr_static(worker_cls, name, None)
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        if not callable(fn):
            continue
        reg = getattr(fn, REGISTER_ATTR, None)
        hw = getattr(fn, HW_MAPPING_ATTR, None)
        srv = getattr(fn, SERVERLESS_ATTR, None)
        if reg is None and hw is None and srv is None:
            continue
        if srv is not None and (reg is not None or hw is not None):
            raise TypeError(
                f"{worker_cls.__name__}.{name}: @register_serverless cannot be combined with @register or "
                "@hw_mapping (a serverless method never runs on a worker)"
            )
        if reg is not None and hw is not None:
            raise TypeError(
                f"{worker_cls.__name__}.{name}: use either @register (dispatch to ranks) or @hw_mapping "
                "(route one call by tag_name), not both"
            )
        _warn_reserved(worker_cls, name, fn)
        out[name] = ExposedMethod(name, fn, inspect.iscoroutinefunction(fn), reg, hw, srv)
    return out


def _warn_reserved(worker_cls: type, name: str, fn: Callable[..., Any]) -> None:
    """A parameter named ``blocking`` never reaches the worker: the Cluster's proxy takes it."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    for reserved in RESERVED_PARAMETERS:
        if reserved in params:
            log.warning(
                "%s.%s has a parameter named %r: Cluster calls use that keyword themselves "
                "(blocking=False returns a future), so the worker never receives it; rename it",
                worker_cls.__name__,
                name,
                reserved,
            )
