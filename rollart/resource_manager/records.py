"""What a job's records offer, wherever they are kept: the driver's SQLite history
(:class:`~rollart.resource_manager.store.MetadataStore`) and the Ray cluster's registry that every host
reads (:class:`~rollart.resource_manager.registry.ClusterRegistry`) both implement :class:`JobRecords`;
the store mirrors every write into a registry of this type."""

from __future__ import annotations

from typing import Any, Protocol


class JobRecords(Protocol):
    """Jobs, pools, worker bindings and service endpoints, every row belonging to a job id."""

    def record_job(self, job_id: str, ray_address: str | None) -> None:
        """A job started (or a new driver of it) on the Ray cluster at ``ray_address``."""
        ...

    def update_job(self, job_id: str, **fields: Any) -> Any:
        """Set fields of a job's row (``name``, ``output_dir``)."""
        ...

    def end_job(self, job_id: str) -> None:
        """The job ended: its pools are released and its workers stopped."""
        ...

    def record_pool(
        self,
        job_id: str,
        pool: str,
        group_index: int,
        hardware: str,
        devices: int | None,
        cpus: float | None,
        placement_group: str,
        state: str = "reserved",
        max_devices: int | None = None,
    ) -> None:
        """One group of a pool, reserved as ``placement_group``: the ``devices`` it holds now and, for an
        elastic group, ``max_devices``."""
        ...

    def record_binding(
        self,
        job_id: str,
        cluster: str,
        rank: int,
        pool: str | None,
        hardware: str,
        node_id: str,
        device_ids: list[int],
        actor_name: str,
        state: str = "alive",
        node_ip: str = "",
        slot_ids: list[int] | None = None,
    ) -> None:
        """Rank ``rank`` of ``cluster`` runs as ``actor_name`` on ``node_id`` with ``device_ids`` (the GPUs its
        actor got) and ``slot_ids`` (the pool's device slots it holds)."""
        ...

    def set_binding_state(self, job_id: str, cluster: str, rank: int, state: str) -> None:
        """A worker's state changed (``running``, ``dead``, ``removed``, ``stopped``)."""
        ...

    def record_endpoint(self, job_id: str, cluster: str, method: str, url: str, timeout_s: float, retries: int) -> None:
        """A serverless method of ``cluster`` is served at ``url``."""
        ...

    def jobs(self, job_id: str | None = None) -> list[dict[str, Any]]: ...

    def pools(self, job_id: str | None = None) -> list[dict[str, Any]]: ...

    def bindings(self, job_id: str | None = None) -> list[dict[str, Any]]: ...

    def endpoints(self, job_id: str | None = None) -> list[dict[str, Any]]: ...
