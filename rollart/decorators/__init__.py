"""The three decorators of the declarative API. They only attach metadata (RollArt paper §5.1)."""

from rollart.decorators.hw_mapping import hw_mapping
from rollart.decorators.register import register
from rollart.decorators.register_serverless import register_serverless
from rollart.decorators.specs import (
    HW_MAPPING_ATTR,
    REGISTER_ATTR,
    SERVERLESS_ATTR,
    Dispatch,
    Execute,
    HwMappingSpec,
    RegisterSpec,
    ServerlessSpec,
)

__all__ = [
    "Dispatch",
    "Execute",
    "HW_MAPPING_ATTR",
    "HwMappingSpec",
    "REGISTER_ATTR",
    "RegisterSpec",
    "SERVERLESS_ATTR",
    "ServerlessSpec",
    "hw_mapping",
    "register",
    "register_serverless",
]
