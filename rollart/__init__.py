"""rollart: RL post-training of LLM agents on heterogeneous, disaggregated clusters.

The public API (DESIGN.md, "The public API"): three decorators, ``Worker``, ``Cluster``,
``ResourceManager``, ``Batch`` and the dispatch modes. Everything else lives in subpackages.
"""

from rollart.cluster import Batch, Cluster, ClusterFuture, Worker, WorkerDiedError
from rollart.decorators import Dispatch, Execute, hw_mapping, register, register_serverless
from rollart.engines.base import SamplingParams
from rollart.resource_manager import ResourceManager, ResourceSpecError
from rollart.rollout.types import GenerateOutput, GenerateRequest, Trajectory

__version__ = "0.1.0"

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
