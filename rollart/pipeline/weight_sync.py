"""How the trainer's weights reach the inference workers: one :class:`WeightSync` per
``weights.channel`` (:func:`weight_sync`), behind one interface.

- ``ray`` (:class:`RaySync`): the trainer's snapshot goes through the Ray object store; the driver waits
  until every worker serves it (a global pause with ``weights.pause_rollout``), or with
  ``weights.background_load`` the next batch trains while the workers load the newest snapshot.
- ``dist`` (:class:`DistSync`): a torch.distributed broadcast; the driver waits for every worker.
- ``mooncake`` (:class:`MooncakeSync`): the trainer publishes to a Mooncake store in the background and
  the driver never waits: a loader serves the newest published version on every worker, one at a time
  (a version published while another loads is skipped if a newer one follows), each host fetching a
  version once through its host cache. The channel is renamed after a trainer restart.
- ``inprocess`` (:class:`InProcessSync`, colocated mode): trainer and engine share each rank's process
  and devices; before the step the rollout is suspended and every engine sleeps (:meth:`WeightSync.before_train`),
  after it every engine wakes with its trainer's weights, loaded in its own process, and the rollout resumes.
- ``none`` (:class:`NoSync`): benchmarks only; no weights move, the version advances.

A weight path talks to two typed interfaces only: the run's :class:`PolicyClock` (given at construction:
the version every worker serves) and the rollout as a :class:`WeightTarget` (what it may ask of it: serve a
version, suspend, resume). Every method that touches the rollout takes the pipeline's current one, its
:class:`~rollart.rollout.async_controller.AsyncController` (a trainer restore replaces it).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rollart.rollout.async_controller import NewestVersionLoader
from rollart.rollout.policy_clock import PolicyClock
from rollart.weights.base import WeightChannel
from rollart.weights.kinds import channel_kind, channel_name_problem

log = logging.getLogger(__name__)
T = TypeVar("T")


class WeightTarget(Protocol):
    """What a weight path asks of the rollout (:class:`~rollart.rollout.async_controller.AsyncController`
    implements it): make a version the serving policy, from weights in hand, a channel or each worker's own
    process; move on without weights; suspend and resume the rollout."""

    async def serve_weights(self, weights: Any, version: int) -> None:
        """Before the rollout starts: every worker serves ``weights`` as ``version``."""

    async def serve_weights_from(self, channel: WeightChannel, version: int) -> None:
        """Before the rollout starts: every worker fetches ``version`` from ``channel``."""

    async def serve_weights_in_process(self, load: Callable[[], Awaitable[T]], version: int) -> T:
        """Before the rollout starts, colocated: every worker serves ``version`` from its own process."""

    async def sync_weights(
        self, weights: Any, version: int, channel: WeightChannel | None = None, *, pause: bool = True
    ) -> None:
        """After a step: ``version`` becomes the serving policy (from ``weights`` or ``channel``), timed."""

    async def swap_in_process(self, load: Callable[[], Awaitable[T]], version: int) -> T:
        """After a step, colocated: the suspended workers serve ``version`` from their own process; resume."""

    async def advance(self, version: int) -> None:
        """No weights move: the rollout goes on under ``version``."""

    async def suspend(self) -> None:
        """Requests in flight preempted, new ones held."""

    async def resume(self) -> None:
        """Held requests go on."""


class WeightSync:
    """The weight path of one channel. ``train`` and ``infer`` are the trainer and inference Clusters,
    ``clock`` the run's policy versions (read here, never written)."""

    kind = ""
    channel: WeightChannel | None = None  # the handle trainer and workers share (None: no channel object)

    def __init__(self, config: Any, train: Any, infer: Any, *, clock: PolicyClock):
        self.config = config  # the pipeline config (weights:, rollout.alpha)
        self.train, self.infer = train, infer
        self.clock = clock
        # the trainer gathers and sends its weights a bucket of at most this many bytes at a time
        self.bucket_bytes = int(config.weights.bucket_mb) << 20
        self.loader: NewestVersionLoader | None = None  # serves the newest published version in the background

    @classmethod
    def build(cls, config: Any, train: Any, infer: Any, *, name: str, out_dir: Path, clock: PolicyClock) -> WeightSync:
        """The weight path of ``config.weights.channel`` (:func:`weight_sync` calls it): ``name`` is the
        trainer's channel name (``{job_id}-actor``), ``out_dir`` the run's folder. A channel that needs
        either overrides this."""
        return cls(config, train, infer, clock=clock)

    async def start(self, rollout: WeightTarget) -> None:
        """Before the first step of a run."""

    async def before_train(self, rollout: WeightTarget) -> None:
        """After the step's batch is in, before anything of the step computes on the trainer's devices."""

    def record(self) -> dict[str, Any]:
        """What this weight path reports for the step just synced (merged into the step's record)."""
        return {}

    async def push(self, rollout: WeightTarget, version: int) -> int:
        """The trainer's current weights, before the rollout starts (a resumed or restored run): every
        worker serves them when this returns. Returns the version they are served as."""
        raise NotImplementedError

    async def sync(self, rollout: WeightTarget, version: int) -> int:
        """Publish the trainer's weights of the step just trained and make them the serving policy (or
        start to: see the channel). Returns the version."""
        raise NotImplementedError

    async def wait(self) -> None:
        """Until every worker serves the newest version (a background load); re-raise its failure."""
        if self.loader is not None:
            await self.loader.wait()

    async def stop_loading(self) -> None:
        """No load of a published version goes on (a failed step, a dead trainer's versions)."""
        if self.loader is not None:
            await self.loader.cancel()

    async def reset(self) -> None:
        """After a trainer restore: what was published by the dead trainer is not loaded any more."""
        await self.stop_loading()
        self.loader = None

    async def trainer_restarted(self) -> WeightChannel | None:
        """A trainer restart before its weights are pushed again; returns a channel to :meth:`retire`
        once they are served (None: nothing to retire)."""
        return None

    async def retire(self, old: WeightChannel) -> None:
        """Stop every reader of ``old`` (see :meth:`trainer_restarted`)."""

    def host_joined(self, node_id: str) -> None:
        """A host started serving the rollout pool (an elastic pool grew onto it), before its first load."""

    def host_left(self, node_id: str) -> None:
        """No worker of the rollout pool is left on this host (it may be drained and removed)."""

    def close(self) -> None:
        """Release what this object started (at the pipeline's shutdown)."""


class NoSync(WeightSync):
    """``weights.channel: none`` (benchmarks only): the workers keep their initial weights."""

    kind = "none"

    def __init__(self, config: Any, train: Any, infer: Any, *, clock: PolicyClock):
        super().__init__(config, train, infer, clock=clock)
        log.warning("weights.channel=none: the inference workers keep their initial weights (benchmarks only)")

    async def push(self, rollout: WeightTarget, version: int) -> int:
        return version

    async def sync(self, rollout: WeightTarget, version: int) -> int:
        await rollout.advance(version)
        return version


class RaySync(WeightSync):
    """``weights.channel: ray``: the trainer's snapshot (an ObjectRef in the Ray object store) is loaded
    by every worker; with background loading only the newest snapshot not loaded yet is kept."""

    kind = "ray"

    def __init__(self, config: Any, train: Any, infer: Any, *, clock: PolicyClock):
        super().__init__(config, train, infer, clock=clock)
        mode = config.weights.background_load
        self.background = config.rollout.alpha >= 1 if mode == "auto" else bool(mode)
        self.snapshots: dict[int, Any] = {}  # background: the newest snapshot not loaded yet
        self._rollout: WeightTarget | None = None

    async def push(self, rollout: WeightTarget, version: int) -> int:
        ref = await self.train.snapshot_weights(self.bucket_bytes, blocking=False)
        await rollout.serve_weights(ref, version)
        return version

    async def sync(self, rollout: WeightTarget, version: int) -> int:
        ref = await self.train.snapshot_weights(self.bucket_bytes, blocking=False)
        if not self.background:
            await rollout.sync_weights(ref, version, pause=self.config.weights.pause_rollout)
            return version
        # the next batch trains while the workers load this snapshot; only the newest waiting one is kept
        self.snapshots = {version: ref}
        self._rollout = rollout
        if self.loader is None:
            self.loader = NewestVersionLoader(self._load, served=self.clock.served)
        self.loader.offer(version)  # raises a failed load of an earlier version
        return version

    async def _load(self, version: int) -> None:
        """Load the kept snapshot of ``version`` into every worker (the background loader's job)."""
        assert self._rollout is not None
        ref = self.snapshots.pop(version)
        await self._rollout.sync_weights(ref, version, pause=self.config.weights.pause_rollout)

    async def reset(self) -> None:
        await super().reset()
        self.snapshots = {}


class InProcessSync(WeightSync):
    """``weights.channel: inprocess`` (colocated mode): the trainer Cluster is the inference Cluster, one
    worker per rank holding both (:mod:`rollart.training.colocated`); the engines and the trainer take
    turns on the devices and the weights never leave a rank's process."""

    kind = "inprocess"

    def __init__(self, config: Any, train: Any, infer: Any, *, clock: PolicyClock):
        super().__init__(config, train, infer, clock=clock)
        if infer is not train:
            raise ValueError("weights.channel inprocess: the inference Cluster must be the trainer's (colocated mode)")
        self.suspended: WeightTarget | None = None  # the rollout while the trainer holds the devices
        self.ranks: list[dict[str, Any]] = []  # each rank's record of the last step

    async def before_train(self, rollout: WeightTarget) -> None:
        """Every request in flight preempted (callers keep their tokens), new ones held, every engine asleep."""
        await rollout.suspend()
        self.suspended = rollout
        await self.train.sleep_engine()

    async def push(self, rollout: WeightTarget, version: int) -> int:
        await rollout.serve_weights_in_process(lambda: self.train.wake_engine(version, blocking=False), version)
        return version

    async def sync(self, rollout: WeightTarget, version: int) -> int:
        """Every engine wakes with its trainer's weights as ``version``; the rollout resumes under it."""
        self.ranks = await rollout.swap_in_process(lambda: self.train.wake_engine(version, blocking=False), version)
        self.suspended = None
        return version

    async def stop_loading(self) -> None:
        """A step failed while the engines slept: the held requests go on (a sleeping engine refuses them,
        so their trajectories end) instead of waiting for a wake-up that will not come."""
        rollout, self.suspended = self.suspended, None
        if rollout is not None:
            await rollout.resume()

    def record(self) -> dict[str, Any]:
        """``colocated``: per rank, when its engine generated, when it trained and slept (its process's
        monotonic clock), and what the engine held (see :class:`rollart.training.colocated.PhaseLog`)."""
        if not self.ranks:
            return {}
        return {
            "colocated": {
                "ranks": self.ranks,
                "sleep_s": max(r["sleep_s"] for r in self.ranks),
                "wake_s": max(r["wake_s"] for r in self.ranks),
            }
        }


class ChannelSync(WeightSync):
    """A channel the trainer publishes to and every worker fetches from itself."""

    channel: WeightChannel

    async def push(self, rollout: WeightTarget, version: int) -> int:
        # written before the workers load it: a failed write is this call's error, not their timeout
        version = await self.train.publish_to(self.channel, True, self.bucket_bytes, blocking=False)
        await rollout.serve_weights_from(self.channel, version)
        return version


class DistSync(ChannelSync):
    """``weights.channel: dist``: a torch.distributed broadcast from the trainer to every worker."""

    kind = "dist"

    @classmethod
    def build(cls, config: Any, train: Any, infer: Any, *, name: str, out_dir: Path, clock: PolicyClock) -> WeightSync:
        return cls(config, train, infer, name, clock=clock)

    def __init__(self, config: Any, train: Any, infer: Any, name: str, *, clock: PolicyClock):
        from rollart.weights.dist_channel import TorchBroadcastChannel

        super().__init__(config, train, infer, clock=clock)
        wc = config.weights
        self.channel = TorchBroadcastChannel(
            name, num_receivers=len(infer.workers), bucket_bytes=wc.bucket_mb << 20, timeout_s=wc.timeout_s
        )

    async def push(self, rollout: WeightTarget, version: int) -> int:
        return await self._publish_while(rollout.serve_weights_from(self.channel, version), wait=True)

    async def sync(self, rollout: WeightTarget, version: int) -> int:
        return await self._publish_while(
            rollout.sync_weights(None, version, channel=self.channel), wait=not self.config.weights.async_publish
        )

    async def _publish_while(self, receive: Awaitable[None], wait: bool) -> int:
        """A broadcast sends only while its receivers take part, and a sharded trainer (every rank gathers,
        rank 0 sends) publishes before its call returns: the workers receive while the trainer sends.
        ``version`` (the trainer's, which the driver gave the step) is what the workers are told to expect."""
        publishing = asyncio.ensure_future(self.train.publish_to(self.channel, wait, self.bucket_bytes, blocking=False))
        try:
            await receive
        except BaseException:
            # the send fails on the channel's timeout once no receiver comes: logged, the receive's error is raised
            publishing.add_done_callback(_log_failed_publish)
            raise
        return int(await publishing)

    def close(self) -> None:
        self.channel.destroy()  # its coordinator goes with the pipeline: a later job of this name starts anew


def _log_failed_publish(publishing: asyncio.Future[Any]) -> None:
    if not publishing.cancelled() and publishing.exception() is not None:
        log.warning("weights: the publish of a sync whose receive failed also failed: %s", publishing.exception())


class MooncakeSync(ChannelSync):
    """``weights.channel: mooncake``: versions published to a Mooncake store and loaded in the
    background, the newest first.

    The channel's keys live under a name of this trainer incarnation (a new one after a trainer restart,
    and after a driver restart): the keys a dead trainer published stay registered in its dead segment
    until the master notices, and a successor that read or overwrote them (``latest``, the index, a
    version number it publishes again) would wait on that segment."""

    kind = "mooncake"

    @classmethod
    def build(cls, config: Any, train: Any, infer: Any, *, name: str, out_dir: Path, clock: PolicyClock) -> WeightSync:
        return cls(config, train, infer, name, out_dir, clock=clock)

    def __init__(self, config: Any, train: Any, infer: Any, name: str, out_dir: Path, *, clock: PolicyClock):
        super().__init__(config, train, infer, clock=clock)
        self.base_name, self.out_dir = name, out_dir
        self.master: Any = None  # the Mooncake master rollart started (none given in weights.mooncake_master)
        self.retired: list[str] = []  # the names of the channels trainer restarts replaced
        self.channel = self._new_channel()

    def _new_channel(self) -> WeightChannel:
        from rollart.resource_manager.net import node_ip
        from rollart.weights.host_cache import HostSharedChannel
        from rollart.weights.mooncake_channel import MooncakeChannel
        from rollart.weights.mooncake_master import MooncakeMaster

        wc = self.config.weights
        name = f"{self.base_name}-{uuid.uuid4().hex[:8]}"
        master = wc.mooncake_master
        # none given: rollart starts one (once per job) on the head host, the driver's, reachable by every host
        if master is None and self.master is None:
            self.master = MooncakeMaster(host=node_ip(), log_dir=self.out_dir).start()
        if master is None:
            master = self.master.address
        channel = MooncakeChannel(
            name,
            master,
            keep=wc.keep,
            chunk_mb=wc.chunk_mb,
            segment_mb=wc.segment_mb,
            timeout_s=wc.timeout_s,
            protocol=wc.protocol,
            rdma_devices=wc.rdma_devices,
        )
        if not wc.host_shared:
            return channel
        return HostSharedChannel(channel, keep=wc.keep, relay=self._relay_order() if wc.relay else None)

    def _relay_order(self) -> list[str]:
        """The inference hosts' IPs in relay-tree order: the trainer's host first when it also runs
        inference workers (its copy is local), then the others in worker order (where each Cluster
        recorded its workers when they started)."""
        trainer_ip = self.train.node_ip_of(0)
        hosts = list(dict.fromkeys(p["node_ip"] for p in self.infer.placement()))
        return sorted(hosts, key=lambda ip: ip != trainer_ip)

    async def start(self, rollout: WeightTarget) -> None:
        """Every host joins the store now."""
        await self._start_host_caches()
        await self.infer.warm_channel(self.channel)

    async def _start_host_caches(self) -> None:
        """The driver makes each inference host's weight cache, so a cache (and the relay copy its
        children read) outlives the death of the worker on its host."""
        from rollart.weights.host_cache import HostSharedChannel

        if isinstance(self.channel, HostSharedChannel):
            # a worker down now (restarting, its host lost) is skipped: its host's first reader makes that cache
            nodes = [p["node_id"] for p in self.infer.placement() if p["alive"]]
            await asyncio.to_thread(self.channel.start_caches, list(dict.fromkeys(nodes)))

    def host_joined(self, node_id: str) -> None:
        """The new host's weight cache, made by the driver (so it outlives the workers of that host)."""
        from rollart.weights.host_cache import HostSharedChannel

        if isinstance(self.channel, HostSharedChannel):
            self.channel.start_caches([node_id])

    def host_left(self, node_id: str) -> None:
        """The host's weight cache ends with its last worker: a drained node must run nothing of the job."""
        from rollart.weights.host_cache import HostSharedChannel

        if isinstance(self.channel, HostSharedChannel):
            self.channel.end_cache(node_id)

    async def sync(self, rollout: WeightTarget, version: int) -> int:
        """The driver does not wait: the loader serves the newest version."""
        if self.loader is None:
            channel = self.channel
            self.loader = NewestVersionLoader(
                lambda v: rollout.sync_weights(None, v, channel=channel), served=self.clock.served
            )
        version = await self.train.publish_to(
            self.channel, not self.config.weights.async_publish, self.bucket_bytes, blocking=False
        )
        self.loader.offer(version)  # raises a failed load of an earlier version
        return version

    async def trainer_restarted(self) -> WeightChannel | None:
        """A channel under a new name and its host caches; the old one is returned, to be retired once
        the recovery version is served from the new one."""
        old, self.channel = self.channel, self._new_channel()
        assert old is not None
        self.retired.append(old.name)
        log.info("weights: trainer restarted; channel %s replaces %s", self.channel.name, old.name)
        await self._start_host_caches()
        return old

    async def retire(self, old: WeightChannel) -> None:
        """Every reader stops reading the old channel (a load of the dead trainer's last version, which
        may never come, fails now instead of after ``weights.timeout_s``), then its host caches are
        retired (their memory and relay copies go). After the new version is served: a worker whose
        restart was loading the old version then loads the new one."""
        from rollart.weights.host_cache import HostSharedChannel

        if isinstance(old, HostSharedChannel):
            await self.infer.retire_channel(old.name)  # first: no reader makes a new cache of the old one
            await asyncio.to_thread(old.close_caches)

    def close(self) -> None:
        if self.master is not None:
            self.master.stop()


def weight_sync(config: Any, train: Any, infer: Any, *, job_id: str, out_dir: Path, clock: PolicyClock) -> WeightSync:
    """The :class:`WeightSync` of ``config.weights.channel`` (its registered kind,
    :mod:`rollart.weights.kinds`) for the trainer Cluster ``train`` and the inference Cluster ``infer`` of
    job ``job_id`` (channel names start with it), reading the run's policy versions from ``clock``."""
    kind = channel_kind(config.weights.channel)
    if kind is None:
        raise ValueError(f"weights.channel: {channel_name_problem(config.weights.channel)}")
    cls = kind.sync_class()
    if not (isinstance(cls, type) and issubclass(cls, WeightSync)):
        raise ValueError(f"weights.channel: {kind.name}: {cls!r} is not a WeightSync subclass")
    return cls.build(config, train, infer, name=f"{job_id}-actor", out_dir=out_dir, clock=clock)
