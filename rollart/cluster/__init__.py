"""Worker base, the Cluster invocation proxy, dispatch/collect modes, tag routing, serverless calls."""

from rollart.cluster.batch import Batch
from rollart.cluster.cluster import Cluster, start_together
from rollart.cluster.errors import ClusterError, NoLiveWorkerError, WorkerDiedError
from rollart.cluster.future import ClusterFuture
from rollart.cluster.worker import Worker, WorkerContext

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
