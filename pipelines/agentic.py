"""The agentic / RLVR pipeline, built from Clusters (RollArt paper §5.3, Figure 8).

    rollout (EnvManagers → LLMProxy → inference Cluster) ──► SampleBuffer ──get_batch──► train Cluster
                          ▲                                                                 │
                          └──────────── suspend · model_update(weights, v+1) · resume ◄─────┘

One class serves RLVR (single-turn verifiable tasks) and multi-turn agentic tasks, synchronous
(``rollout.alpha = 0``) and asynchronous (``alpha >= 1``): rollout keeps running while the trainer
trains; only the weight swap pauses it.

The class keeps the step loop and the wiring; its parts are in :mod:`rollart.pipeline`: the weight path
of ``weights.channel`` (:mod:`~rollart.pipeline.weight_sync`: ``ray`` and ``dist`` make the driver
wait until every worker serves the new version, ``mooncake`` hides the transfer behind training, seed
004 §5.2, §7.3), trainer supervision (:mod:`~rollart.pipeline.recovery`), checkpoints, reward services
and the step records. The α bound is checked against the trainer's version, not the served one: a
batch trained at version ``v`` holds only groups begun at ``>= v - alpha``, where a group's version is
the one every worker served when it began (workers only move forward), and every token records the
version that produced it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from rollart.cluster.errors import WorkerDiedError
from rollart.config import PipelineConfig
from rollart.data.evaluation import Evaluator
from rollart.data.sampler import RoundSeeds
from rollart.pipeline.checkpoints import Checkpoints, pipeline_extra, restore_pipeline_extra
from rollart.pipeline.clusters import start_clusters
from rollart.pipeline.env_groups import EnvGroups
from rollart.pipeline.heap import setup_objects_frozen
from rollart.pipeline.interrupt import Interrupt, StopChoice
from rollart.pipeline.progress import StepProgress
from rollart.pipeline.records import (
    MetricsFile,
    StepTimes,
    batch_statistics,
    pool_devices,
    step_cost,
    step_record,
    task_record,
    trajectory_cost,
    write_cost,
    write_ledger,
)
from rollart.pipeline.recovery import TrainerSupervisor
from rollart.pipeline.rewards import RewardServices
from rollart.pipeline.startup import StartupTimeline
from rollart.pipeline.weight_sync import WeightSync, weight_sync
from rollart.pipelines.data_tasks import DataTasks, eval_sets
from rollart.rollout.async_controller import AsyncController
from rollart.rollout.elastic import ElasticRollout
from rollart.rollout.env_manager import HFCodec
from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.policy_clock import PolicyClock
from rollart.rollout.sample_buffer import Group
from rollart.rollout.scheduler import RolloutScheduler
from rollart.tracking.spans import span_export
from rollart.tracking.traces import TraceWriter
from rollart.training import columns as C
from rollart.training.batch_record import BatchRecorder
from rollart.training.data import add_advantages, trajectories_to_batch
from rollart.training.export import write_chat_template
from rollart.weights.kinds import WEIGHT_CHANNELS

log = logging.getLogger(__name__)

__all__ = ["AgenticPipeline", "batch_statistics"]


class AgenticPipeline:
    def __init__(self, config: PipelineConfig, *, resume: bool = False, progress: bool = True):
        self.startup = StartupTimeline()  # the command to the first step, in phases: RUN_DIR/startup.json
        # SIGINT stops the run at the next step boundary at the latest; when cheap, after a checkpoint there
        self.interrupt = Interrupt(on_first=self._on_first_sigint)
        self.config = config
        self.out_dir = config.out_dir.resolve()  # absolute: Ray (a submitted job) may change the working directory
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self.model_path = self._model_path()
        self.stop_choice = StopChoice(self.model_path)  # what the first Ctrl-C does (its costs, measured)
        self.stopped_after: int | None = None  # a Ctrl-C let the step finish: the run stopped after it
        self.clock = PolicyClock()  # the run's trained and served policy versions, in one place
        # dataset tasks (data:) and eval sets (eval:) load first: a bad file, column, verifier or eval env
        # fails here, before any actor starts
        seeds = RoundSeeds(config.seed)  # round r of env group g plays seed seeds.seed(g, r)
        held_out = self._load_tasks(seeds)
        self._start_clusters(resume)
        self.weights: WeightSync = weight_sync(
            config, self.train, self.infer, job_id=self.rm.job_id, out_dir=self.out_dir, clock=self.clock
        )
        self._start_rollout(seeds, held_out)
        self.start_step = 0
        self.metrics = MetricsFile(self.out_dir)
        self.metrics_path = self.metrics.path
        self.plot_path: Path | None = None
        self.export_path: Path | None = None  # RUN_DIR/hf once the run finished (export.hf)
        self.stopped_at: int | None = None  # the step (from 1) after which stop_at ended the run early
        self.checkpoints = Checkpoints(self.out_dir, config.checkpoint_keep)
        # trainer supervision (fault.train / reference / critic): one entry per recovery
        self.supervisor = TrainerSupervisor(
            config.fault, self.train, self.ref, self.critic, ref_sharded=config.train.sharding == "fsdp"
        )
        self.step_in_progress = 0
        self._data_state0 = self.data_tasks.state_dict() if self.data_tasks.samplers else None
        if resume:
            self._resume()
            self.metrics.drop_from(self.start_step)
        else:
            self.metrics.reset()
        # trajectory traces (traces:): the rollout emits into the writer, the step loop writes them out
        tc = config.traces
        self.traces = (
            TraceWriter(
                self.out_dir,
                sample=tc.sample,
                seed=config.seed,
                max_mb=tc.max_mb,
                resume=resume,
                spans=span_export(tc, seed=config.seed, service=config.name),
            )
            if tc.enabled
            else None
        )
        self.scheduler.traces = self.traces
        # the batch record (record_batches:): every trained batch, for `rollart replay`
        self.batch_record = self._batch_recorder(resume) if config.record_batches else None
        self._trained_batch: Any = None  # the last step's batch, handed to the record after the step
        self._saved_through = self.start_step  # steps done when the last checkpoint was written

    @property
    def train_version(self) -> int:
        """The trainer's policy version (one per step; the served one may lag it): the run's clock's."""
        return self.clock.trained

    # ------------------------------------------------------------------ wiring
    def _model_path(self) -> str:
        """``model:``, or the built-in tiny model (built offline on first use)."""
        if self.config.model is not None:
            return self.config.model
        from rollart.models import default_tiny_path

        return str(default_tiny_path(**self.config.tiny_model))

    def _batch_recorder(self, resume: bool) -> BatchRecorder:
        """``RUN_DIR/batches/``: the trainer's resolved config and ranks first, then each step's batch."""
        cfg = self.config
        train_cfg = cfg.train.model_copy(update={"model": cfg.train.model or self.model_path})
        trainer = {
            "name": cfg.name,
            "train": train_cfg.model_dump(mode="json"),
            "ranks": self.train.world_size,
            "threads": self.train.torch_threads()[0],  # a CPU rank's sums depend on its thread count
            "colocated": cfg.colocated,
            "critic": self.critic is not None,
        }
        return BatchRecorder(self.out_dir, trainer, keep_through=self.start_step if resume else 0)

    def _load_tasks(self, seeds: RoundSeeds) -> list:
        """The dataset tasks (``data:``; a task's ``sampling.max_new_tokens`` is its generation budget)
        and the held-out eval sets (``eval:``)."""
        config = self.config
        self.quotas = config.task_quotas()  # groups of each task tag per batch (tasks.*.ratio), or None
        data = [
            t.model_copy(update={"max_new_tokens": t.max_new_tokens or config.task_sampling(t.name).max_new_tokens})
            if t.name in config.tasks
            else t
            for t in config.data
        ]
        self.data_tasks = DataTasks(data, seeds, run_seed=config.seed, max_new_tokens=config.sampling.max_new_tokens)
        if config.eval is None:
            return []
        return eval_sets(data, config.eval, max_new_tokens=config.sampling.max_new_tokens)

    def _start_clusters(self, resume: bool) -> None:
        """The job's pools and Clusters (:func:`~rollart.pipeline.clusters.start_clusters`); the
        running-mean baseline."""
        config = self.config
        jc = start_clusters(
            config, out_dir=self.out_dir, model_path=self.model_path, startup=self.startup, resume=resume
        )
        self.rm, self.train, self.infer, self.ref, self.critic = jc.rm, jc.train, jc.infer, jc.ref, jc.critic
        self.baseline = None
        if config.advantage == "running_mean":  # critic-free single-rollout baseline, kept across steps
            from rollart.algorithms import RunningMeanBaseline

            self.baseline = RunningMeanBaseline(config.running_mean.window, config.running_mean.scope)
        self.startup.clusters_ready(c for c in (self.infer, self.train, self.ref, self.critic) if c is not None)

    def _start_rollout(self, seeds: RoundSeeds, held_out: list) -> None:
        """The LLMProxy over the inference Cluster, the reward services, the envs (local or on env
        servers) and their EnvManagers in groups, the evaluator, the scheduler and its controller."""
        from transformers import AutoTokenizer

        config = self.config
        # a restarted inference worker loads the served version, where the channel serves workers that
        # start later (ray, mooncake; a dist broadcast needs every receiver at once, so with it dead workers
        # are not restarted; colocated engines are trainer ranks, restored by the trainer's fault policy)
        restart = config.fault.inference if WEIGHT_CHANNELS[config.weights.channel].serves_joiners else None
        affinity = None
        if config.routing.auto:  # @hw_mapping / tags: are the default order and its bounds
            from rollart.rollout.affinity import AutoAffinity

            spec = self.infer.methods["generate"].hw_mapping
            assert spec is not None
            affinity = AutoAffinity(spec.preference, config.routing)
        self.proxy = LLMProxy(
            self.infer,
            restart=restart,
            affinity=affinity,
            batch_requests=config.engine.batch_requests,
            clock=self.clock,
        )
        # an elastic rollout pool (max_devices) grows and shrinks while the job runs; its hosts tell the weight path
        elastic = self.rm.specs[config.rollout_pool].elastic
        self.elastic = (
            ElasticRollout(self.rm, self.infer, self.proxy, config.elastic, out_dir=self.out_dir, hosts=self.weights)
            if elastic
            else None
        )
        self.codec = HFCodec(AutoTokenizer.from_pretrained(self.model_path))
        self.rewards = RewardServices(config, self.rm.job_id, self.codec)
        envs = EnvGroups(
            config,
            self.rm,
            self.proxy,
            self.codec,
            self.rewards,
            model_path=self.model_path,
            version_fn=lambda: self.scheduler.version,
        )
        self.env_pools, self.endpoint, self.envs = envs.env_pools, envs.endpoint, envs
        groups = envs.env_groups()
        # the dataset tasks' groups follow the envs' groups; the eval runs on the same proxy
        groups += self.data_tasks.groups(envs.manager, config.rollout.group_size, first_group=len(groups))
        self.evaluator = (
            None if config.eval is None else Evaluator(config.eval, held_out, envs.manager, config.sampling)
        )
        rollout_cfg = config.rollout
        policies = {c.on_failure for c in [config.reward, *(t.reward for t in config.tasks.values())] if c is not None}
        if policies:  # one policy per job (the config checks that the tasks' rewards agree)
            rollout_cfg = rollout_cfg.model_copy(update={"requeue_reward_failures": "requeue" in policies})
        self.scheduler = RolloutScheduler(groups, rollout_cfg, seed_fn=seeds.seed, quotas=self.quotas, clock=self.clock)
        self.controller = AsyncController(self.scheduler, self.proxy)

    # ------------------------------------------------------------------ weights
    async def _push_resumed_weights(self) -> int:
        """Before the rollout starts: every inference worker serves the trainer's weights."""
        version = await self.weights.push(self.controller, self.train_version)
        self.scheduler.resume_at(version)
        return version

    async def _sync_weights(self) -> tuple[int, float]:
        """Publish the trainer's current weights and make them the serving policy; returns the version
        and the seconds the driver waited for it (mooncake: only for the previous version's fetch)."""
        t0 = time.monotonic()
        version = await self.weights.sync(self.controller, self.train_version)
        waited = time.monotonic() - t0
        if self.weights.loader is None:  # the channel waited until every worker serves it
            await self.on_weights_served(version)
        return version, waited

    async def _await_loading(self) -> None:
        """Wait until every worker serves the newest published version; re-raise a failure."""
        await self.weights.wait()
        if self.weights.loader is not None:  # a background load: the newest version is served everywhere now
            await self.on_weights_served(self.weights.loader.served)

    # ------------------------------------------------------------------ hooks (override in a subclass)
    async def on_run_start(self) -> None:
        """The run's Clusters serve and its steps are about to begin (the rollout starts with them)."""

    async def on_batch(self, step: int, groups: list[Group]) -> None:
        """Step ``step`` (counted from 0) has its batch (``groups`` of trajectories, in a fixed order),
        before anything of the step computes on the trainer's devices; the rollout goes on meanwhile."""

    async def on_step_end(self, step: int, record: dict[str, Any], trajs: list[Any]) -> None:
        """Step ``step`` (counted from 0; ``record["step"]`` is ``step + 1``) trained on ``trajs`` and synced
        its weights; its record is complete and not written yet: add keys to it, look at the trajectories,
        act on the run (a fault test kills a worker here). An exception ends the run as a failed step does."""

    async def on_weights_served(self, version: int) -> None:
        """Every inference worker serves ``version``: after each sync on the channels that wait for it (ray,
        dist, inprocess, none); on a channel that loads in the background (mooncake) each time the run waits
        for the loading (before an evaluation, at the run's end)."""

    async def on_trainer_recovered(self, recovery: dict[str, Any]) -> None:
        """A dead trainer-side rank was rebuilt, the restored weights are served and the run goes on from
        ``recovery["restored_step"]`` (``recovery`` is the entry just added to :attr:`recoveries`)."""

    async def _make_batch(self, groups: list) -> tuple[Any, Any]:
        """The training batch, built once, then its advantages; with ``advantage: gae`` the critic scores
        it first (skip-observation GAE) and its K value updates start on it, running beside the actor's
        update (returned as a future)."""
        batch = trajectories_to_batch(groups, advantage=None)
        if self.critic is None:
            adv = self.config.advantage
            return add_advantages(batch, adv, baseline=self.baseline, params=self.config.advantage_params), None
        assert self.config.critic is not None
        values = await self.critic.compute_values(batch, blocking=False)
        add_advantages(batch, "gae", values=values, **self.config.critic.gae_kwargs())
        return batch, self.critic.train_step(batch, blocking=False)

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_root(self) -> Path:
        return self.checkpoints.root

    @property
    def checkpoint_path(self) -> Path:
        """The checkpoint ``--resume`` starts from (see :attr:`Checkpoints.path`)."""
        return self.checkpoints.path

    @property
    def critic_checkpoint_path(self) -> Path:
        return self.checkpoints.critic_path(self.checkpoint_path)

    def _checkpoint_extra(self, step: int) -> dict[str, Any]:
        return pipeline_extra(step, self.scheduler, self.data_tasks, self.baseline)

    async def _save_checkpoint(self, step: int) -> None:
        """The checkpoint after ``step`` (0-based), timed: what a Ctrl-C checkpoint costs."""
        t0 = time.monotonic()
        await self.checkpoints.save(step, self._checkpoint_extra(step), self.train, self.critic)
        self.stop_choice.saved(time.monotonic() - t0)
        self._saved_through = step + 1

    def _on_first_sigint(self) -> bool:
        """The first Ctrl-C (on the event loop): finish the step in progress and checkpoint when cheap."""
        step = self.step_in_progress
        latest = self.checkpoints.latest()
        finish, message = self.stop_choice.decide(step + 1, step - self._saved_through, latest.name if latest else None)
        log.info("%s", message)
        return finish

    async def _checkpoint_on_stop(self, step: int) -> None:
        """Stopping at the boundary before ``step`` (0-based) after a Ctrl-C let the step before it finish:
        its checkpoint, unless it has one."""
        if step > self._saved_through:
            await self._save_checkpoint(step - 1)
        self.stopped_after = step

    def _resume(self) -> None:
        if not self.checkpoint_path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint under {self.checkpoint_root}; run without --resume first")
        state = self.train.load_checkpoint(str(self.checkpoint_path))[0]
        self._restore_extra(state["extra"], self.critic_checkpoint_path, self.scheduler)
        self.clock.restored(int(state["version"]))
        version = asyncio.run(self._push_resumed_weights())
        log.info("resumed from %s after step %d (policy version %d)", self.checkpoint_path, self.start_step, version)

    def _restore_extra(self, extra: dict[str, Any], critic_path: Path, scheduler: RolloutScheduler) -> None:
        """The pipeline's side of a checkpoint (:func:`~rollart.pipeline.checkpoints.restore_pipeline_extra`)."""
        self.start_step = restore_pipeline_extra(
            extra,
            scheduler=scheduler,
            data_tasks=self.data_tasks,
            baseline=self.baseline,
            critic=self.critic,
            critic_path=critic_path,
            source=self.checkpoint_path,
        )

    # ------------------------------------------------------------------ trainer supervision
    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """One entry per trainer-side recovery."""
        return self.supervisor.recoveries

    async def _run(self) -> list[dict[str, Any]]:
        """The steps; a trainer, reference or critic rank that dies is handled by its ``fault:`` policy
        (:meth:`_recover_training`), then the steps go on from the restored checkpoint."""
        history: list[dict[str, Any]] = []
        self.startup.mark("run_began")
        await self.envs.start()  # what agent envs play through: the policy endpoint, harness processes
        if self.elastic is not None:
            self.elastic.start()
        await self.on_run_start()
        try:
            while True:
                try:
                    with setup_objects_frozen():  # full collections in the steps walk only what they made
                        return await self._run_steps(history)
                except Exception as err:
                    died = self.supervisor.death(err)
                    if died is None:
                        raise
                    await self._recover_training(died, err, history)
        finally:
            if self.elastic is not None:
                self.elastic.stop()
            await self.envs.stop()

    async def _recover_training(self, died: WorkerDiedError, err: BaseException, history: list) -> None:
        """A trainer-side rank died: within its role's policy, rebuild every trainer (and critic) rank in
        its placement bundle and the dead reference ranks, reload the latest checkpoint (or the initial
        weights), rewind the rollout to it (the rounds trained since are played again; the consumed
        rounds of the checkpoint make sure none is trained twice) and push the reloaded weights to the
        inference workers as a new version. Past the policy: :class:`TrainerFailed` with the cause."""
        # the failed step as metrics.jsonl counts steps: from 1
        record = await self.supervisor.rebuild(died, err, self.step_in_progress + 1)
        ckpt = self.checkpoints.latest()
        old = self.scheduler
        new = RolloutScheduler(old.groups, old.config, seed_fn=old.seed_fn, quotas=self.quotas, clock=self.clock)
        if ckpt is not None:
            state = (await self.train.load_checkpoint(str(ckpt), blocking=False))[0]
            self._restore_extra(state["extra"], self.checkpoints.critic_path(ckpt), new)
        else:  # no checkpoint yet: the rebuilt ranks hold the initial weights; the run starts over
            self._restore_initial()
        new.carry_counts(old)  # the live counters go on; what the rewind undid is counted, not erased
        new.traces = old.traces
        self.scheduler = new
        self.controller = AsyncController(new, self.proxy)
        await self.weights.reset()  # a load of the dead trainer's versions goes nowhere now
        # the reloaded weights go out under a version newer than any served before (workers only move forward)
        version = self.clock.after_restart()
        await self.train.set_version(version, blocking=False)
        old_channel = await self.weights.trainer_restarted()  # mooncake: the new trainer publishes under new keys
        await self._push_resumed_weights()
        if old_channel is not None:
            await self.weights.retire(old_channel)
        await self.proxy.resume()  # in case the death came between a suspend and its resume
        history[:] = [h for h in history if h["step"] <= self.start_step]
        if self.batch_record is not None:  # the steps after the restored checkpoint are trained again
            self.batch_record.drop_after(self.start_step)
        checkpoint = str(ckpt) if ckpt is not None else None
        self.supervisor.recovered(record, restored_step=self.start_step, checkpoint=checkpoint, version=version)
        await self.on_trainer_recovered(self.recoveries[-1])

    def _restore_initial(self) -> None:
        """The pipeline's state at the start of a fresh run (a trainer restore before any checkpoint)."""
        self.start_step = 0
        if self._data_state0 is not None:
            self.data_tasks.load_state_dict(self._data_state0)
        if self.baseline is not None:
            from rollart.algorithms import RunningMeanBaseline

            self.baseline = RunningMeanBaseline(self.config.running_mean.window, self.config.running_mean.scope)

    # ------------------------------------------------------------------ the loop
    async def _run_steps(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        cfg = self.config
        tracker = self.metrics.tracker(cfg)
        await self.weights.start(self.controller)
        self.controller.start()
        bar = StepProgress(cfg.name, cfg.steps, self.start_step) if self.progress else None
        rewards: deque[float] = deque(maxlen=cfg.stop_at.window)  # stop_at's trailing window
        try:
            for step in range(self.start_step, cfg.steps):
                if self.interrupt.finishing:  # a Ctrl-C let the last step finish: its checkpoint, then stop
                    await self._checkpoint_on_stop(step)
                self.interrupt.check()
                t_step = time.monotonic()
                record = await self._step(step)
                if self.batch_record is not None:  # written by a background thread while the next step runs
                    info = {"version": self.train_version, "extra": copy.deepcopy(self._checkpoint_extra(step))}
                    self.batch_record.record(step + 1, self._trained_batch, info)
                    self._trained_batch = None
                self.stop_choice.step_done(time.monotonic() - t_step)
                if self.startup.mark("first_step"):
                    self.startup.write(self.out_dir)
                history.append(record)
                if len(history) > 2 * cfg.history_keep:  # bounded memory: trimmed in batches, O(1) per step
                    del history[: len(history) - cfg.history_keep]
                tracker.log(record, record["step"])
                if bar is not None:
                    bar.update(record)
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    await self._save_checkpoint(step)
                if self._reached_target(record, rewards) and step + 1 < cfg.steps:
                    self.stopped_at = step + 1
                    log.info(
                        "stop_at: the mean reward of the last %d steps is %.4f >= %s after step %d of %d: the run ends",
                        cfg.stop_at.window,
                        sum(rewards) / len(rewards),
                        cfg.stop_at.reward_mean,
                        step + 1,
                        cfg.steps,
                    )
                    if cfg.checkpoint_every and self._saved_through < step + 1:
                        await self._save_checkpoint(step)  # the run's last step has its checkpoint
                    break
            await self._await_loading()  # the run ends with every worker serving the last version
            if cfg.export.hf and self.start_step < cfg.steps:
                self.export_path = Path(
                    await self.train.export_hf(str((self.out_dir / "hf").resolve()), blocking=False)
                )
                write_chat_template(self.export_path, cfg.serving.chat_template)
        finally:
            await self._end_run(tracker, bar)
        return history

    def _reached_target(self, record: dict[str, Any], rewards: deque[float]) -> bool:
        """Whether ``stop_at`` ends the run after this step (its ``reward_mean`` joins the trailing window)."""
        target = self.config.stop_at.reward_mean
        if target is None:
            return False
        if isinstance(record.get("reward_mean"), int | float):
            rewards.append(float(record["reward_mean"]))
        return len(rewards) == rewards.maxlen and sum(rewards) / len(rewards) >= target

    async def _step(self, step: int) -> dict[str, Any]:
        """One step: the next batch, its advantages, the train step (and the reference's log-probs and
        the critic's update beside it), the weight sync, and the step's record (with an eval when due)."""
        self.step_in_progress = step
        t0 = time.monotonic()
        stale_before = Counter(self.scheduler.staleness)
        task_stale_before = {t: Counter(c) for t, c in self.scheduler.staleness_by_task.items()}
        held_before = self.scheduler.held_back
        devices_before = pool_devices(self.rm)
        busy_before = self.proxy.meter.busy()
        groups = await self.supervisor.wait_probing(self.controller.get_batch(self.train_version))
        self.startup.mark("first_batch")
        held_back = self.scheduler.buffered_by_task()
        # the order groups finished in depends on timing; a fixed order keeps a seeded run repeatable
        groups = sorted((Group(sorted(g, key=lambda t: t.traj_id), g.gid) for g in groups), key=lambda g: g.gid)
        if self.traces is not None:
            self.traces.trained(groups, step=step + 1, version=self.scheduler.last_batch_version)
        t_rollout = time.monotonic() - t0
        staleness = Counter(self.scheduler.staleness) - stale_before
        await self.on_batch(step, groups)
        t1 = time.monotonic()
        await self.weights.before_train(self.controller)  # colocated: the engines give the devices back
        batch, critic_step = await self._make_batch(groups)
        if self.ref is not None:
            batch[C.REF_LOGPROBS] = await self.ref.compute_logprobs(batch, blocking=False)
        train_call = self.train.train_step(batch, blocking=False)
        if self.traces is not None:  # the trace events so far, written while the trainer computes
            self.traces.flush()
        train_metrics = await train_call
        if self.batch_record is not None:
            self._trained_batch = batch
        if critic_step is not None:
            train_metrics.update({f"critic_{k}": v for k, v in (await critic_step).items()})
        t_train = time.monotonic() - t1
        self.clock.step_trained()
        version, t_sync = await self._sync_weights()
        trajs = [t for g in groups for t in g]
        record = self._record(
            step, version, trajs, train_metrics, t_rollout, t_train, t_sync, time.monotonic() - t0, staleness
        )
        record.update(batch_statistics(batch, trajs))
        record.update(self.weights.record())
        record.update(task_record(self.scheduler, groups, task_stale_before, held_back, self.quotas))
        record["trainer_restarts"] = len(self.recoveries)
        # what the step cost: device-seconds per pool, in all and per trained trajectory
        record["cost"] = step_cost(devices_before, pool_devices(self.rm), record["time"]["step_s"], len(trajs))
        # the cost ledger: what the trained trajectories were charged, per task and tag; the pool's busy time
        record["cost"].update(trajectory_cost(groups, self.scheduler, busy_before, self.proxy.meter.busy()))
        if self.elastic is not None:  # the pool's size, workers joined / left / lost during the step
            record["elastic"] = self.elastic.step_metrics()
            if self.elastic.autopilot is not None:  # elastic.autoscale: the step's demand, and a new target
                t = record["time"]
                held = self.scheduler.held_back > held_before  # generation waited at the asynchronous bound
                decision = self.elastic.autoscale_step(record["step"], t["step_s"], t["rollout_wait_s"], held)
                record["elastic"]["held_back"] = held
                record["elastic"]["autopilot"] = decision
        if self.data_tasks.samplers:
            record["data_epoch"] = self.data_tasks.metrics()
        if self.evaluator is not None and self.evaluator.due(step, self.config.steps - 1):
            await self._await_loading()  # evaluate the version every worker serves
            record["eval"] = await self.evaluator.run(step)
        await self.on_step_end(step, record, trajs)
        return record

    async def _end_run(self, tracker: Any, bar: Any) -> None:
        """After the steps, or a failed one: no load waits any more, the rollout stops, the reward
        clients close (rewards in flight are answered and counted first) and ``ledger.json`` is written."""
        try:
            await self.weights.stop_loading()  # a failed step: nothing waits for the fetch any more
            if bar is not None:
                bar.close()
            tracker.close()
            try:
                await self.controller.stop()
            finally:  # rewards in flight are answered (and counted) first
                await self.rewards.aclose()
        finally:  # whatever failed above, the run's account is written
            if self.traces is not None:  # with the events of the rounds the stop ended
                self.traces.close()
            write_ledger(self.out_dir, self.scheduler, self.proxy, self.rewards)
            write_cost(self.out_dir, self.metrics.read())
            if self.batch_record is not None:  # every step's batch is on disk when the run returns
                self.batch_record.close()

    def _record(
        self,
        step: int,
        version: int,
        trajs: list,
        train_metrics: dict,
        t_rollout: float,
        t_train: float,
        t_sync: float,
        t_step: float,
        staleness: Counter,
    ) -> dict[str, Any]:
        """The step's record (:func:`~rollart.pipeline.records.step_record`); :meth:`on_step_end` sees it
        complete."""
        return step_record(
            step=step,
            version=version,
            trajs=trajs,
            train_metrics=train_metrics,
            times=StepTimes(rollout_wait_s=t_rollout, train_s=t_train, weight_sync_s=t_sync, step_s=t_step),
            staleness=staleness,
            scheduler=self.scheduler,
            proxy=self.proxy,
            weight_load_s=self.controller.timings["weight_sync_s"],
            rewards=self.rewards,
        )

    def run(self) -> list[dict[str, Any]]:
        """Train; the records of the last ``history_keep`` steps (every step is in ``metrics.jsonl``)."""
        history = self.interrupt.run(self._run())  # Ctrl-C: KeyboardInterrupt once the step loop stopped
        history = history[-self.config.history_keep :]
        self.plot_path = self.plot(self.step_records())
        return history

    def step_records(self) -> list[dict[str, Any]]:
        """Every step's record from ``metrics.jsonl``, in step order (a step done again after a trainer
        restore: its last record)."""
        return self.metrics.read()

    def plot(self, history: list[dict[str, Any]]) -> Path | None:
        """``metrics.png`` (needs matplotlib: the ``plot`` extra); None when skipped."""
        return self.metrics.plot(history, self.config.name)

    def shutdown(self) -> None:
        for extra in (self.ref, self.critic):
            if extra is not None:
                extra.shutdown()
        if self.elastic is not None:
            self.elastic.stop()
        self.proxy.close()
        self.env_pools.stop()
        self.train.shutdown()
        if self.infer is not self.train:
            self.infer.shutdown()
        self.rm.shutdown()
        self.weights.close()
