"""Elastic rollout: inference workers that join and leave the rollout pool while the job runs.

A rollout pool group with ``max_devices`` is elastic (``pools: {rollout: {hardware: H20, devices: 2,
max_devices: 8}}``). :class:`ElasticRollout` watches the Ray cluster (every ``elastic.poll_s``:
:func:`~rollart.resource_manager.elastic.read_view`) and keeps the pool at its target size, which is
``max_devices`` until ``rollart scale JOB --pool rollout --devices N`` sets another:

- **Join**: while the pool holds fewer devices than its target and matching devices are free on a node
  that is not being drained (and the cluster's admission accounting leaves them to this job: queued
  ``rollart submit`` jobs come first, the job's quota caps it), one worker's devices are reserved as a
  placement group of their own, a worker starts there, loads the weights being served (through the
  job's weight channel, as a restarted worker does; Mooncake's host cache of a new host is started by
  the driver), and takes traffic once it serves the current version while the rollout is not suspended
  (:meth:`~rollart.rollout.llm_proxy.LLMProxy.admit_worker`). The LLMProxy routes to it by the same
  ``tags:`` rules: a rule that lists several hardware types uses new workers of any of them, in the
  rule's order. The asynchronous bound and the trajectory ledger are untouched: a worker serves only
  the version every other worker serves.
- **Leave**: above its target (workers that joined last leave first), or when a node of the pool is
  marked for removal (Ray drains it), a worker stops taking new requests, finishes its requests in
  flight (up to ``elastic.drain_timeout_s``; the rest are preempted and continue on other workers from
  their tokens so far), is stopped, and its devices go back to the cluster and to the admission queue.
  Ray then removes a drained node once nothing of the job runs there.
- **Lost**: a node that vanishes goes through the fault path first (its workers' requests are sent
  again to live workers, see :mod:`rollart.rollout.llm_proxy`); once Ray reports the node dead, its
  workers leave the pool instead of being restarted in place, and the pool grows back when capacity
  returns.

With ``elastic.autoscale`` the target is the autopilot's (:mod:`rollart.rollout.autopilot`): it starts at
the size the job started with, and after each training step (:meth:`ElasticRollout.autoscale_step`) it
grows the pool while the trainer waits for rollout, shrinks it while generation is held back by the
asynchronous bound, and gives the pool back down to its smallest size while a job of the same or a higher
priority queues for its devices. A ``rollart scale --devices N`` target holds until
``rollart scale --auto`` hands the pool back to the autopilot.

Only elastic groups change; workers of a fixed group on a drained node stay (and go through the fault
path when the node goes). Every join, leave, loss and node event is kept (:attr:`ElasticRollout.events`,
``RUN_DIR/elastic.jsonl``); each step's record gets :meth:`ElasticRollout.step_metrics`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import ray

from rollart.cluster.cluster import Cluster
from rollart.resource_manager.elastic import Claims, ClusterView, NodeEvent, node_events, read_view
from rollart.resource_manager.manager import ReservedGroup, ResourceManager
from rollart.rollout.autopilot import Autopilot, AutopilotSettings, Demand
from rollart.rollout.config import AutoscaleConfig, ElasticConfig, advised_rollout_devices
from rollart.rollout.llm_proxy import LLMProxy

log = logging.getLogger(__name__)

EVENTS_KEPT = 1000  # the newest events kept in memory (every one is in elastic.jsonl)


class HostHooks(Protocol):
    """What the job's weight path does when a host starts or stops serving the pool (e.g. Mooncake's
    host cache: started by the driver on a new host, ended on a host that leaves so Ray can remove it)."""

    def host_joined(self, node_id: str) -> None: ...

    def host_left(self, node_id: str) -> None: ...


@dataclass
class Member:
    """A worker of an elastic group: its rank, the unit (placement group) it runs in, and where it is."""

    rank: int
    unit: ReservedGroup
    node_id: str = ""
    node_ip: str = ""
    state: str = "joining"  # joining | serving | draining | gone

    @property
    def hardware(self) -> str:
        return self.unit.group.hardware


def first_target(cfg: AutoscaleConfig, low: int, high: int, current: int, unit: int) -> tuple[int, str]:
    """The autopilot's first target and where it came from: ``rollart advise``'s advised rollout devices
    (``cfg.advise``), else the size the pool started with; whole workers within ``low..high``."""
    if cfg.advise is not None:
        wanted, source = advised_rollout_devices(cfg.advise), "advise"
    else:
        wanted, source = current, "start"
    wanted = unit * -(-wanted // unit)  # whole workers, rounded up
    return min(high, max(low, wanted)), source


class ElasticRollout:
    """Keeps the elastic groups of ``cluster``'s pool at their target size (see the module doc).

    ``rm`` reserves and releases the workers' devices; ``proxy`` admits new workers (weights, version);
    ``out_dir`` gets ``elastic.jsonl``; ``hosts`` (optional, given here and read-only after) hears of hosts
    joining and leaving."""

    def __init__(
        self,
        rm: ResourceManager,
        cluster: Cluster,
        proxy: LLMProxy,
        config: ElasticConfig | None = None,
        *,
        out_dir: Path | None = None,
        hosts: HostHooks | None = None,
    ):
        assert cluster.pool is not None
        self.rm, self.cluster, self.proxy = rm, cluster, proxy
        self.config = config or ElasticConfig()
        self.pool = cluster.pool
        self.spec = rm.specs[self.pool]
        if not self.spec.elastic:
            raise ValueError(f"pool {self.pool!r} has no elastic group (max_devices)")
        self._hosts = hosts
        self.devices_per_worker = rm.worker_devices.get(self.pool, 1)
        self.fixed_devices = sum(g.amount for g in self.spec.groups if not g.elastic)
        self.max_devices = self.fixed_devices + sum(g.max_devices or 0 for g in self.spec.groups if g.elastic)
        self.target = self.max_devices
        self.autopilot: Autopilot | None = None  # elastic.autoscale: the job sizes the pool (start())
        self.members: dict[int, Member] = {}
        self._starting: Counter[int] = Counter()  # group index -> units placed whose worker has no rank yet
        self._lock = threading.RLock()
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._counts: Counter[str] = Counter()  # joined / left / lost since the last step_metrics()
        self.totals: Counter[str] = Counter()  # joined / left / lost in all
        self.events_path = out_dir / "elastic.jsonl" if out_dir is not None else None
        self._view: ClusterView | None = None
        self._node_seen: dict[str, float] = {}  # node id -> when it was first seen alive
        # the time of the last `rollart scale` request applied; one older than this pool is an earlier run's
        # (the same job id restarted): `rollart scale` asks only once a running pool published its size
        self._scale_at = time.time()
        self._published: dict[str, Any] | None = None
        self._ops = ThreadPoolExecutor(max_workers=self.config.max_joining + 4, thread_name_prefix="elastic")
        self._inflight_ops = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.monotonic()
        self._warned_fixed: set[str] = set()
        self._step = 0  # the last training step the autopilot heard of
        from rollart.resource_manager.registry import ClusterRegistry

        registry = rm.store.registry
        self.registry = registry if isinstance(registry, ClusterRegistry) else None
        self.claims = Claims(
            self.registry,
            rm.job_id,
            held=rm.resources_held(),
            quota=rm.admission.quota if rm.admission is not None else None,
        )

    @property
    def hosts(self) -> HostHooks | None:
        """What hears of hosts joining and leaving the pool (the job's weight path), given at construction."""
        return self._hosts

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Take the pool's elastic workers as members and start watching the cluster."""
        if self._thread is not None:  # started already (a run goes on after a trainer restore)
            return
        for p in self.cluster.placement():
            unit = self.cluster.group_of(p["rank"])
            if unit.elastic and not p["retired"]:
                state = "serving" if p["alive"] else "joining"
                self.members[p["rank"]] = Member(p["rank"], unit, p["node_id"], p["node_ip"], state)
        self.cluster.set_awaiting_workers(True)
        if self.config.autoscale is not None and self.autopilot is None:
            self._start_autopilot(self.config.autoscale)
        self._view = read_view()
        now = time.monotonic()
        self._node_seen = {nid: now for nid, n in self._view.nodes.items() if n.alive}
        self._publish()
        self._thread = threading.Thread(target=self._loop, name=f"elastic-{self.pool}", daemon=True)
        self._thread.start()
        log.info(
            "elastic pool %s: %d of at most %d devices; watching the cluster every %.1fs",
            self.pool,
            self.devices(),
            self.max_devices,
            self.config.poll_s,
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop watching; joins and drains under way are left to the pool's shutdown."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._ops.shutdown(wait=False, cancel_futures=True)
        self.cluster.set_awaiting_workers(False)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            try:
                self.tick()
            except Exception:  # a poll that failed (the GCS busy, a node going): the next one tries again
                log.exception("elastic pool %s: a poll failed", self.pool)

    # ------------------------------------------------------------------ size
    def devices(self) -> int:
        """The devices the pool holds now (fixed groups, and elastic workers joining or serving)."""
        with self._lock:
            units = sum(1 for m in self.members.values() if m.state in ("joining", "serving"))
            return self.fixed_devices + self.devices_per_worker * (units + sum(self._starting.values()))

    def _group_devices(self, index: int) -> int:
        with self._lock:
            units = sum(1 for m in self.members.values() if m.unit.index == index and m.state in ("joining", "serving"))
            return self.devices_per_worker * (units + self._starting[index])

    def scale(self, devices: int, source: str = "api") -> bool:
        """Set the pool's target size in devices (between one worker's devices, and the fixed groups'
        devices, and ``max_devices``); False (and an event saying why) when it is out of range."""
        low = max(self.devices_per_worker, self.fixed_devices)
        if not low <= devices <= self.max_devices or devices % self.devices_per_worker:
            why = (
                f"pools.{self.pool}: {devices} devices is outside {low}..{self.max_devices}"
                if not low <= devices <= self.max_devices
                else f"pools.{self.pool}: {devices} devices is not a multiple of {self.devices_per_worker} per worker"
            )
            log.error("scale request refused: %s", why)
            self._event("scale_refused", devices=devices, source=source, why=why)
            return False
        if devices != self.target:
            self._event("scale", devices=devices, previous=self.target, source=source)
            log.info("elastic pool %s: target %d -> %d devices (%s)", self.pool, self.target, devices, source)
            self.target = devices
        if self.autopilot is not None:  # a person's target: it holds until `rollart scale --auto`
            with self._lock:
                decision = self.autopilot.manual(devices, step=self._step)
            self._event("autopilot", **decision.as_record())
        return True

    # ------------------------------------------------------------------ one poll
    def tick(self) -> None:
        """Read the cluster once and act: node events, a scale request, workers of leaving nodes, and
        growth or shrinking toward the target."""
        view = read_view()
        for ev in node_events(self._view, view):
            self._node_event(ev)
        self._view = view
        self._read_scale_request()
        self._autopilot_queue()
        leaving = view.leaving()
        with self._lock:
            members = [m for m in self.members.values() if m.state in ("joining", "serving")]
        for m in members:
            if not m.node_id or m.node_id not in leaving:
                continue
            node = view.nodes[m.node_id]
            if not node.alive:
                self._remove(m, "lost", reason="node_left")
            else:
                self._start_drain(m, "node_draining")
        self._warn_fixed_on_leaving(view)
        excess = self.devices() - self.target
        if excess > 0:
            self._shrink(excess)
        elif excess < 0:
            self._grow(-excess, view)
        self._publish()

    def _warn_fixed_on_leaving(self, view: ClusterView) -> None:
        for p in self.cluster.placement():
            nid = p["node_id"]
            if nid in view.leaving() and not self.cluster.group_of(p["rank"]).elastic and nid not in self._warned_fixed:
                self._warned_fixed.add(nid)
                log.warning(
                    "node %s is marked for removal but holds rank %d of a fixed group of pool %s: it stays until "
                    "the node goes (then the fault path handles it); give the group max_devices to let it leave",
                    p["node_ip"],
                    p["rank"],
                    self.pool,
                )

    def _node_event(self, ev: NodeEvent) -> None:
        if ev.kind == "joined":
            self._node_seen.setdefault(ev.node_id, time.monotonic())
        devices = {hw: n for hw, n in ev.devices.items() if hw != "CPU"}
        self._event(f"node_{ev.kind}", node_id=ev.node_id, node_ip=ev.ip, devices=devices)
        log.info("elastic pool %s: node %s %s (%s)", self.pool, ev.ip, ev.kind, devices or "no devices")

    def _read_scale_request(self) -> None:
        if self.registry is None:
            return
        req = self.registry.scale_request(self.rm.job_id, self.pool)
        if req is not None and float(req.get("at", 0.0)) > self._scale_at:
            self._scale_at = float(req["at"])
            if req.get("devices") is None:  # `rollart scale --auto`: the autopilot decides again
                self.release_to_autopilot()
            else:
                self.scale(int(req["devices"]), source="rollart scale")

    def _shrink(self, excess: int) -> None:
        """Workers leave, the last joined first, until the pool is at its target."""
        with self._lock:
            candidates = sorted(
                (m for m in self.members.values() if m.state in ("joining", "serving")),
                key=lambda m: m.rank,
                reverse=True,
            )
        for m in candidates:
            if excess <= 0:
                break
            self._start_drain(m, "scale")
            excess -= self.devices_per_worker

    def _grow(self, deficit: int, view: ClusterView) -> None:
        """Reserve and start workers in the elastic groups, in the pool's order, where devices are free."""
        d = self.devices_per_worker
        for index, group in enumerate(self.spec.groups):
            if not group.elastic or deficit < d:
                continue
            with self._lock:
                busy = self._inflight_ops
            room = min((group.max_devices or 0) - self._group_devices(index), deficit) // d
            free = view.free_units(group.hardware, d)
            for _ in range(min(room, free, self.config.max_joining - busy)):
                if not self.claims.claim(group.hardware, d, view.totals()):
                    break  # queued jobs wait for these devices, or the job's quota is reached
                unit = self.rm.grow(self.pool, index, self.config.place_timeout_s)
                if unit is None:  # taken meanwhile
                    self.claims.give_back(group.hardware, d)
                    break
                with self._lock:
                    self._starting[index] += 1
                    self._inflight_ops += 1
                deficit -= d
                self._ops.submit(self._join, unit, view.at)

    # ------------------------------------------------------------------ join and leave
    def _join(self, unit: ReservedGroup, seen_at: float) -> None:
        """Start a worker in ``unit``, load the served weights into it, let it take traffic."""
        t0 = time.monotonic()
        try:
            try:
                rank = self.cluster.add_worker(unit, timeout_s=self.config.join_timeout_s)
            except Exception as err:
                with self._lock:
                    self._starting[unit.index] -= 1
                self.rm.release(unit)
                self.claims.give_back(unit.group.hardware, self.devices_per_worker)
                self._event("join_failed", hardware=unit.group.hardware, cause=repr(err))
                log.warning("elastic pool %s: a worker on %s did not start: %r", self.pool, unit.group.hardware, err)
                return
            p = self.cluster.placement()[rank]
            m = Member(rank, unit, p["node_id"], p["node_ip"])
            with self._lock:
                self._starting[unit.index] -= 1
                first_on_host = not any(x.node_id == m.node_id and x.state != "gone" for x in self.members.values())
                self.members[rank] = m
            t_started = time.monotonic()
            try:
                if first_on_host and self.hosts is not None:
                    self.hosts.host_joined(m.node_id)
                version = self.proxy.admit_worker(rank, timeout_s=self.config.join_timeout_s)
            except Exception as err:
                if not self._stop.is_set():
                    log.warning("elastic pool %s: rank %d did not come to serve: %r", self.pool, rank, err)
                self._remove(m, "failed", reason=repr(err))
                return
            now = time.monotonic()
            with self._lock:
                if m.state != "joining":  # it was told to leave while loading
                    return
                m.state = "serving"
            self._count("joined")
            self._event(
                "joined",
                rank=rank,
                hardware=m.hardware,
                node_id=m.node_id,
                node_ip=m.node_ip,
                version=version,
                start_s=round(t_started - t0, 3),
                load_s=round(now - t_started, 3),
                join_s=round(now - seen_at, 3),
                since_node_s=round(now - self._node_seen.get(m.node_id, seen_at), 3),
            )
            log.info(
                "elastic pool %s: rank %d (%s, host %s) serves version %d, %.1fs after its devices were seen free",
                self.pool,
                rank,
                m.hardware,
                m.node_ip,
                version,
                now - seen_at,
            )
        finally:
            with self._lock:
                self._inflight_ops -= 1

    def _start_drain(self, m: Member, reason: str) -> None:
        with self._lock:
            if m.state not in ("joining", "serving"):
                return
            m.state = "draining"
            self._inflight_ops += 1
        self._event("draining", rank=m.rank, hardware=m.hardware, node_ip=m.node_ip, reason=reason)
        self._ops.submit(self._drain, m, reason)

    def _drain(self, m: Member, reason: str) -> None:
        """Route nothing new to ``m``, let its requests finish (then preempt the rest: they continue
        elsewhere), stop it and give its devices back."""
        t0 = time.monotonic()
        try:
            self.cluster.set_draining(m.rank)
            migrated = 0
            if not self.cluster.wait_idle(m.rank, self.config.drain_timeout_s):
                try:  # what still runs there is answered as preempted: the LLMProxy continues it on another worker
                    migrated = int(ray.get(self.cluster.workers[m.rank].suspend.remote(), timeout=60))
                except (ray.exceptions.RayError, ValueError) as err:
                    log.info("elastic pool %s: rank %d could not be suspended (%r)", self.pool, m.rank, err)
                self.cluster.wait_idle(m.rank, 10.0)
            self._remove(m, "left", reason=reason, drain_s=round(time.monotonic() - t0, 3), migrated=migrated)
        except Exception:
            log.exception("elastic pool %s: draining rank %d failed; removing it", self.pool, m.rank)
            self._remove(m, "left", reason=reason, drain_s=round(time.monotonic() - t0, 3))
        finally:
            with self._lock:
                self._inflight_ops -= 1

    def _remove(self, m: Member, state: str, **info: Any) -> None:
        """``m`` leaves the pool (``left``, ``lost`` or ``failed``): stopped, its devices released (once)."""
        with self._lock:
            if m.state == "gone":
                return
            m.state = "gone"
            last_on_host = not any(x.node_id == m.node_id and x.state != "gone" for x in self.members.values())
        self.cluster.retire_worker(m.rank, state)
        self.rm.release(m.unit)
        self.claims.give_back(m.hardware, self.devices_per_worker)
        if last_on_host and self.hosts is not None and m.node_id:
            try:
                self.hosts.host_left(m.node_id)
            except Exception as err:  # the host is gone: nothing of it to end
                log.debug("host_left %s: %r", m.node_ip, err)
        if state in ("left", "lost"):
            self._count(state)
        self._event(state, rank=m.rank, hardware=m.hardware, node_id=m.node_id, node_ip=m.node_ip, **info)
        log.info("elastic pool %s: rank %d (%s, host %s) %s %s", self.pool, m.rank, m.hardware, m.node_ip, state, info)

    # ------------------------------------------------------------------ records
    # ------------------------------------------------------------------ the autopilot (elastic.autoscale)
    def _start_autopilot(self, cfg: AutoscaleConfig) -> None:
        low = max(self.devices_per_worker, self.fixed_devices)
        settings = AutopilotSettings(
            min_devices=low,
            max_devices=self.max_devices,
            unit=self.devices_per_worker,
            grow_above=cfg.grow_above,
            shrink_below=cfg.shrink_below,
            window=cfg.window,
            cooldown_steps=cfg.cooldown_steps,
        )
        start, source = first_target(cfg, low, self.max_devices, self.devices(), self.devices_per_worker)
        self.autopilot = Autopilot(settings, target=start)
        self.target = start
        self._event("autopilot_on", target=start, start_from=source, **settings.model_dump())
        log.info(
            "elastic pool %s: the autopilot sizes it (%d..%d devices), from %d", self.pool, low, self.max_devices, start
        )

    def autoscale_step(self, step: int, step_s: float, rollout_wait_s: float, held_back: bool) -> dict[str, Any] | None:
        """Give the autopilot one training step's measurements (the pipeline calls this after each step);
        the decision, when the target changed (also in ``elastic.jsonl``), else None."""
        if self.autopilot is None:
            return None
        assert self.config.autoscale is not None
        queued = self._queued_for_pool() if self.config.autoscale.yield_to_queued else 0
        demand = Demand(step, step_s, rollout_wait_s, held_back, self.devices(), queued)
        with self._lock:
            self._step = step
            decision = self.autopilot.observe(demand)
            if decision is None:
                return None
            self.target = decision.target
        record = decision.as_record()
        self._event("autopilot", **record)
        log.info(
            "elastic pool %s: autopilot %s %d -> %d devices (%s)",
            self.pool,
            decision.reason,
            decision.previous,
            decision.target,
            ", ".join(f"{k} {v}" for k, v in decision.measurements.items()),
        )
        return record

    def _autopilot_queue(self) -> None:
        """Every poll: a job queued for the pool's devices gets them at once (the autopilot yields)."""
        if self.autopilot is None or self.config.autoscale is None or not self.config.autoscale.yield_to_queued:
            return
        queued = self._queued_for_pool()
        with self._lock:
            decision = self.autopilot.on_queue(queued, self._step)
            if decision is None:
                return
            self.target = decision.target
        self._event("autopilot", **decision.as_record())
        log.info(
            "elastic pool %s: autopilot %s %d -> %d devices",
            self.pool,
            decision.reason,
            decision.previous,
            decision.target,
        )

    def release_to_autopilot(self) -> bool:
        """End a person's target (``rollart scale --auto``): the autopilot decides again. False without one."""
        if self.autopilot is None:
            log.error(
                "rollart scale --auto: pool %s has no autopilot (elastic.autoscale); nothing to release", self.pool
            )
            self._event("scale_refused", source="rollart scale --auto", why="no autopilot (elastic.autoscale)")
            return False
        with self._lock:
            decision = self.autopilot.manual(None, step=self._step)
        if decision is not None:
            self._event("autopilot", **decision.as_record())
        return True

    def _queued_for_pool(self) -> int:
        """Jobs queued (``rollart submit``) for this pool's hardware with a priority at least this job's."""
        if self.registry is None:
            return 0
        rows = self.registry.jobs()
        mine = next((r for r in rows if r.get("job_id") == self.rm.job_id), {})
        priority = int(mine.get("priority") or 0)
        kinds = {g.hardware for g in self.spec.groups}
        return sum(
            1
            for r in rows
            if r.get("state") == "queued"
            and int(r.get("priority") or 0) >= priority
            and any(float((r.get("asks") or {}).get(hw, 0.0)) > 0 for hw in kinds)
        )

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1
            self.totals[kind] += 1

    def _event(self, kind: str, **fields: Any) -> None:
        row = {"event": kind, "time": time.time(), "elapsed_s": round(time.monotonic() - self.t0, 3), **fields}
        with self._lock:
            self.events.append(row)
            if self.events_path is not None:
                with self.events_path.open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")

    def summary(self) -> dict[str, Any]:
        """The pool now: devices held (and serving), its maximum and target, workers joining and draining."""
        with self._lock:
            states = Counter(m.state for m in self.members.values())
            starting = sum(self._starting.values())
        serving = [p for p in self.cluster.placement() if p["alive"] and not p["draining"]]
        return {
            "devices": self.devices(),
            "serving_devices": self.devices_per_worker * len(serving),
            "max_devices": self.max_devices,
            "target": self.target,
            "workers": len(serving),
            "joining": states["joining"] + starting,
            "draining": states["draining"],
            **({"autopilot": self._autopilot_summary()} if self.autopilot is not None else {}),
        }

    def _autopilot_summary(self) -> dict[str, Any]:
        assert self.autopilot is not None
        state = self.autopilot.state_dict()
        return {"target": state["target"], "manual": state["manual"], "yielding": state["before_yield"] is not None}

    def _publish(self) -> None:
        """The pool's size in the job's registry row (``rollart jobs``, ``rollart scale`` read it)."""
        now = self.summary()
        if now != self._published:
            self._published = now
            self.claims.publish(elastic={self.pool: now})

    def step_metrics(self) -> dict[str, Any]:
        """The pool's size now, and the workers that joined, left and were lost since the last call."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return {**self.summary(), "joined": counts["joined"], "left": counts["left"], "lost": counts["lost"]}
