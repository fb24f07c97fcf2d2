"""Persistent metadata store (SQLite) of jobs, pools, worker bindings and service endpoints (RollArt paper §6).

Several jobs and drivers share one file; every row belongs to a job id (the Ray namespace). A
restarted driver and ``rollart status`` read the same state back. WAL mode and a busy timeout let
concurrent drivers write safely.

The file is the driver's local history: other hosts never see it. With a ``registry``
(:class:`~rollart.resource_manager.registry.ClusterRegistry`, given by the ResourceManager once Ray is
up) every write is mirrored into the Ray cluster's registry, which every host and driver reads.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollart.resource_manager.records import JobRecords

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, ray_address TEXT, driver_pid INTEGER, started_at REAL, ended_at REAL
);
CREATE TABLE IF NOT EXISTS pools (
  job_id TEXT, pool TEXT, group_index INTEGER, hardware TEXT, devices INTEGER, cpus REAL,
  placement_group TEXT, state TEXT, updated_at REAL,
  PRIMARY KEY (job_id, pool, group_index)
);
CREATE TABLE IF NOT EXISTS bindings (
  job_id TEXT, cluster TEXT, rank INTEGER, pool TEXT, hardware TEXT, node_id TEXT, device_ids TEXT,
  actor_name TEXT, state TEXT, updated_at REAL, slot_ids TEXT,
  PRIMARY KEY (job_id, cluster, rank)
);
CREATE TABLE IF NOT EXISTS runs (
  job_id TEXT, attempt INTEGER, driver_pid INTEGER, started_at REAL, ended_at REAL, status TEXT, cause TEXT,
  PRIMARY KEY (job_id, attempt)
);
CREATE TABLE IF NOT EXISTS endpoints (
  job_id TEXT, cluster TEXT, method TEXT, url TEXT, timeout_s REAL, retries INTEGER, updated_at REAL,
  PRIMARY KEY (job_id, cluster, method)
);
"""


JOB_FIELDS = ("name", "output_dir")
"""What a job's row records besides its start and end: the config's name and the run folder."""


def default_store_path() -> Path:
    """``$ROLLART_METADATA_DB``, else ``~/.rollart/metadata.sqlite``."""
    env = os.environ.get("ROLLART_METADATA_DB")
    return Path(env) if env else Path.home() / ".rollart" / "metadata.sqlite"


class MetadataStore(JobRecords):
    """Thin, typed access to the SQLite file. Every method opens its own short transaction."""

    def __init__(self, path: str | os.PathLike[str] | None = None, registry: JobRecords | None = None):
        self.path = Path(path) if path is not None else default_store_path()
        self.registry = registry  # a ClusterRegistry mirror, or None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._conn() as db:
            db.executescript(_SCHEMA)
            columns = {r["name"] for r in db.execute("PRAGMA table_info(bindings)")}
            if "slot_ids" not in columns:  # a file written before bindings had slot ids
                db.execute("ALTER TABLE bindings ADD COLUMN slot_ids TEXT")
            if "max_devices" not in {r["name"] for r in db.execute("PRAGMA table_info(pools)")}:
                db.execute("ALTER TABLE pools ADD COLUMN max_devices INTEGER")  # a file from before elastic pools
            job_columns = {r["name"] for r in db.execute("PRAGMA table_info(jobs)")}
            for column in JOB_FIELDS:  # a file from before jobs had a name and a folder
                if column not in job_columns:
                    db.execute(f"ALTER TABLE jobs ADD COLUMN {column} TEXT")

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0)
        db.row_factory = sqlite3.Row
        try:
            db.execute("PRAGMA journal_mode=WAL")
            yield db
            db.commit()
        finally:
            db.close()

    def _mirror(self, what: str, write: Callable[[JobRecords], None]) -> None:
        """Repeat a write (``what``) in the cluster registry; a failure there is logged (the local row is
        kept)."""
        if self.registry is None:
            return
        try:
            write(self.registry)
        except Exception as err:
            log.warning("cluster registry: %s failed (%s); other hosts will not see this change", what, err)

    # writes ---------------------------------------------------------------------------------------
    def record_job(self, job_id: str, ray_address: str | None) -> None:
        with self._conn() as db:
            db.execute(
                "INSERT INTO jobs(job_id, ray_address, driver_pid, started_at, ended_at) VALUES (?,?,?,?,NULL) "
                "ON CONFLICT(job_id) DO UPDATE SET ray_address=excluded.ray_address, "
                "driver_pid=excluded.driver_pid, started_at=excluded.started_at, ended_at=NULL",
                (job_id, ray_address, os.getpid(), time.time()),
            )
        self._mirror("record_job", lambda r: r.record_job(job_id, ray_address))
        self.start_run(job_id)

    def update_job(self, job_id: str, **fields: Any) -> None:
        """Set a job's ``name`` (the config's) and ``output_dir`` (its run folder), mirrored in the registry."""
        unknown = set(fields) - set(JOB_FIELDS)
        if unknown:
            raise ValueError(f"update_job: unknown fields {sorted(unknown)}; known: {list(JOB_FIELDS)}")
        if fields:
            with self._conn() as db:
                assignments = ", ".join(f"{k}=?" for k in fields)
                db.execute(f"UPDATE jobs SET {assignments} WHERE job_id=?", (*fields.values(), job_id))
        self._mirror("update_job", lambda r: r.update_job(job_id, **fields))

    def start_run(self, job_id: str) -> int:
        """A new attempt of ``job_id`` (one per driver: a ``--resume`` after a crash is the next one); an
        earlier attempt left open by a driver that is gone is closed as ``driver_lost``."""
        now = time.time()
        with self._conn() as db:
            for row in db.execute(
                "SELECT attempt, driver_pid FROM runs WHERE job_id=? AND ended_at IS NULL", (job_id,)
            ).fetchall():
                if row["driver_pid"] != os.getpid():
                    db.execute(
                        "UPDATE runs SET ended_at=?, status='driver_lost' WHERE job_id=? AND attempt=?",
                        (now, job_id, row["attempt"]),
                    )
            last = db.execute("SELECT MAX(attempt) FROM runs WHERE job_id=?", (job_id,)).fetchone()[0]
            attempt = int(last or 0) + 1
            db.execute("INSERT INTO runs VALUES (?,?,?,?,NULL,'running',NULL)", (job_id, attempt, os.getpid(), now))
        return attempt

    def end_run(self, job_id: str, status: str = "finished", cause: str | None = None) -> None:
        """Close this driver's open attempt of ``job_id`` (``finished`` or ``failed`` with its cause)."""
        with self._conn() as db:
            db.execute(
                "UPDATE runs SET ended_at=?, status=?, cause=? WHERE job_id=? AND driver_pid=? AND ended_at IS NULL",
                (time.time(), status, cause, job_id, os.getpid()),
            )

    def end_job(self, job_id: str) -> None:
        self.end_run(job_id)
        with self._conn() as db:
            db.execute("UPDATE jobs SET ended_at=? WHERE job_id=?", (time.time(), job_id))
            db.execute("UPDATE pools SET state='released', updated_at=? WHERE job_id=?", (time.time(), job_id))
            db.execute("UPDATE bindings SET state='stopped', updated_at=? WHERE job_id=?", (time.time(), job_id))
        self._mirror("end_job", lambda r: r.end_job(job_id))

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
        """One group of a pool: ``devices`` it holds now, ``max_devices`` for an elastic group."""
        with self._conn() as db:
            db.execute(
                "INSERT OR REPLACE INTO pools (job_id, pool, group_index, hardware, devices, cpus, placement_group, "
                "state, updated_at, max_devices) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (job_id, pool, group_index, hardware, devices, cpus, placement_group, state, time.time(), max_devices),
            )
        self._mirror(
            "record_pool",
            lambda r: r.record_pool(
                job_id, pool, group_index, hardware, devices, cpus, placement_group, state, max_devices=max_devices
            ),
        )

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
        """One worker's placement: ``device_ids`` the GPUs its actor got (empty on the CPU), ``slot_ids``
        its device slots in the pool group."""
        with self._conn() as db:
            db.execute(
                "INSERT OR REPLACE INTO bindings (job_id, cluster, rank, pool, hardware, node_id, device_ids, "
                "actor_name, state, updated_at, slot_ids) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    job_id,
                    cluster,
                    rank,
                    pool,
                    hardware,
                    node_id,
                    json.dumps(device_ids),
                    actor_name,
                    state,
                    time.time(),
                    json.dumps(list(slot_ids or [])),
                ),
            )
        self._mirror(
            "record_binding",
            lambda r: r.record_binding(
                job_id,
                cluster,
                rank,
                pool,
                hardware,
                node_id,
                device_ids,
                actor_name,
                state,
                node_ip=node_ip,
                slot_ids=list(slot_ids or []),
            ),
        )

    def set_binding_state(self, job_id: str, cluster: str, rank: int, state: str) -> None:
        with self._conn() as db:
            db.execute(
                "UPDATE bindings SET state=?, updated_at=? WHERE job_id=? AND cluster=? AND rank=?",
                (state, time.time(), job_id, cluster, rank),
            )
        self._mirror("set_binding_state", lambda r: r.set_binding_state(job_id, cluster, rank, state))

    def record_endpoint(self, job_id: str, cluster: str, method: str, url: str, timeout_s: float, retries: int) -> None:
        with self._conn() as db:
            db.execute(
                "INSERT OR REPLACE INTO endpoints VALUES (?,?,?,?,?,?,?)",
                (job_id, cluster, method, url, timeout_s, retries, time.time()),
            )
        self._mirror("record_endpoint", lambda r: r.record_endpoint(job_id, cluster, method, url, timeout_s, retries))

    # reads ----------------------------------------------------------------------------------------
    def _select(self, table: str, job_id: str | None) -> list[dict[str, Any]]:
        with self._conn() as db:
            if job_id is None:
                rows = db.execute(f"SELECT * FROM {table}").fetchall()
            else:
                rows = db.execute(f"SELECT * FROM {table} WHERE job_id=?", (job_id,)).fetchall()
        out = [dict(r) for r in rows]
        for r in out:
            for key in ("device_ids", "slot_ids"):
                if isinstance(r.get(key), str):
                    r[key] = json.loads(r[key])
        return out

    def jobs(self, job_id: str | None = None) -> list[dict[str, Any]]:
        return self._select("jobs", job_id)

    def pools(self, job_id: str | None = None) -> list[dict[str, Any]]:
        return self._select("pools", job_id)

    def bindings(self, job_id: str | None = None) -> list[dict[str, Any]]:
        return self._select("bindings", job_id)

    def endpoints(self, job_id: str | None = None) -> list[dict[str, Any]]:
        return self._select("endpoints", job_id)

    def runs(self, job_id: str | None = None) -> list[dict[str, Any]]:
        """Every attempt of each job (start, end, status, cause), oldest first."""
        return sorted(self._select("runs", job_id), key=lambda r: (r["job_id"], r["attempt"]))
