"""Cluster-wide registry of jobs, pools, worker bindings and endpoints, kept in Ray's GCS key-value store.

Why the GCS KV and not a detached registry actor: the GCS is already the one process every node and
every driver of the cluster talks to, its KV outlives drivers, needs no scheduling (a registry actor
takes a CPU slot on some node and dies with that node), and a driver on any host reads it with one
``ray.init(address=...)``. The driver's SQLite file (:mod:`rollart.resource_manager.store`) stays as
its local history; :class:`~rollart.resource_manager.store.MetadataStore` mirrors every write here
when it has a registry (the ResourceManager gives it one).

Layout: namespace ``rollart``, keys ``jobs/<job>`` (with the admission fields ``state``
queued/running/finished/failed/stopped, ``asks``, ``quota``, ``priority``, ``submitted_at``: see
:mod:`rollart.resource_manager.admission`), ``locks/<name>``, ``pools/<job>/<pool>/<group>``,
``bindings/<job>/<cluster>/<rank>``, ``endpoints/<job>/<cluster>/<method>``; each value is the JSON of
the row (the same fields as the SQLite tables, plus ``node_ip`` for bindings and ``driver_ip`` for jobs).
``scale/<job>/<pool>`` holds the last ``rollart scale`` request of an elastic pool (``devices``, ``at``),
which the job's driver reads; its job row's ``elastic`` field says how far each elastic pool got.
The registry lives as long as the cluster's GCS: a restarted head starts empty.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from rollart.resource_manager.records import JobRecords

log = logging.getLogger(__name__)

NAMESPACE = "rollart"
KINDS = ("jobs", "pools", "bindings", "endpoints")


def _kv() -> Any:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise RuntimeError("the cluster registry needs a connected Ray (ray.init / ensure_ray) first")
    return internal_kv


def _ray_job_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else None


class ClusterRegistry(JobRecords):
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
        from rollart.resource_manager.net import node_ip

        old = self._get(f"jobs/{job_id}") or {}  # an admitted job keeps its queue fields
        self._put(
            f"jobs/{job_id}",
            {
                **old,
                "state": old.get("state", "running"),
                "job_id": job_id,
                "ray_address": ray_address,
                "ray_job_id": _ray_job_id(),
                "driver_pid": os.getpid(),
                "driver_ip": node_ip(),
                "started_at": time.time(),
                "ended_at": None,
            },
        )

    def end_job(self, job_id: str, state: str = "finished") -> None:
        now = time.time()
        job = self._get(f"jobs/{job_id}")
        if job is not None:
            # a job already marked ended (its driver found dead) keeps the time it was found so
            self._put(f"jobs/{job_id}", {**job, "ended_at": job.get("ended_at") or now, "state": state})
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
        max_devices: int | None = None,
    ) -> None:
        row = {
            "job_id": job_id,
            "pool": pool,
            "group_index": group_index,
            "hardware": hardware,
            "devices": devices,
            "cpus": cpus,
            "placement_group": placement_group,
            "max_devices": max_devices,
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
        slot_ids: list[int] | None = None,
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
            "slot_ids": list(slot_ids or []),
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

    def update_job(self, job_id: str, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` into the job's row (created when missing); return the new row."""
        row = {**(self._get(f"jobs/{job_id}") or {"job_id": job_id}), **fields}
        self._put(f"jobs/{job_id}", row)
        return row

    def try_lock(self, name: str, holder: str, stale_after_s: float = 30.0) -> bool:
        """Take the cluster-wide lock ``name`` (a GCS KV key written only if absent: one writer wins);
        a lock older than ``stale_after_s`` (its holder died inside) is broken first."""
        kv, key = _kv(), f"locks/{name}"
        value = json.dumps({"holder": holder, "at": time.time()})
        if not kv._internal_kv_put(key, value, overwrite=False, namespace=self.namespace):
            return True
        held = self._get(key)
        if held is not None and time.time() - float(held.get("at", 0)) > stale_after_s:
            log.warning("breaking the stale registry lock %s of %s", name, held.get("holder"))
            kv._internal_kv_del(key, namespace=self.namespace)
        return False

    def unlock(self, name: str, holder: str) -> None:
        key = f"locks/{name}"
        held = self._get(key)
        if held is not None and held.get("holder") == holder:
            _kv()._internal_kv_del(key, namespace=self.namespace)

    def request_scale(self, job_id: str, pool: str, devices: int | None) -> dict[str, Any]:
        """Ask job ``job_id``'s elastic ``pool`` to hold ``devices`` devices, or (None) to let its autopilot
        decide again (its driver applies it)."""
        row = {"job_id": job_id, "pool": pool, "devices": None if devices is None else int(devices), "at": time.time()}
        self._put(f"scale/{job_id}/{pool}", row)
        return row

    def scale_request(self, job_id: str, pool: str) -> dict[str, Any] | None:
        """The last ``rollart scale`` request of ``pool`` of ``job_id``, or None."""
        return self._get(f"scale/{job_id}/{pool}")

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
