"""Cluster-wide registry of jobs, pools, worker bindings and endpoints, kept in Ray's GCS key-value store.

Why the GCS KV and not a detached registry actor: the GCS is already the one process every node and
every driver of the cluster talks to, its KV outlives drivers, needs no scheduling (a registry actor
takes a CPU slot on some node and dies with that node), and a driver on any host reads it with one
``ray.init(address=...)``. The driver's SQLite file (:mod:`rollart.resource_manager.store`) stays as
its local history; :class:`~rollart.resource_manager.store.MetadataStore` mirrors every write here
when it has a registry (the ResourceManager gives it one).

Layout: namespace ``rollart``, keys ``jobs/<job>``, ``pools/<job>/<pool>/<group>``,
``bindings/<job>/<cluster>/<rank>``, ``endpoints/<job>/<cluster>/<method>``; each value is the JSON of
the row (the same fields as the SQLite tables, plus ``node_ip`` for bindings and ``driver_ip`` for jobs).
The registry lives as long as the cluster's GCS: a restarted head starts empty.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

NAMESPACE = "rollart"
KINDS = ("jobs", "pools", "bindings", "endpoints")


def _kv() -> Any:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise RuntimeError("the cluster registry needs a connected Ray (ray.init / ensure_ray) first")
    return internal_kv


class ClusterRegistry:
    """Typed access to the registry of the Ray cluster this process is connected to."""

    def __init__(self, namespace: str = NAMESPACE):
        self.namespace = namespace
        _kv()

    # low level -----------------------------------------------------------------------------------
    def _put(self, key: str, row: dict[str, Any]) -> None:
        _kv()._internal_kv_put(key, json.dumps(row, default=str), overwrite=True, namespace=self.namespace)

    def _get(self, key: str) -> dict[str, Any] | None:
        raw = _kv()._internal_kv_get(key, namespace=self.namespace)
        return json.loads(raw) if raw else None

    def _rows(self, kind: str, job_id: str | None) -> list[dict[str, Any]]:
        kv = _kv()
        prefix = f"{kind}/{job_id}" if job_id is not None else f"{kind}/"
        keys = sorted(
            k.decode() if isinstance(k, bytes) else k for k in kv._internal_kv_list(prefix, namespace=self.namespace)
        )
        if job_id is not None:  # "jobs/a" must not match "jobs/ab"
            keys = [k for k in keys if k == prefix or k.startswith(prefix + "/")]
        rows = []
        for k in keys:
            row = self._get(k)
            if row is not None:
                rows.append(row)
        return rows

    # writes (the MetadataStore's signatures) --------------------------------------------------------
    def record_job(self, job_id: str, ray_address: str | None) -> None:
        from rollart.cluster.net import node_ip

        self._put(
            f"jobs/{job_id}",
            {
                "job_id": job_id,
                "ray_address": ray_address,
                "driver_pid": os.getpid(),
                "driver_ip": node_ip(),
                "started_at": time.time(),
                "ended_at": None,
            },
        )

    def end_job(self, job_id: str) -> None:
        now = time.time()
        job = self._get(f"jobs/{job_id}")
        if job is not None:
            self._put(f"jobs/{job_id}", {**job, "ended_at": now})
        for kind, state in (("pools", "released"), ("bindings", "stopped")):
            for row in self._rows(kind, job_id):
                self._put(self._key(kind, row), {**row, "state": state, "updated_at": now})

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
    ) -> None:
        row = {
            "job_id": job_id,
            "pool": pool,
            "group_index": group_index,
            "hardware": hardware,
            "devices": devices,
            "cpus": cpus,
            "placement_group": placement_group,
            "state": state,
            "updated_at": time.time(),
        }
        self._put(self._key("pools", row), row)

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
    ) -> None:
        row = {
            "job_id": job_id,
            "cluster": cluster,
            "rank": rank,
            "pool": pool,
            "hardware": hardware,
            "node_id": node_id,
            "node_ip": node_ip,
            "device_ids": list(device_ids),
            "actor_name": actor_name,
            "state": state,
            "updated_at": time.time(),
        }
        self._put(self._key("bindings", row), row)

    def set_binding_state(self, job_id: str, cluster: str, rank: int, state: str) -> None:
        key = f"bindings/{job_id}/{cluster}/{rank}"
        row = self._get(key)
        if row is not None:
            self._put(key, {**row, "state": state, "updated_at": time.time()})

    def record_endpoint(self, job_id: str, cluster: str, method: str, url: str, timeout_s: float, retries: int) -> None:
        row = {
            "job_id": job_id,
            "cluster": cluster,
            "method": method,
            "url": url,
            "timeout_s": timeout_s,
            "retries": retries,
            "updated_at": time.time(),
        }
        self._put(self._key("endpoints", row), row)

    @staticmethod
    def _key(kind: str, row: dict[str, Any]) -> str:
        tail = {"pools": ("pool", "group_index"), "bindings": ("cluster", "rank"), "endpoints": ("cluster", "method")}[
            kind
        ]
        return "/".join([kind, row["job_id"], *(str(row[f]) for f in tail)])

    # reads --------------------------------------------------------------------------------------------
    def jobs(self, job_id: str | None = None) -> list[dict[str, Any]]:
        return self._rows("jobs", job_id)

    def pools(self, job_id: str | None = None) -> list[dict[str, Any]]:
        return self._rows("pools", job_id)

    def bindings(self, job_id: str | None = None) -> list[dict[str, Any]]:
        return self._rows("bindings", job_id)

    def endpoints(self, job_id: str | None = None) -> list[dict[str, Any]]:
        return self._rows("endpoints", job_id)

    def snapshot(self, job_id: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """Every kind of row, as ``rollart status --json`` prints them."""
        return {kind: getattr(self, kind)(job_id) for kind in KINDS}
