"""Worker base, the Cluster invocation proxy, dispatch/collect modes, tag routing, serverless calls.

The names are imported on first use (module ``__getattr__``): the config models in
``rollart.cluster.config`` load without torch or Ray, so ``rollart run`` checks a config, and starts
Ray, before torch has imported."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollart.cluster.batch import Batch
    from rollart.cluster.cluster import Cluster, start_together
    from rollart.cluster.errors import ClusterError, NoLiveWorkerError, WorkerDiedError
    from rollart.cluster.future import ClusterFuture
    from rollart.cluster.worker import Worker, WorkerContext

_LAZY: dict[str, str] = {
    "Batch": "rollart.cluster.batch",
    "Cluster": "rollart.cluster.cluster",
    "start_together": "rollart.cluster.cluster",
    "ClusterError": "rollart.cluster.errors",
    "NoLiveWorkerError": "rollart.cluster.errors",
    "WorkerDiedError": "rollart.cluster.errors",
    "ClusterFuture": "rollart.cluster.future",
    "Worker": "rollart.cluster.worker",
    "WorkerContext": "rollart.cluster.worker",
}

__all__ = [
    "Batch",
    "Cluster",
    "ClusterError",
    "ClusterFuture",
    "NoLiveWorkerError",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "start_together",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rollart.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
