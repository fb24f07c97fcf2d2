"""Environments as services: the env session protocol (:mod:`.protocol`), its server (:mod:`.server`,
``rollart serve env``), its client (:mod:`.client`: :class:`RemoteEnv`, :class:`ServerPool`) and the
backends that start env servers (:mod:`.backends`: ``ray``; ``kubernetes``)."""

from rollart.envservice.client import EnvCallTimeout, EnvServiceClient, RemoteEnv, ServerPool, endpoint_url
from rollart.envservice.protocol import (
    PROTOCOL_VERSION,
    EnvProtocolError,
    EnvServiceError,
    EnvServiceRequestError,
    EnvServiceUnavailable,
    EnvSessionLost,
)

__all__ = [
    "PROTOCOL_VERSION",
    "EnvCallTimeout",
    "EnvProtocolError",
    "EnvServiceClient",
    "EnvServiceError",
    "EnvServiceRequestError",
    "EnvServiceUnavailable",
    "EnvSessionLost",
    "RemoteEnv",
    "ServerPool",
    "endpoint_url",
]
