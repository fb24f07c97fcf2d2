"""What an elastic pool needs to know of the Ray cluster while a job runs: its nodes as they join, are
marked for removal and leave, the devices free on each, and the job's share in the cluster's admission
accounting.

The cluster is read by polling the GCS (:func:`read_view`: ``ray.nodes()``, the free resources per node,
and the nodes being drained), which works the same on every Ray 2.x: a node joining is a new alive node,
a node marked for removal is one Ray is draining (``ray drain-node``, an autoscaler's idle or preemption
termination, or a ``ray start --block`` that got SIGTERM: Ray then places nothing new there, and the node
leaves by itself once nothing runs on it), a node that vanished is dead. :func:`node_events` turns two
views into those events.

:class:`Claims` keeps the job's row of the cluster registry (``asks``: what the job holds per hardware
type, which the admission queue of ``rollart submit`` subtracts from the cluster's totals) in step with
the devices it holds. A growth is claimed under the registry's admission lock and only from what neither
the running jobs hold nor the queued jobs wait for: queued jobs come first, so capacity an elastic job
gives back goes to them. A job's quota (``rollart submit --quota``) caps its growth.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from rollart.resource_manager.admission import ACTIVE, LOCK
from rollart.resource_manager.capacity import free_per_node, node_devices

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeState:
    """One node of the Ray cluster as a poll saw it: its devices per hardware type and what is free of them."""

    node_id: str
    ip: str
    alive: bool
    draining: bool = False
    devices: dict[str, float] = field(default_factory=dict)
    free: dict[str, float] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        """Alive and not marked for removal: new work may be placed here."""
        return self.alive and not self.draining


@dataclass(frozen=True)
class ClusterView:
    """The nodes of the Ray cluster at one moment (``at``: ``time.monotonic()``)."""

    nodes: dict[str, NodeState]
    at: float

    def free_units(self, hardware: str, devices: int) -> int:
        """How many bundles of ``devices`` devices of ``hardware`` fit on the usable nodes now."""
        return sum(int(n.free.get(hardware, 0.0) // devices + 1e-9) for n in self.nodes.values() if n.usable)

    def totals(self) -> dict[str, float]:
        """Devices per hardware type on the usable nodes."""
        out: dict[str, float] = {}
        for n in self.nodes.values():
            if n.usable:
                for hw, amount in n.devices.items():
                    out[hw] = out.get(hw, 0.0) + amount
        return out

    def leaving(self) -> set[str]:
        """The nodes marked for removal or gone (dead)."""
        return {nid for nid, n in self.nodes.items() if not n.usable}


@dataclass(frozen=True)
class NodeEvent:
    """A node ``joined``, is ``draining`` (marked for removal) or ``left`` (dead)."""

    kind: str
    node_id: str
    ip: str
    devices: dict[str, float]


def draining_nodes() -> set[str]:
    """The ids of the nodes Ray is draining (empty on a Ray that cannot tell)."""
    try:
        return set(ray._private.state.state.get_draining_nodes())
    except Exception as err:  # an older Ray: drains are not seen, a node is seen when it leaves
        log.debug("cannot read the draining nodes: %s", err)
        return set()


def read_view() -> ClusterView:
    """The cluster now: every node Ray knows (alive or dead), drained ones marked, devices and free devices."""
    free = free_per_node()
    draining = draining_nodes()
    nodes = {}
    for node in ray.nodes():
        nid = node["NodeID"]
        res = node.get("Resources", {}) or {}
        hw = node_devices(res, free.get(nid, res)) if node.get("Alive") else {}
        nodes[nid] = NodeState(
            node_id=nid,
            ip=node.get("NodeManagerAddress", ""),
            alive=bool(node.get("Alive")),
            draining=nid in draining,
            devices={h: total for h, (_, total, _) in hw.items()},
            free={h: f for h, (_, _, f) in hw.items()},
        )
    return ClusterView(nodes, time.monotonic())


def node_events(old: ClusterView | None, new: ClusterView) -> list[NodeEvent]:
    """What changed between two views: nodes that joined, were marked for removal, or left."""
    before = old.nodes if old is not None else {}
    out = []
    for nid, n in new.nodes.items():
        was = before.get(nid)
        if n.alive and (was is None or not was.alive):
            out.append(NodeEvent("joined", nid, n.ip, n.devices))
        if n.alive and n.draining and (was is None or not was.draining):
            out.append(NodeEvent("draining", nid, n.ip, n.devices))
        if not n.alive and was is not None and was.alive:
            out.append(NodeEvent("left", nid, n.ip, was.devices))
    return out


class Claims:
    """The devices a job holds, per hardware type, as its registry row's ``asks`` (see the module doc).

    ``registry`` is the cluster registry (None: no accounting, every claim succeeds); ``quota`` caps what
    the job may hold per hardware type (absent: no cap)."""

    def __init__(
        self,
        registry: Any,
        job_id: str,
        held: Mapping[str, float],
        quota: Mapping[str, float] | None = None,
        lock_tries: int = 20,
        lock_wait_s: float = 0.05,
    ):
        self.registry = registry
        self.job_id = job_id
        self.held = {hw: float(n) for hw, n in held.items()}
        self.quota = dict(quota or {})
        self.lock_tries, self.lock_wait_s = lock_tries, lock_wait_s
        self._write = threading.Lock()  # held and the job's row change together (the row is read, merged, written)
        self.publish()

    def _put(self, **fields: Any) -> None:
        if self.registry is not None:
            self.registry.update_job(self.job_id, asks=dict(self.held), **fields)

    def publish(self, **fields: Any) -> None:
        """Write ``fields`` and the current ``asks`` into the job's registry row."""
        with self._write:
            self._put(**fields)

    def _locked(self) -> bool:
        for _ in range(self.lock_tries):
            if self.registry.try_lock(LOCK, self.job_id):
                return True
            time.sleep(self.lock_wait_s)  # another driver admits a job: it holds the lock for a moment
        return False

    def room(self, hardware: str, totals: Mapping[str, float]) -> float:
        """How much more of ``hardware`` the job may claim now: the quota's rest, and the cluster's
        ``totals`` less what every running job holds and every queued job waits for."""
        cap = self.quota.get(hardware, float("inf")) - self.held.get(hardware, 0.0)
        if self.registry is None:
            return cap
        free = totals.get(hardware, 0.0)
        for row in self.registry.jobs():
            if row.get("state") in (*ACTIVE, "queued"):
                free -= float((row.get("asks") or {}).get(hardware, 0.0))
        return min(cap, free)

    def claim(self, hardware: str, devices: float, totals: Mapping[str, float]) -> bool:
        """Hold ``devices`` more of ``hardware`` if the accounting leaves room (see :meth:`room`)."""
        if self.registry is not None and not self._locked():
            return False
        try:
            with self._write:
                if self.room(hardware, totals) + 1e-9 < devices:
                    return False
                self.held[hardware] = self.held.get(hardware, 0.0) + devices
                self._put()
                return True
        finally:
            if self.registry is not None:
                self.registry.unlock(LOCK, self.job_id)

    def give_back(self, hardware: str, devices: float) -> None:
        """Hold ``devices`` fewer of ``hardware`` (a queued job may be admitted with them)."""
        with self._write:
            self.held[hardware] = max(0.0, self.held.get(hardware, 0.0) - devices)
            self._put()
