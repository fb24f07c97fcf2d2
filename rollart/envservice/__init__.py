"""Environments as services: the env session protocol (:mod:`.protocol`), its server (:mod:`.server`,
``rollart serve env``), its client (:mod:`.client`: :class:`RemoteEnv`, :class:`ServerPool`) and the
backends that start env servers (:mod:`.backends`: ``ray``; ``kubernetes``).

The names below load on first use, so mounting ``rollart serve env`` imports neither Ray nor httpx."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollart.envservice.client import EnvCallTimeout, EnvServiceClient, RemoteEnv, ServerPool, endpoint_url
    from rollart.envservice.protocol import (
        PROTOCOL_VERSION,
        EnvProtocolError,
        EnvServiceError,
        EnvServiceRequestError,
        EnvServiceUnavailable,
        EnvSessionLost,
    )

_WHERE = {
    "EnvCallTimeout": "client",
    "EnvServiceClient": "client",
    "RemoteEnv": "client",
    "ServerPool": "client",
    "endpoint_url": "client",
    "PROTOCOL_VERSION": "protocol",
    "EnvProtocolError": "protocol",
    "EnvServiceError": "protocol",
    "EnvServiceRequestError": "protocol",
    "EnvServiceUnavailable": "protocol",
    "EnvSessionLost": "protocol",
}

__all__ = [
    "EnvCallTimeout",
    "EnvProtocolError",
    "EnvServiceClient",
    "EnvServiceError",
    "EnvServiceRequestError",
    "EnvServiceUnavailable",
    "EnvSessionLost",
    "PROTOCOL_VERSION",
    "RemoteEnv",
    "ServerPool",
    "endpoint_url",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rollart.envservice' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rollart.envservice.{_WHERE[name]}"), name)
