"""The rollout's env managers, in groups: one group per ``envs[i].groups`` of each env task (local envs, or
remote ones on the task's warm env servers: ``backend: ray | kubernetes``), agent harnesses that play
through the OpenAI-compatible policy endpoint (``envs[i].agent``), and the dataset tasks' groups after
them. Each manager has its task's sampling settings, generation budget and reward (``tasks.TAG``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rollart.config import PipelineConfig
from rollart.pipeline.rewards import RewardServices
from rollart.rollout.env_manager import EnvManager, HFCodec

log = logging.getLogger(__name__)


class EnvGroups:
    """Builds the env managers of a job over ``proxy``; ``version_fn`` is the policy version the rollout
    serves (each manager tags its trajectories with it)."""

    def __init__(
        self,
        config: PipelineConfig,
        rm: Any,
        proxy: Any,
        codec: HFCodec,
        rewards: RewardServices,
        *,
        model_path: str,
        version_fn: Callable[[], int],
    ):
        from rollart.envservice.backends import EnvPools

        self.config, self.proxy, self.codec, self.rewards = config, proxy, codec, rewards
        self.model_path, self.version_fn = model_path, version_fn
        self.env_pools = EnvPools(config.envs, rm, plugin_paths=config.train.plugin_paths)
        agents = any(e.agent for e in config.envs)
        self.endpoint = self._policy_endpoint() if agents else None
        self.harness: Any = None  # the processes agent harnesses play in (serving.harness_processes)
        if agents and config.serving.harness_processes:
            from rollart.serving.harness import HarnessPool

            self.harness = HarnessPool(config.serving.harness_processes, config.train.plugin_paths)

    async def start(self) -> None:
        """Start what the agent envs play through: the policy endpoint, then the harness processes."""
        if self.endpoint is not None:
            await self.endpoint.start()
        if self.harness is not None:
            await self.harness.start()

    async def stop(self) -> None:
        if self.harness is not None:
            await self.harness.stop()
        if self.endpoint is not None:
            await self.endpoint.stop()

    def manager(self, env: Any, sampling: Any = None) -> EnvManager:
        """An EnvManager of ``env`` with its task's sampling settings and reward (``tasks.TAG``)."""
        tag = str(getattr(env, "tag", type(env).__name__))
        return EnvManager(
            env,
            self.proxy,
            self.codec,
            sampling=sampling if sampling is not None else self.config.task_sampling(tag),
            config=self.config.env_manager,
            version_fn=self.version_fn,
            reward_fn=self.rewards.reward_fn(tag),
        )

    def env_groups(self) -> list[list[Any]]:
        """The groups of the ``envs:`` tasks, in their order."""
        from rollart.envs import EnvSpec

        config = self.config
        size = config.rollout.group_size
        groups: list[list[Any]] = []
        for index, entry in enumerate(config.envs):
            if entry.agent is not None:  # an agent harness, through the policy endpoint (rollart.serving)
                groups += [[self._agent_manager(entry) for _ in range(size)] for _ in range(entry.groups)]
                continue
            spec = EnvSpec(
                name=entry.name,
                tag=entry.tag,
                max_steps=entry.max_steps,
                max_new_tokens=entry.max_new_tokens,
                kwargs=entry.kwargs,
            )
            for _ in range(entry.groups):
                groups.append([self.manager(self._task_env(index, spec)) for _ in range(size)])
        return groups

    def _policy_endpoint(self) -> Any:
        """The OpenAI-compatible endpoint over the LLMProxy that agent envs play through (``serving:``)."""
        from rollart.serving.endpoint import PolicyEndpoint, build_service, model_context
        from rollart.serving.service import ProxyBackend

        cfg = self.config
        for name in ("httpx", "httpx2"):  # the openai client logs every call at INFO: one line per agent turn
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
        settings: dict[str, Any] = {
            "model": cfg.serving.model_name or cfg.name,
            "sampling": cfg.sampling,
            "max_context": model_context(self.model_path),
            "version_fn": self.version_fn,
        }
        if cfg.serving.processes:  # off the driver's event loop (rollart.serving.processes)
            from rollart.serving.processes import EndpointProcesses

            return EndpointProcesses(ProxyBackend(self.proxy), self.codec.tokenizer, cfg.serving, **settings)
        service = build_service(ProxyBackend(self.proxy), self.codec.tokenizer, cfg.serving, **settings)
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
            reward_fn=self.rewards.reward_fn(tag),
            version_fn=self.version_fn,
            seed=self.config.sampling.seed,
            harness=self.harness,
        )

    def _task_env(self, index: int, spec: Any) -> Any:
        """The env (local, or remote on the task's env servers) of ``spec`` with its task's
        ``sampling.max_new_tokens`` (``tasks.TAG``) as its budget."""
        env = self.env_pools.make(index, spec)
        budget = self.config.tasks.get(str(env.tag))
        if budget is not None and budget.sampling.max_new_tokens is not None:
            env.max_new_tokens = budget.sampling.max_new_tokens
        return env
