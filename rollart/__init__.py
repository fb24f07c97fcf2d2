"""rollart: RL post-training of LLM agents on heterogeneous, disaggregated clusters.

The public API: three decorators, ``Worker``, ``Cluster``,
``ResourceManager``, ``Batch`` and the dispatch modes. Everything else lives in subpackages.

The names are imported on first use (module ``__getattr__``), so ``import rollart`` — and
``rollart --version`` — load neither torch nor Ray; type checkers see the real imports below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from rollart.cluster import Batch, Cluster, ClusterFuture, Worker, WorkerDiedError
    from rollart.decorators import (
        Dispatch,
        Execute,
        hw_mapping,
        register,
        register_serverless,
    )
    from rollart.engines.base import SamplingParams
    from rollart.resource_manager import ResourceManager, ResourceSpecError
    from rollart.rollout.types import GenerateOutput, GenerateRequest, Trajectory

_LAZY: dict[str, str] = {
    "Batch": "rollart.cluster",
    "Cluster": "rollart.cluster",
    "ClusterFuture": "rollart.cluster",
    "Worker": "rollart.cluster",
    "WorkerDiedError": "rollart.cluster",
    "Dispatch": "rollart.decorators",
    "Execute": "rollart.decorators",
    "hw_mapping": "rollart.decorators",
    "register": "rollart.decorators",
    "register_serverless": "rollart.decorators",
    "SamplingParams": "rollart.engines.base",
    "ResourceManager": "rollart.resource_manager",
    "ResourceSpecError": "rollart.resource_manager",
    "GenerateOutput": "rollart.rollout.types",
    "GenerateRequest": "rollart.rollout.types",
    "Trajectory": "rollart.rollout.types",
}

__all__ = [
    "Batch",
    "Cluster",
    "ClusterFuture",
    "Dispatch",
    "Execute",
    "GenerateOutput",
    "GenerateRequest",
    "ResourceManager",
    "ResourceSpecError",
    "SamplingParams",
    "Trajectory",
    "Worker",
    "WorkerDiedError",
    "__version__",
    "hw_mapping",
    "register",
    "register_serverless",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rollart' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
