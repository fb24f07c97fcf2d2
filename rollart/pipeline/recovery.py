"""Supervision of a pipeline's trainer side (the actor's trainer, and the reference and critic when the
config has them): finding a dead rank — in the error a step raised, or by probing while the driver
waits for a batch — spending the role's ``fault:`` budget, rebuilding the ranks, and the record of each
recovery. What the pipeline restores after a rebuild (checkpoint, rollout, weights) is its own."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from rollart.cluster.errors import WorkerDiedError
from rollart.cluster.fault import RoleBudgets
from rollart.training.placement import start_data_parallel

log = logging.getLogger(__name__)

TRAINER_PROBE_S = 5.0  # while a batch fills for longer than this, the trainer side is probed (and as often)
T = TypeVar("T")


class TrainerSupervisor:
    """The trainer-side Clusters of a pipeline (``ref`` and ``critic`` may be None) under the restart
    policies of ``fault`` (a :class:`~rollart.cluster.config.FaultConfig`)."""

    def __init__(self, fault: Any, train: Any, ref: Any = None, critic: Any = None, *, ref_sharded: bool = False):
        self.train, self.ref, self.critic = train, ref, critic
        self.ref_sharded = ref_sharded  # a sharded reference is a process group: rebuilt whole, like the trainer
        self.budgets = RoleBudgets(fault)
        self.recoveries: list[dict[str, Any]] = []  # one entry per recovery

    def clusters(self) -> dict[str, tuple[str, Any]]:
        """Cluster name → (role, Cluster) of the trainer side."""
        out = {self.train.name: ("train", self.train)}
        for role, cl in (("reference", self.ref), ("critic", self.critic)):
            if cl is not None:
                out[cl.name] = (role, cl)
        return out

    async def wait_probing(self, result: Awaitable[T]) -> T:
        """``result`` (e.g. the next batch). While it is not ready, the trainer side is probed every
        ``TRAINER_PROBE_S``: a rank that dies while the driver waits for rollouts would otherwise be
        found only at its next call, after the batch, and the batch may never fill without it (an
        inference worker restarting loads the version the dead trainer was still publishing)."""
        task = asyncio.ensure_future(result)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=TRAINER_PROBE_S)
                if done:
                    return task.result()
                died = await self.probe()
                if died is not None:
                    raise died
        finally:
            if not task.done():
                task.cancel()

    async def probe(self) -> WorkerDiedError | None:
        """A trainer-side rank Ray reports dead (a rank busy or briefly unreachable counts as alive)."""
        import ray

        for _, cluster in self.clusters().values():
            for rank, actor in enumerate(cluster.workers):
                if actor is None:
                    continue
                try:
                    await asyncio.wait_for(actor._rollart_ping.remote(), TRAINER_PROBE_S)
                except (TimeoutError, ray.exceptions.ActorUnavailableError):
                    continue
                except ray.exceptions.RayActorError as err:
                    log.error("%s rank %d found dead while the rollout filled a batch: %r", cluster.name, rank, err)
                    return cluster._died(rank, err)
        return None

    def death(self, err: BaseException) -> WorkerDiedError | None:
        """The dead trainer-side rank behind ``err``: a ``WorkerDiedError`` of one of those clusters in
        its chain, or, for another Ray error (e.g. weights owned by a dead rank), a rank a health check
        finds dead. None when no trainer-side rank died."""
        import ray

        clusters = self.clusters()
        seen: BaseException | None = err
        while seen is not None:
            if isinstance(seen, WorkerDiedError) and seen.cluster in clusters:
                return seen
            seen = seen.__cause__ or seen.__context__
        if isinstance(err, ray.exceptions.RayError):
            for _, cluster in clusters.values():
                for rank, alive in cluster.health_check().items():
                    if not alive:
                        return cluster._died(rank, err)
        return None

    async def rebuild(self, died: WorkerDiedError, err: BaseException, step: int) -> dict[str, Any]:
        """Within the dead rank's role policy (else :class:`~rollart.cluster.fault.TrainerFailed` with the
        cause): after the policy's backoff, every trainer and critic rank anew in its bundle and the dead
        reference ranks. Returns the start of this recovery's record (completed by :meth:`recovered`)."""
        role = self.clusters()[died.cluster][0]
        where = f"{died.cluster} on {died.hardware}, host {died.node_ip or '?'}"
        t0 = time.monotonic()
        backoff = self.budgets.take(role, died.rank, err, where=where)
        log.error("%s rank %d died at step %d (%s): %r; restarting", role, died.rank, step, where, err)
        await asyncio.sleep(backoff)
        await asyncio.to_thread(self._rebuild_ranks)
        return {
            "role": role,
            "cluster": died.cluster,
            "rank": died.rank,
            "host": died.node_ip,
            "cause": repr(err),
            "failed_step": step,
            "t0": t0,
        }

    def _rebuild_ranks(self) -> None:
        """Every trainer and critic rank anew in its bundle (a DDP group cannot go on with one rank
        replaced) and a new rendezvous; the dead reference ranks anew (they hold no state)."""
        for cluster in (self.train, self.critic, self.ref if self.ref_sharded else None):
            if cluster is None:
                continue
            for rank in range(cluster.world_size):
                cluster.restart_worker(rank)
            start_data_parallel(cluster)
        if self.ref is not None and not self.ref_sharded:
            for rank, alive in self.ref.health_check().items():
                if not alive:
                    self.ref.restart_worker(rank)

    def recovered(self, record: dict[str, Any], **restored: Any) -> None:
        """Log and keep the record of a finished recovery (``restored``: restored_step, checkpoint, version)."""
        t0 = record.pop("t0")
        self.recoveries.append({**record, **restored, "seconds": time.monotonic() - t0})
        log.warning("trainer side restored: %s", self.recoveries[-1])
