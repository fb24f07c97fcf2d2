"""The agentic / RLVR pipeline, built from Clusters (seed 004 §5.3, Figure 8).

    rollout (EnvManagers → LLMProxy → inference Cluster) ──► SampleBuffer ──get_batch──► train Cluster
                          ▲                                                                 │
                          └──────────── suspend · model_update(weights, v+1) · resume ◄─────┘

One class serves RLVR (single-turn verifiable tasks) and multi-turn agentic tasks, synchronous
(``rollout.alpha = 0``) and asynchronous (``alpha >= 1``): rollout keeps running while the trainer
trains; only the weight swap pauses it.

Weight channels (``weights.channel``): ``ray`` and ``dist`` make the driver wait until every worker
serves the new version. ``mooncake`` hides the transfer behind training (seed 004 §5.2, §7.3): the
trainer publishes in the background, and the driver starts the next step at once while every host
fetches the version once from the store (:class:`~rollart.weights.host_cache.HostSharedChannel`) and
every worker swaps it in between two of its engine steps. The driver never waits for it: a serve loop
in the background loads the newest published version on every worker, one at a time; a version
published while another is loading is skipped if a newer one follows before the load ends (two in
flight at most: one loading, the newest waiting), and the run ends with every worker serving the last
one. The α bound is checked against the trainer's version, not the served one: a batch trained at
version ``v`` holds only groups begun at ``>= v - alpha``, where a group's version is the one every
worker served when it began (workers only move forward), and every token records the version that
produced it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

import rollart as ra
from rollart.cluster.errors import WorkerDiedError
from rollart.cluster.fault import RoleBudgets
from rollart.config import PipelineConfig
from rollart.data.evaluation import Evaluator
from rollart.data.sampler import RoundSeeds
from rollart.pipelines.data_tasks import DataTasks, eval_sets
from rollart.rollout.async_controller import AsyncController, NewestVersionLoader
from rollart.rollout.env_manager import EnvManager, HFCodec
from rollart.rollout.inference_worker import inference_worker_class
from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.sample_buffer import Group
from rollart.rollout.scheduler import RolloutScheduler
from rollart.training import columns as C
from rollart.training.data import add_advantages, trajectories_to_batch
from rollart.training.placement import start_data_parallel
from rollart.training.strategies import train_worker_class
from rollart.weights.base import WeightChannel

log = logging.getLogger(__name__)

TRAINER_PROBE_S = 5.0  # while a batch fills for longer than this, the trainer side is probed (and as often)


def _default_tenant(config: PipelineConfig, job_id: str) -> str:
    """The reward service tenant of a job without ``reward.tenant``: ``cluster.job_id``, else the config's
    name when it is a valid tenant label, else the Ray job id."""
    import re

    for candidate in (config.cluster.job_id, config.name):
        if candidate and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", candidate):
            return candidate
    return job_id


def batch_statistics(batch: Any, trajs: list) -> dict[str, Any]:
    """Per-step learning diagnostics: the advantages of the action tokens (mean, std, fraction exactly
    0: tied groups and tied token positions carry no signal) and, for tags with dense credit, the mean
    credit at each action position (for reverse: the accuracy of each answer character)."""
    import torch

    adv = torch.tensor(
        [a for row, mask in zip(batch["advantages"], batch["loss_mask"]) for a, m in zip(row, mask) if m],
        dtype=torch.float64,
    )
    out: dict[str, Any] = {
        "advantage": {
            "mean": float(adv.mean()) if adv.numel() else 0.0,
            "std": float(adv.std(unbiased=False)) if adv.numel() else 0.0,
            "frac_zero": float((adv == 0).double().mean()) if adv.numel() else 0.0,
        }
    }
    sums: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[int]] = defaultdict(list)
    for t in trajs:
        if t.token_rewards is None:
            continue
        credits = [t.token_rewards[i] if i < len(t.token_rewards) else 0.0 for i, m in enumerate(t.loss_mask) if m]
        s, c = sums[t.tag], counts[t.tag]
        for k, x in enumerate(credits):
            if k == len(s):
                s.append(0.0)
                c.append(0)
            s[k] += float(x)
            c[k] += 1
    if sums:
        out["credit_by_position"] = {tag: [x / n for x, n in zip(sums[tag], counts[tag])] for tag in sums}
        out["dead_by_position"] = _dead_by_position(trajs)
    return out


def _dead_by_position(trajs: list) -> dict[str, list[float]]:
    """Per tag and action position: the fraction of groups in which no member got any credit there.
    Such a position is tied, so its group-relative advantage is exactly 0: it learns nothing until a
    member happens to get it right (a position stuck at 1.0 is a plateau)."""
    groups: dict[str, list] = defaultdict(list)
    for t in trajs:
        if t.token_rewards is not None:
            groups[t.group_id].append(t)
    dead: dict[str, list[int]] = defaultdict(list)
    seen: dict[str, list[int]] = defaultdict(list)
    for members in groups.values():
        tag = members[0].tag
        credits = [
            [t.token_rewards[i] if i < len(t.token_rewards) else 0.0 for i, m in enumerate(t.loss_mask) if m]
            for t in members
        ]
        for k in range(max(len(c) for c in credits)):
            d, s = dead[tag], seen[tag]
            if k == len(s):
                d.append(0)
                s.append(0)
            s[k] += 1
            d[k] += all(k >= len(c) or c[k] == 0 for c in credits)
    return {tag: [d / s for d, s in zip(dead[tag], seen[tag])] for tag in seen}


def plot_eval(ax: Any, evals: list[dict[str, Any]]) -> None:
    """Held-out accuracy and mean reward per eval tag, and overall pass@k, against the step."""
    steps = [h["step"] for h in evals]
    tags = sorted({t for h in evals for t in h["eval"]["by_tag"]})
    for tag in tags:
        for key, style in (("accuracy", "o-"), ("mean_reward", "s:")):
            ax.plot(
                steps,
                [h["eval"]["by_tag"].get(tag, {}).get(key, float("nan")) for h in evals],
                style,
                label=f"{tag} {key.replace('_', ' ')}",
            )
    for key in sorted(k for k in evals[-1]["eval"] if k.startswith("pass@")):
        ax.plot(steps, [h["eval"].get(key, float("nan")) for h in evals], "--", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("eval")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()


class AgenticPipeline:
    def __init__(self, config: PipelineConfig, *, resume: bool = False, progress: bool = True):
        from transformers import AutoTokenizer

        from rollart.envs import EnvSpec

        self.config = config
        self.out_dir = config.out_dir.resolve()  # absolute: Ray (a submitted job) may change the working directory
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        model_path = config.model
        if model_path is None:
            from rollart.models import default_tiny_path

            model_path = str(default_tiny_path(**config.tiny_model))
        self.model_path = model_path
        # dataset tasks (data:) and eval sets (eval:) load first: a bad file, column, verifier or eval env
        # fails here, before any actor starts
        seeds = RoundSeeds(config.seed)  # round r of env group g plays seed seeds.seed(g, r)
        self.quotas = config.task_quotas()  # groups of each task tag per batch (tasks.*.ratio), or None
        data = [  # a task's sampling.max_new_tokens is its generation budget
            t.model_copy(update={"max_new_tokens": t.max_new_tokens or config.task_sampling(t.name).max_new_tokens})
            if t.name in config.tasks
            else t
            for t in config.data
        ]
        self.data_tasks = DataTasks(data, seeds, run_seed=config.seed, max_new_tokens=config.sampling.max_new_tokens)
        held_out = (
            [] if config.eval is None else eval_sets(data, config.eval, max_new_tokens=config.sampling.max_new_tokens)
        )
        job_file = self.out_dir / "job_id"  # a --resume is the next attempt of the same job
        job_id = config.cluster.job_id or (job_file.read_text().strip() if resume and job_file.exists() else None)
        self.rm = ra.ResourceManager(
            config.pools,
            job_id=job_id,
            store=config.cluster.metadata_store,
            local_resources=config.cluster.local_resources,
        )
        job_file.write_text(self.rm.job_id + "\n")
        pool_hw = [g.hardware for g in self.rm.specs[config.rollout_pool].groups]
        tags = {k: (v or pool_hw) for k, v in config.tags.items()}
        engine = config.engine.model_copy(update={"model": config.engine.model or model_path})
        self.infer = ra.Cluster(
            "actor_infer",
            inference_worker_class(tags),
            self.rm,
            pool=config.rollout_pool,
            worker_kwargs={"engine": engine.model_dump()},
        )
        train_cfg = config.train.model_copy(update={"model": config.train.model or model_path})
        self.train = ra.Cluster(
            "actor_train",
            train_worker_class(train_cfg.strategy),
            self.rm,
            pool=config.train_pool,
            worker_kwargs={"config": train_cfg.model_dump()},
        )
        start_data_parallel(self.train)
        self.ref = None
        if config.train.kl_coef > 0:  # the frozen initial policy, colocated with the trainer ranks
            from rollart.training.reference import ReferenceWorker

            self.ref = ra.Cluster(
                "reference",
                ReferenceWorker,
                self.rm,
                pool=config.train_pool,
                colocate_with=self.train,
                worker_kwargs={
                    "model": train_cfg.model,
                    "max_tokens_per_microbatch": train_cfg.max_tokens_per_microbatch,
                },
            )
        self.baseline = None
        if config.advantage == "running_mean":  # critic-free single-rollout baseline, kept across steps
            from rollart.algorithms import RunningMeanBaseline

            self.baseline = RunningMeanBaseline(config.running_mean.window, config.running_mean.scope)
        self.critic = None
        if config.advantage == "gae":  # the value model, one rank beside each actor rank
            from rollart.training.critic import CriticWorker

            assert config.critic is not None
            critic_cfg = config.critic.model_copy(update={"model": config.critic.model or model_path})
            self.critic = ra.Cluster(
                "critic",
                CriticWorker,
                self.rm,
                pool=config.train_pool,
                colocate_with=self.train,
                worker_kwargs={"config": critic_cfg.model_dump()},
            )
            start_data_parallel(self.critic)
        # a restarted inference worker loads the served version (ray or mooncake channel; a dist
        # broadcast needs every receiver at once, so with it dead workers are not restarted)
        restart = config.fault.inference if config.weights.channel != "dist" else None
        affinity = None
        if config.routing.auto:  # @hw_mapping / tags: are the default order and its bounds
            from rollart.rollout.affinity import AutoAffinity

            spec = self.infer.methods["generate"].hw_mapping
            assert spec is not None
            affinity = AutoAffinity(spec.preference, config.routing)
        self.proxy = LLMProxy(
            self.infer, restart=restart, affinity=affinity, batch_requests=config.engine.batch_requests
        )
        codec = HFCodec(AutoTokenizer.from_pretrained(model_path))
        self.reward_client = None  # the pipeline's reward: service
        self.reward_clients: dict[str, Any] = {}  # per task tag whose reward comes from a service
        self.codec = codec
        if config.reward is not None:
            self.reward_client = self._reward_client(config.reward)

        def manager(env: Any, sampling: Any = None) -> EnvManager:
            """An EnvManager of ``env`` with its task's sampling settings and reward (``tasks.TAG``)."""
            tag = str(getattr(env, "tag", type(env).__name__))
            return EnvManager(
                env,
                self.proxy,
                codec,
                sampling=sampling if sampling is not None else config.task_sampling(tag),
                config=config.env_manager,
                version_fn=lambda: self.scheduler.version,
                reward_fn=self._task_reward_fn(tag),
            )

        from rollart.envservice.backends import EnvPools

        # remote envs (backend ray / kubernetes): warm env servers per task, started now
        self.env_pools = EnvPools(config.envs, self.rm, plugin_paths=config.train.plugin_paths)
        groups: list[list[EnvManager]] = []
        self.endpoint = self._policy_endpoint() if any(e.agent for e in config.envs) else None
        for index, entry in enumerate(config.envs):
            if entry.agent is not None:  # an agent harness, through the policy endpoint (rollart.serving)
                groups += [
                    [self._agent_manager(entry) for _ in range(config.rollout.group_size)] for _ in range(entry.groups)
                ]
                continue
            spec = EnvSpec(
                name=entry.name,
                tag=entry.tag,
                max_steps=entry.max_steps,
                max_new_tokens=entry.max_new_tokens,
                kwargs=entry.kwargs,
            )
            for _ in range(entry.groups):
                groups.append([manager(self._task_env(index, spec)) for _ in range(config.rollout.group_size)])

        # the dataset tasks' groups follow the envs' groups; the eval runs on the same proxy
        groups += self.data_tasks.groups(manager, config.rollout.group_size, first_group=len(groups))
        self.evaluator = None if config.eval is None else Evaluator(config.eval, held_out, manager, config.sampling)
        rollout_cfg = config.rollout
        policies = {c.on_failure for c in [config.reward, *(t.reward for t in config.tasks.values())] if c is not None}
        if policies:  # one policy per job (the config checks that the tasks' rewards agree)
            rollout_cfg = rollout_cfg.model_copy(update={"requeue_reward_failures": "requeue" in policies})
        self.scheduler = RolloutScheduler(groups, rollout_cfg, seed_fn=seeds.seed, quotas=self.quotas)
        self.controller = AsyncController(self.scheduler, self.proxy)
        self.mooncake_master: Any = None
        self.channel: WeightChannel | None = self._weight_channel()
        self.retired_channels: list[str] = []  # the names of the channels trainer restarts replaced
        self.train_version = 0  # the trainer's policy version (one per step); served versions may lag it
        # mooncake, and the ray channel with background_load: serves the newest published version
        self.loader: NewestVersionLoader | None = None
        self._snapshots: dict[int, Any] = {}  # ray channel, background_load: the newest snapshot not loaded yet
        if config.weights.channel == "none":
            log.warning("weights.channel=none: the inference workers keep their initial weights (benchmarks only)")
        self.start_step = 0
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.plot_path: Path | None = None
        self.export_path: Path | None = None  # RUN_DIR/hf once the run finished (export.hf)
        # trainer supervision (fault.train / reference / critic): one entry per recovery
        self.recoveries: list[dict[str, Any]] = []
        self._budgets = RoleBudgets(config.fault)
        self.step_in_progress = 0
        self._data_state0 = self.data_tasks.state_dict() if self.data_tasks.samplers else None
        if resume:
            self._resume()
            self._drop_metrics_from(self.start_step)
        elif self.metrics_path.exists():
            self.metrics_path.unlink()

    def _weight_channel(self) -> WeightChannel | None:
        """None for the Ray object store path (and ``none``); else a channel handle shared by trainer and
        workers.

        Mooncake: the channel's keys live under a name of this trainer incarnation (a new one after a
        trainer restart, and after a driver restart): the keys a dead trainer published stay registered
        in its dead segment until the master notices, and a successor that read or overwrote them
        (``latest``, the index, a version number it publishes again) would wait on that segment."""
        wc = self.config.weights
        name = f"{self.rm.job_id}-actor"
        if wc.channel == "mooncake":
            from rollart.resource_manager.net import node_ip
            from rollart.weights.host_cache import HostSharedChannel
            from rollart.weights.mooncake_channel import MooncakeChannel
            from rollart.weights.mooncake_master import MooncakeMaster

            name = f"{name}-{uuid.uuid4().hex[:8]}"
            master = wc.mooncake_master
            # none given: rollart starts one (once per job) on the head host, the driver's, reachable by every host
            if master is None and self.mooncake_master is None:
                self.mooncake_master = MooncakeMaster(host=node_ip(), log_dir=self.out_dir).start()
            if master is None:
                master = self.mooncake_master.address
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
        if wc.channel == "dist":
            from rollart.weights.dist_channel import TorchBroadcastChannel

            return TorchBroadcastChannel(
                name, num_receivers=len(self.infer.workers), bucket_bytes=wc.bucket_mb << 20, timeout_s=wc.timeout_s
            )
        return None

    async def _renew_weight_channel(self) -> WeightChannel:
        """A trainer restart over Mooncake: a channel under a new name (see :meth:`_weight_channel`) and
        its host caches; returns the old one, retired (:meth:`_retire_weight_channel`) once the
        recovery version is served from the new one."""
        old, self.channel = self.channel, self._weight_channel()
        assert old is not None and self.channel is not None
        self.retired_channels.append(old.name)
        log.info("weights: trainer restarted; channel %s replaces %s", self.channel.name, old.name)
        await self._start_host_caches()
        return old

    async def _retire_weight_channel(self, old: WeightChannel) -> None:
        """Every reader stops reading the old channel (a load of the dead trainer's last version, which
        may never come, fails now instead of after ``weights.timeout_s``), then its host caches are
        retired (their memory and relay copies go). After the new version is served: a worker whose
        restart was loading the old version then loads the new one."""
        from rollart.weights.host_cache import HostSharedChannel

        if isinstance(old, HostSharedChannel):
            await self.infer.retire_channel(old.name)  # first: no reader makes a new cache of the old one
            await asyncio.to_thread(old.close_caches)

    async def _start_host_caches(self) -> None:
        """The driver makes each inference host's weight cache, so a cache (and the relay copy its
        children read) outlives the death of the worker on its host."""
        from rollart.weights.host_cache import HostSharedChannel

        if isinstance(self.channel, HostSharedChannel):
            infos = await asyncio.gather(
                *[w._rollart_info.remote() for w in self.infer.workers], return_exceptions=True
            )
            # a worker down now (restarting, its host lost) is skipped: its host's first reader makes that cache
            nodes = [i["node_id"] for i in infos if isinstance(i, dict)]
            await asyncio.to_thread(self.channel.start_caches, nodes)

    def _relay_order(self) -> list[str]:
        """The inference hosts' IPs in relay-tree order: the trainer's host first when it also runs
        inference workers (its copy is local), then the others in worker order."""
        import ray

        infos = ray.get([w._rollart_info.remote() for w in self.infer.workers + self.train.workers[:1]])
        trainer_ip = infos[-1]["node_ip"]
        hosts = list(dict.fromkeys(i["node_ip"] for i in infos[:-1]))
        return sorted(hosts, key=lambda ip: ip != trainer_ip)

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

    async def _push_resumed_weights(self) -> int:
        """Before the rollout starts: every inference worker loads the checkpoint's weights."""
        if self.config.weights.channel == "none":
            version = self.train_version
        elif self.channel is None:
            ref, version = await self.train.snapshot_weights(blocking=False), self.train_version
            await self.proxy.model_update(ref, version)
        else:  # written before the workers load it: a failed write is this call's error, not their timeout
            version = await self.train.publish_to(self.channel, True, blocking=False)
            await self.proxy.model_update_from(self.channel, version)
        self.scheduler.version = version
        # admission counts the groups consumed so far against the version: as if ``version`` steps ran
        self.scheduler.accepted = version * self.config.rollout.batch_groups
        return version

    async def _sync_weights(self) -> tuple[int, float]:
        """Publish the trainer's current weights and make them the serving policy; returns the version
        and the seconds the driver waited for it (mooncake: only for the previous version's fetch)."""
        wc = self.config.weights
        t0 = time.monotonic()
        if wc.channel == "none":  # benchmark baseline: no weights move, the version advances
            await self.scheduler.set_version(self.train_version)
            return self.train_version, time.monotonic() - t0
        if self.channel is None:
            ref, version = await self.train.snapshot_weights(blocking=False), self.train_version
            if not self._background_load():
                await self.controller.sync_weights(ref, version, pause=wc.pause_rollout)
                return version, time.monotonic() - t0
            # the next batch trains while the workers load this snapshot; only the newest waiting one is kept
            self._snapshots = {version: ref}
            if self.loader is None:
                self.loader = NewestVersionLoader(self._load_snapshot, served=self.scheduler.version)
            self.loader.offer(version)  # raises a failed load of an earlier version
            return version, time.monotonic() - t0
        if wc.channel == "mooncake":  # the driver does not wait: the loader serves the newest version
            if self.loader is None:
                channel = self.channel
                self.loader = NewestVersionLoader(
                    lambda v: self.controller.sync_weights(None, v, channel=channel), served=self.scheduler.version
                )
            version = await self.train.publish_to(self.channel, not wc.async_publish, blocking=False)
            self.loader.offer(version)  # raises a failed load of an earlier version
            return version, time.monotonic() - t0
        version = await self.train.publish_to(self.channel, not wc.async_publish, blocking=False)
        await self.controller.sync_weights(None, version, channel=self.channel)
        return version, time.monotonic() - t0

    def _background_load(self) -> bool:
        """Whether ray-channel snapshots load in the background (``weights.background_load``)."""
        mode = self.config.weights.background_load
        return self.config.rollout.alpha >= 1 if mode == "auto" else bool(mode)

    async def _load_snapshot(self, version: int) -> None:
        """Load the kept snapshot of ``version`` into every worker (the background loader's job)."""
        ref = self._snapshots.pop(version)
        await self.controller.sync_weights(ref, version, pause=self.config.weights.pause_rollout)

    async def _await_loading(self) -> None:
        """Wait until every worker serves the newest published version (mooncake); re-raise a failure."""
        if self.loader is not None:
            await self.loader.wait()

    def _reward_client(self, rc: Any) -> Any:
        from rollart.cluster.serverless import RetryPolicy
        from rollart.reward.client import RewardClient

        return RewardClient(
            rc.url,
            retry=RetryPolicy(retries=rc.retries),
            timeout_s=rc.timeout_s,
            token_env=rc.token_env,
            tenant=rc.tenant or _default_tenant(self.config, self.rm.job_id),
            on_failure=rc.on_failure,
        )

    def _policy_endpoint(self) -> Any:
        """The OpenAI-compatible endpoint over the LLMProxy that agent envs play through (``serving:``)."""
        from rollart.serving.endpoint import PolicyEndpoint, build_service, model_context
        from rollart.serving.service import ProxyBackend

        cfg = self.config
        for name in ("httpx", "httpx2"):  # the openai client logs every call at INFO: one line per agent turn
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
        service = build_service(
            ProxyBackend(self.proxy),
            self.codec.tokenizer,
            cfg.serving,
            model=cfg.serving.model_name or cfg.name,
            sampling=cfg.sampling,
            max_context=model_context(self.model_path),
            version_fn=lambda: self.scheduler.version,
        )
        return PolicyEndpoint(service, cfg.serving)

    def _agent_manager(self, entry: Any) -> Any:
        """An env manager of one agent harness (``envs[i].agent``), with its task's reward."""
        from rollart.serving.agent import AgentEnvManager, AgentSpec, load_agent, load_tasks

        tag = entry.tag or "agent"
        spec = AgentSpec(agent=entry.agent, tasks=entry.tasks, kwargs=entry.kwargs, timeout_s=entry.timeout_s)
        paths = self.config.train.plugin_paths
        return AgentEnvManager(
            spec,
            self.endpoint,
            tag=tag,
            agent=load_agent(spec.agent, paths),
            tasks=load_tasks(spec.tasks, spec.kwargs, paths),
            reward_fn=self._task_reward_fn(tag),
            version_fn=lambda: self.scheduler.version,
            seed=self.config.sampling.seed,
        )

    def _task_env(self, index: int, spec: Any) -> Any:
        """The env (local, or remote on the task's env servers) of ``spec`` with its task's
        ``sampling.max_new_tokens`` (``tasks.TAG``) as its budget."""
        env = self.env_pools.make(index, spec)
        budget = self.config.tasks.get(str(env.tag))
        if budget is not None and budget.sampling.max_new_tokens is not None:
            env.max_new_tokens = budget.sampling.max_new_tokens
        return env

    def _task_reward_fn(self, tag: str) -> Any:
        """The reward function of a task tag: its service's (``tasks.TAG.reward``, else ``reward:``), or
        None for the env's own reward. One client per task tag with a reward of its own."""
        task = self.config.tasks.get(tag)
        if task is not None and task.reward is not None:
            if tag not in self.reward_clients:
                self.reward_clients[tag] = self._reward_client(task.reward)
            return self._service_reward(self.codec, self.reward_clients[tag])
        return self._service_reward(self.codec) if self.reward_client is not None else None

    def _service_reward(self, codec: HFCodec, client: Any = None) -> Any:
        """Score a finished trajectory with a reward service (``client``, default the pipeline's): its
        first prompt, its last answer and the env's ground truth. A failure raises (the trajectory
        becomes ``reward_failed``)."""

        async def reward(traj: Any) -> float:
            service = client if client is not None else self.reward_client
            assert service is not None
            steps = traj.info.get("steps") or [{}]
            return await service.score(
                {
                    "prompt": traj.info.get("prompt_text", codec.decode(traj.token_ids[: traj.prompt_length])),
                    "response": steps[-1].get(
                        "response", codec.decode(traj.token_ids[traj.turns[-1][0] : traj.turns[-1][1]])
                    ),
                    "ground_truth": traj.info.get("reset", {}).get("ground_truth"),
                    "tag": traj.tag,
                }
            )

        return reward

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoint"

    @property
    def checkpoint_path(self) -> Path:
        """The checkpoint ``--resume`` starts from: the newest ``checkpoint/step-N`` folder (an earlier
        release's ``checkpoint/last.pt`` file is read too)."""
        from rollart.training.checkpoint_io import LEGACY_FILE, latest_checkpoint

        return latest_checkpoint(self.checkpoint_root) or self.checkpoint_root / LEGACY_FILE

    @property
    def critic_checkpoint_path(self) -> Path:
        ckpt = self.checkpoint_path
        return ckpt / "critic.pt" if ckpt.is_dir() else ckpt.with_name("critic.pt")

    async def _save_checkpoint(self, step: int, extra: dict[str, Any]) -> None:
        """``checkpoint/step-N`` (N = steps done): critic first, then the actor, then ``latest`` points
        at it and all but the newest ``checkpoint_keep`` folders are deleted."""
        from rollart.training.checkpoint_io import commit_checkpoint, step_dir

        folder = step_dir(self.checkpoint_root.resolve(), step + 1)
        if self.critic is not None:
            await self.critic.save_checkpoint(str(folder / "critic.pt"), step, blocking=False)
        await self.train.save_checkpoint(str(folder), extra, blocking=False)
        commit_checkpoint(self.checkpoint_root, folder, self.config.checkpoint_keep)

    def _resume(self) -> None:
        if not self.checkpoint_path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint under {self.checkpoint_root}; run without --resume first")
        state = self.train.load_checkpoint(str(self.checkpoint_path))[0]
        self._restore_extra(state["extra"], self.critic_checkpoint_path, self.scheduler)
        self.train_version = int(state["version"])
        version = asyncio.run(self._push_resumed_weights())
        log.info("resumed from %s after step %d (policy version %d)", self.checkpoint_path, self.start_step, version)

    def _drop_metrics_from(self, step: int) -> None:
        """A resume continues after step ``step`` (its checkpoint's): drop the records a killed driver logged
        past it, so ``metrics.jsonl`` has one record per step."""
        import json
        import os

        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", -1) <= step]
        if len(kept) != len(lines):
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.metrics_path)

    def _restore_extra(self, extra: dict[str, Any], critic_path: Path, scheduler: RolloutScheduler) -> None:
        """The pipeline's side of a checkpoint: the scheduler (next rounds, consumed rounds), the data
        samplers, the running-mean baseline and the critic (which must come from the same save)."""
        scheduler.load_state_dict(extra["scheduler"])
        self.start_step = int(extra["step"]) + 1
        if "consumed" in extra and "settled" not in extra["scheduler"]:  # older checkpoints: a list of ids
            scheduler.settled.load_state_dict(extra["consumed"])
        if self.data_tasks.samplers:
            self.data_tasks.load_state_dict(extra.get("data", {}))
        if self.baseline is not None:
            if "running_mean" not in extra:
                raise ValueError(
                    f"--resume: {self.checkpoint_path} holds no running-mean baseline (it was written "
                    "with another advantage); resume with the advantage it was trained with"
                )
            self.baseline.load_state_dict(extra["running_mean"])
        if self.critic is not None:
            if not critic_path.exists():
                raise FileNotFoundError(
                    f"--resume with advantage: gae: no critic checkpoint at "
                    f"{critic_path}; the run was not trained with a critic"
                )
            critic_state = self.critic.load_checkpoint(str(critic_path))[0]
            if critic_state["step"] != int(extra["step"]):
                raise ValueError(
                    f"--resume: the critic checkpoint is from step {critic_state['step']}, the actor's "
                    f"from step {extra['step']}; they must come from the same save"
                )

    # ------------------------------------------------------------------ trainer supervision
    async def _run(self) -> list[dict[str, Any]]:
        """The steps; a trainer, reference or critic rank that dies is handled by its ``fault:`` policy
        (:meth:`_recover_training`), then the steps go on from the restored checkpoint."""
        history: list[dict[str, Any]] = []
        if self.endpoint is not None:  # the agent envs' policy endpoint, on this event loop
            await self.endpoint.start()
        try:
            while True:
                try:
                    return await self._run_steps(history)
                except Exception as err:
                    died = self._trainer_death(err)
                    if died is None:
                        raise
                    await self._recover_training(died, err, history)
        finally:
            if self.endpoint is not None:
                await self.endpoint.stop()

    async def _next_batch(self) -> list:
        """The next training batch. While it fills, the trainer side is probed every
        ``TRAINER_PROBE_S``: a rank that dies while the driver waits for rollouts would otherwise be
        found only at its next call, after the batch, and the batch may never fill without it (an
        inference worker restarting loads the version the dead trainer was still publishing)."""
        batch = asyncio.ensure_future(self.controller.get_batch(self.train_version))
        try:
            while True:
                done, _ = await asyncio.wait({batch}, timeout=TRAINER_PROBE_S)
                if done:
                    return batch.result()
                died = await self._probe_trainer_side()
                if died is not None:
                    raise died
        finally:
            if not batch.done():
                batch.cancel()

    async def _probe_trainer_side(self) -> WorkerDiedError | None:
        """A trainer-side rank Ray reports dead (a rank busy or briefly unreachable counts as alive)."""
        import ray

        for _, cluster in self._trainer_clusters().values():
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

    def _trainer_clusters(self) -> dict[str, tuple[str, Any]]:
        """Cluster name → (role, Cluster) of the trainer side."""
        out = {self.train.name: ("train", self.train)}
        for role, cl in (("reference", self.ref), ("critic", self.critic)):
            if cl is not None:
                out[cl.name] = (role, cl)
        return out

    def _trainer_death(self, err: BaseException) -> WorkerDiedError | None:
        """The dead trainer-side rank behind ``err``: a ``WorkerDiedError`` of one of those clusters in
        its chain, or, for another Ray error (e.g. weights owned by a dead rank), a rank a health check
        finds dead. None when no trainer-side rank died."""
        import ray

        clusters = self._trainer_clusters()
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

    async def _recover_training(self, died: WorkerDiedError, err: BaseException, history: list) -> None:
        """A trainer-side rank died: within its role's policy, rebuild every trainer (and critic) rank in
        its placement bundle and the dead reference ranks, reload the latest checkpoint (or the initial
        weights), rewind the rollout to it (the rounds trained since are played again; the consumed
        rounds of the checkpoint make sure none is trained twice) and push the reloaded weights to the
        inference workers as a new version. Past the policy: :class:`TrainerFailed` with the cause."""
        from rollart.training.checkpoint_io import latest_checkpoint

        t0 = time.monotonic()
        role = self._trainer_clusters()[died.cluster][0]
        failed_step = self.step_in_progress + 1  # as metrics.jsonl counts steps: from 1
        where = f"{died.cluster} on {died.hardware}, host {died.node_ip or '?'}"
        backoff = self._budgets.take(role, died.rank, err, where=where)
        log.error("%s rank %d died at step %d (%s): %r; restarting", role, died.rank, failed_step, where, err)
        await asyncio.sleep(backoff)
        await asyncio.to_thread(self._rebuild_trainer_side)
        ckpt = latest_checkpoint(self.checkpoint_root)
        old = self.scheduler
        new = RolloutScheduler(old.groups, old.config, seed_fn=old.seed_fn, quotas=self.quotas)
        if ckpt is not None:
            state = (await self.train.load_checkpoint(str(ckpt), blocking=False))[0]
            critic_path = ckpt / "critic.pt" if ckpt.is_dir() else ckpt.with_name("critic.pt")
            self._restore_extra(state["extra"], critic_path, new)
        else:  # no checkpoint yet: the rebuilt ranks hold the initial weights; the run starts over
            self.start_step = 0
            if self._data_state0 is not None:
                self.data_tasks.load_state_dict(self._data_state0)
            if self.baseline is not None:
                from rollart.algorithms import RunningMeanBaseline

                self.baseline = RunningMeanBaseline(self.config.running_mean.window, self.config.running_mean.scope)
        # the live counters go on; what the rewind undid is counted, not erased
        saved_trained = new.counts.get("trajectories_trained", 0)
        counts = old.counts.copy()
        counts["trajectories_rolled_back"] += old.counts.get("trajectories_trained", 0) - saved_trained
        counts["trajectories_dropped"] += sum(len(g) for g in old.buffer.groups())
        counts["trainer_restarts"] += 1
        new.counts = counts
        self.scheduler = new
        self.controller = AsyncController(new, self.proxy)
        if self.loader is not None:  # a load of the dead trainer's versions goes nowhere now
            await self.loader.cancel()
        self.loader = None
        self._snapshots = {}
        # the reloaded weights go out under a version newer than any served before (workers only move forward)
        version = max(self.train_version, old.version, self.proxy.version) + 1
        await self.train.set_version(version, blocking=False)
        self.train_version = version
        # mooncake: the new trainer publishes under keys of its own
        old_channel = await self._renew_weight_channel() if self.config.weights.channel == "mooncake" else None
        await self._push_resumed_weights()
        if old_channel is not None:
            await self._retire_weight_channel(old_channel)
        await self.proxy.resume()  # in case the death came between a suspend and its resume
        history[:] = [h for h in history if h["step"] <= self.start_step]
        self.recoveries.append(
            {
                "role": role,
                "cluster": died.cluster,
                "rank": died.rank,
                "host": died.node_ip,
                "cause": repr(err),
                "failed_step": failed_step,
                "restored_step": self.start_step,
                "checkpoint": str(ckpt) if ckpt is not None else None,
                "version": version,
                "seconds": time.monotonic() - t0,
            }
        )
        log.warning("trainer side restored: %s", self.recoveries[-1])

    def _rebuild_trainer_side(self) -> None:
        """Every trainer and critic rank anew in its bundle (a DDP group cannot go on with one rank
        replaced) and a new rendezvous; the dead reference ranks anew (they hold no state)."""
        for cluster in (self.train, self.critic):
            if cluster is None:
                continue
            for rank in range(cluster.world_size):
                cluster.restart_worker(rank)
            start_data_parallel(cluster)
        if self.ref is not None:
            for rank, alive in self.ref.health_check().items():
                if not alive:
                    self.ref.restart_worker(rank)

    # ------------------------------------------------------------------ the loop
    async def _run_steps(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        cfg = self.config
        tracker = self._make_tracker()
        if cfg.weights.channel == "mooncake" and self.channel is not None:  # every host joins the store now
            await self._start_host_caches()
            await self.infer.warm_channel(self.channel)
        self.controller.start()
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.start_step, desc=cfg.name, unit="step")
        try:
            for step in range(self.start_step, cfg.steps):
                self.step_in_progress = step
                t0 = time.monotonic()
                stale_before = Counter(self.scheduler.staleness)
                task_stale_before = {t: Counter(c) for t, c in self.scheduler.staleness_by_task.items()}
                groups = await self._next_batch()
                held_back = self.scheduler.buffered_by_task()
                # the order groups finished in depends on timing; a fixed order keeps a seeded run repeatable
                groups = sorted((Group(sorted(g, key=lambda t: t.traj_id), g.gid) for g in groups), key=lambda g: g.gid)
                t_rollout = time.monotonic() - t0
                staleness = Counter(self.scheduler.staleness) - stale_before
                t1 = time.monotonic()
                batch, critic_step = await self._make_batch(groups)
                if self.ref is not None:
                    batch[C.REF_LOGPROBS] = await self.ref.compute_logprobs(batch, blocking=False)
                train_metrics = await self.train.train_step(batch, blocking=False)
                if critic_step is not None:
                    train_metrics.update({f"critic_{k}": v for k, v in (await critic_step).items()})
                t_train = time.monotonic() - t1
                self.train_version += 1
                version, t_sync = await self._sync_weights()
                trajs = [t for g in groups for t in g]
                record = self._record(
                    step, version, trajs, train_metrics, t_rollout, t_train, t_sync, time.monotonic() - t0, staleness
                )
                record.update(batch_statistics(batch, trajs))
                record.update(self._task_record(groups, task_stale_before, held_back))
                record["trainer_restarts"] = len(self.recoveries)
                if self.data_tasks.samplers:
                    record["data_epoch"] = self.data_tasks.metrics()
                if self.evaluator is not None and self.evaluator.due(step, cfg.steps - 1):
                    await self._await_loading()  # evaluate the version every worker serves
                    record["eval"] = await self.evaluator.run(step)
                history.append(record)
                if len(history) > 2 * cfg.history_keep:  # bounded memory: trimmed in batches, O(1) per step
                    del history[: len(history) - cfg.history_keep]
                tracker.log(record, record["step"])
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{record['reward_mean']:.3f}", v=version)
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    # the consumed rounds are in the scheduler's state (per group: a watermark and a small set)
                    extra = {"step": step, "scheduler": self.scheduler.state_dict()}
                    if self.data_tasks.samplers:
                        extra["data"] = self.data_tasks.state_dict()
                    if self.baseline is not None:
                        extra["running_mean"] = self.baseline.state_dict()
                    await self._save_checkpoint(step, extra)
            await self._await_loading()  # the run ends with every worker serving the last version
            if cfg.export.hf and self.start_step < cfg.steps:
                self.export_path = Path(
                    await self.train.export_hf(str((self.out_dir / "hf").resolve()), blocking=False)
                )
        finally:
            try:
                if self.loader is not None:  # a failed step: nothing waits for the fetch any more
                    await self.loader.cancel()
                if bar is not None:
                    bar.close()
                tracker.close()
                try:
                    await self.controller.stop()
                finally:  # rewards in flight are answered (and counted) first
                    for client in [self.reward_client, *self.reward_clients.values()]:
                        if client is not None:
                            await client.aclose()
            finally:  # whatever failed above, the run's account is written
                self._write_ledger()
        return history

    def _ledger_step(self, trajs: list) -> dict[str, int]:
        """The trajectory ledger after this step (``metrics.jsonl``'s ``ledger``). A trained trajectory
        is checked here, once: its id is unique in the batch (across steps the scheduler's round ledger
        catches a round trained twice) and its reward is real (status ok, no error, a finite number)."""
        import math

        ids = [t.traj_id for t in trajs]
        invented = sum(
            t.status != "ok" or bool(t.error) or t.reward is None or not math.isfinite(float(t.reward)) for t in trajs
        )
        self.scheduler.counts["trajectories_trained_twice_in_step"] += len(ids) - len(set(ids))
        self.scheduler.counts["rewards_invented"] += invented
        out = self.scheduler.ledger()
        out["trained_twice"] += self.scheduler.counts["trajectories_trained_twice_in_step"]
        out["rewards_invented"] = self.scheduler.counts["rewards_invented"]
        return out

    def _ledger_record(self, trajs: list) -> dict[str, int]:
        """The per-step ledger: while rounds are being completed, what ``lost`` would count is
        ``completing`` (``ledger.json``, written after the rollout stopped, has the exact ``lost``)."""
        out = self._ledger_step(trajs)
        out["completing"] = out.pop("lost")
        return out

    def _write_ledger(self) -> None:
        """``ledger.json`` at the end of a run (after the rollout stopped, so ``lost`` is exact)."""
        import json

        led = self._ledger_step([])
        led["migrated"] = int(self.proxy.fault_metrics().get("migrated", 0))
        if self.reward_client is not None:  # what the job sent its reward service, all of it (clients closed)
            led["reward_service"] = self.reward_client.counts()
        (self.out_dir / "ledger.json").write_text(json.dumps(led, indent=2))
        (log.info if led["lost"] == 0 and led["trained_twice"] == 0 else log.error)("trajectory ledger: %s", led)

    def _make_tracker(self) -> Any:
        """``metrics.jsonl`` (always) and the backends of ``tracking:`` (TensorBoard, W&B, MLflow)."""
        from rollart.tracking import make_tracker

        cfg = self.config
        return make_tracker(
            ["jsonl", *cfg.tracking],
            self.out_dir,
            run_name=cfg.name,
            config=cfg.model_dump(mode="json"),
            resume=True,  # a fresh run's metrics.jsonl was removed in __init__; a resumed one appends
        )

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
        by_tag: dict[str, list[float]] = defaultdict(list)
        hw_by_tag: dict[str, Counter] = defaultdict(Counter)
        for t in trajs:
            by_tag[t.tag].append(float(t.reward))
            for hw in t.hardware:
                hw_by_tag[t.tag][hw] += 1
        tokens = sum(t.num_action_tokens for t in trajs)
        counts = self.scheduler.counts
        rewards = [float(t.reward) for t in trajs]
        return {
            "step": step + 1,  # steps done, counted from 1: the record of step N matches checkpoint step-N
            "version": version,
            "groups": sorted({t.group_id for t in trajs}),
            "reward_mean": sum(rewards) / len(rewards),
            "reward_by_tag": {k: sum(v) / len(v) for k, v in by_tag.items()},
            "hardware_by_tag": {k: dict(v) for k, v in hw_by_tag.items()},
            # routing: auto — the tags whose hardware order the measured shapes changed
            **({"routing": self.proxy.affinity.mapping()} if self.proxy.affinity is not None else {}),
            "time": {
                "step_s": t_step,
                "rollout_wait_s": t_rollout,
                "train_s": t_train,
                "weight_sync_s": t_sync,
                "weight_load_s": self.controller.timings["weight_sync_s"],
            },
            "staleness": {str(k): v for k, v in sorted(staleness.items())},
            "max_staleness": max((int(k) for k in staleness), default=0),
            "tokens": tokens,
            "tokens_per_s": tokens / max(t_step, 1e-9),
            "trajectories_aborted": counts.get("trajectories_aborted", 0),
            "trajectories_failed": counts.get("trajectories_failed", 0),
            "trajectories_reward_failed": counts.get("trajectories_reward_failed", 0),
            "groups_evicted_stale": counts.get("groups_evicted_stale", 0),
            "faults": self.proxy.fault_metrics(),
            "ledger": self._ledger_record(trajs),
            **({"reward_service": self.reward_client.counts()} if self.reward_client is not None else {}),
            **(
                {"reward_service_by_tag": {tag: c.counts() for tag, c in self.reward_clients.items()}}
                if self.reward_clients
                else {}
            ),
            "train": {k: (sum(v) / len(v) if isinstance(v, list) else v) for k, v in train_metrics.items()},
        }

    def _task_record(
        self, groups: list[Group], stale_before: dict[str, Counter], held_back: dict[str, int]
    ) -> dict[str, Any]:
        """Per task tag: ``groups_by_tag`` (groups in this batch) and ``by_tag`` — groups, trajectories,
        reward mean/min/max, mean response length (action tokens), tokens, mean trajectory wall time
        (reset to reward) and its quantiles, this batch's staleness,
        the groups held back in the buffer for later batches, and the run's trajectory counts so far
        (ok, aborted, failed, reward_failed, evicted) and its quota (``tasks.*.ratio``) if any."""
        sched = self.scheduler
        out: dict[str, Any] = {}
        for tag in sched.counts_by_task:
            mine = [g for g in groups if sched.task_of(g) == tag]
            trajs = [t for g in mine for t in g]
            rewards = [float(t.reward) for t in trajs if t.reward is not None]
            lengths = [t.num_action_tokens for t in trajs]
            durations = [float(t.info["duration_s"]) for t in trajs if "duration_s" in t.info]
            staleness = sched.staleness_by_task[tag] - stale_before.get(tag, Counter())
            counts = sched.counts_by_task[tag]
            out[tag] = {
                "groups": len(mine),
                "trajectories": len(trajs),
                "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                "reward_min": min(rewards, default=None),
                "reward_max": max(rewards, default=None),
                "response_length_mean": sum(lengths) / len(lengths) if lengths else None,
                "tokens": sum(lengths),
                "trajectory_s_mean": sum(durations) / len(durations) if durations else None,
                # min, p25, p50, p75, p90, max of the trajectories' wall times (rollart advise's tail)
                "trajectory_s_quantiles": (
                    np.quantile(durations, (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)).tolist() if durations else None
                ),
                "staleness": {str(k): v for k, v in sorted(staleness.items())},
                "max_staleness": max(staleness, default=0),
                "held_back_groups": held_back.get(tag, 0),
                "quota": None if self.quotas is None else self.quotas.get(tag),
                **{
                    key: counts.get(f"trajectories_{key}", 0)
                    for key in ("ok", "aborted", "failed", "reward_failed", "evicted")
                },
            }
        return {"groups_by_tag": {t: v["groups"] for t, v in out.items()}, "by_tag": out}

    def run(self) -> list[dict[str, Any]]:
        """Train; the records of the last ``history_keep`` steps (every step is in ``metrics.jsonl``)."""
        history = asyncio.run(self._run())
        history = history[-self.config.history_keep :]
        self.plot_path = self.plot(self.step_records())
        return history

    def step_records(self) -> list[dict[str, Any]]:
        """Every step's record from ``metrics.jsonl``, in step order (a step done again after a trainer
        restore: its last record)."""
        import json

        if not self.metrics_path.exists():
            return []
        by_step: dict[int, dict[str, Any]] = {}
        with self.metrics_path.open() as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    by_step[rec["step"]] = rec
        return [by_step[k] for k in sorted(by_step)]

    def plot(self, history: list[dict[str, Any]]) -> Path | None:
        """``metrics.png`` (needs matplotlib: the ``plot`` extra); None when skipped."""
        if not history:
            return None
        try:
            import matplotlib
        except ImportError:
            log.info(
                "metrics.png skipped: matplotlib is not installed (pip install 'rollart[plot]'); the metrics are in %s",
                self.metrics_path,
            )
            return None

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        evals = [h for h in history if "eval" in h]
        fig, axes = plt.subplots(1, 3 if evals else 2, figsize=(16 if evals else 11, 4))
        a, b = axes[0], axes[1]
        steps = [h["step"] for h in history]
        for tag in sorted({t for h in history for t in h["reward_by_tag"]}):
            a.plot(steps, [h["reward_by_tag"].get(tag, float("nan")) for h in history], label=tag)
        a.set_xlabel("step")
        a.set_ylabel("reward")
        a.legend()
        bottom = [0.0] * len(history)
        for part in ("rollout_wait_s", "train_s", "weight_sync_s"):
            vals = [h["time"][part] for h in history]
            b.bar(steps, vals, bottom=bottom, label=part)
            bottom = [x + y for x, y in zip(bottom, vals)]
        b.set_xlabel("step")
        b.set_ylabel("seconds")
        b.legend()
        if evals:
            plot_eval(axes[2], evals)
        fig.suptitle(self.config.name)
        fig.tight_layout()
        path = self.out_dir / "metrics.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def shutdown(self) -> None:
        for extra in (self.ref, self.critic):
            if extra is not None:
                extra.shutdown()
        self.proxy.close()
        self.env_pools.stop()
        self.train.shutdown()
        self.infer.shutdown()
        self.rm.shutdown()
        if self.mooncake_master is not None:
            self.mooncake_master.stop()
