"""Errors a Cluster call can raise, each naming the cluster, rank and hardware involved."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """Base of the errors raised by a Cluster."""


class WorkerDiedError(ClusterError):
    """A worker actor is dead or unreachable; ``Cluster.restart_worker(rank)`` brings it back."""

    def __init__(
        self,
        cluster: str,
        rank: int,
        hardware: str,
        cause: BaseException | None = None,
        *,
        node_ip: str = "",
        ray_cluster: str = "",
    ):
        self.cluster, self.rank, self.hardware, self.cause = cluster, rank, hardware, cause
        self.node_ip, self.ray_cluster = node_ip, ray_cluster
        detail = f": {type(cause).__name__}" if cause is not None else ""
        where = ", ".join(
            x for x in (f"host {node_ip}" if node_ip else "", f"Ray cluster {ray_cluster}" if ray_cluster else "") if x
        )
        super().__init__(
            f"worker {cluster}[rank {rank}] on {hardware} died{f' ({where})' if where else ''}{detail}; "
            f"call {cluster}.restart_worker({rank}) to bring it back"
            + (f" once host {node_ip} is up" if node_ip else "")
        )


class NoLiveWorkerError(ClusterError):
    """No live worker of any hardware type a tag prefers is left to serve a routed call."""
