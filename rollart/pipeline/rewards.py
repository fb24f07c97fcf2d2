"""The reward services of a pipeline: the job's ``reward:`` service and one per task tag with a reward
of its own (``tasks.TAG.reward``); each finished trajectory of a task is scored by its service, or by
the env itself when there is none."""

from __future__ import annotations

import re
from typing import Any

from rollart.rollout.types import Trajectory


def default_tenant(config: Any, job_id: str) -> str:
    """The reward service tenant of a job without ``reward.tenant``: ``cluster.job_id``, else the config's
    name when it is a valid tenant label, else the Ray job id."""
    for candidate in (config.cluster.job_id, config.name):
        if candidate and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", candidate):
            return candidate
    return job_id


class RewardServices:
    """The clients of a job's reward services (``config``: the pipeline config; ``codec`` decodes the
    prompt and answer of a trajectory that does not carry their text)."""

    def __init__(self, config: Any, job_id: str, codec: Any):
        self.config, self.job_id, self.codec = config, job_id, codec
        self.client: Any = None if config.reward is None else self._client(config.reward)  # the job's reward:
        self.by_tag: dict[str, Any] = {}  # per task tag whose reward comes from a service of its own

    def _client(self, rc: Any) -> Any:
        from rollart.cluster.serverless import RetryPolicy
        from rollart.reward.client import RewardClient

        return RewardClient(
            rc.url,
            retry=RetryPolicy(retries=rc.retries),
            timeout_s=rc.timeout_s,
            token_env=rc.token_env,
            tenant=rc.tenant or default_tenant(self.config, self.job_id),
            on_failure=rc.on_failure,
        )

    def reward_fn(self, tag: str) -> Any:
        """The reward function of a task tag: its service's (``tasks.TAG.reward``, else ``reward:``), or
        None for the env's own reward. One client per task tag with a reward of its own."""
        task = self.config.tasks.get(tag)
        if task is not None and task.reward is not None:
            if tag not in self.by_tag:
                self.by_tag[tag] = self._client(task.reward)
            return service_reward(self.by_tag[tag], self.codec)
        return service_reward(self.client, self.codec) if self.client is not None else None

    def counts(self) -> dict[str, Any]:
        """The step record's part: what was sent to each service so far."""
        out: dict[str, Any] = {}
        if self.client is not None:
            out["reward_service"] = self.client.counts()
        if self.by_tag:
            out["reward_service_by_tag"] = {tag: c.counts() for tag, c in self.by_tag.items()}
        return out

    async def aclose(self) -> None:
        """Close every client (rewards in flight are answered, and counted, first)."""
        for client in [self.client, *self.by_tag.values()]:
            if client is not None:
                await client.aclose()


def service_reward(client: Any, codec: Any) -> Any:
    """The reward function scoring a finished trajectory with ``client``'s service on what the env manager
    recorded (``Trajectory.scored_on``: the env's first prompt, its ground truth, its account of the last
    answer), the tokens' text where it recorded none. A failure raises (the trajectory becomes
    ``reward_failed``)."""
    tenant = getattr(client, "tenant", None)

    async def reward(traj: Trajectory) -> float:
        given = traj.scored_on
        prompt = given.prompt if given.prompt is not None else codec.decode(traj.token_ids[: traj.prompt_length])
        response = given.response
        if response is None:
            response = codec.decode(traj.token_ids[traj.turns[-1][0] : traj.turns[-1][1]])
        return await client.score(
            {"prompt": prompt, "response": response, "ground_truth": given.ground_truth, "tag": traj.tag}
        )

    # what a trajectory trace names as the reward's source
    source = f"service {getattr(client, 'url', type(client).__name__)}"
    reward.trace_source = source + (f" (tenant {tenant})" if tenant else "")  # type: ignore[attr-defined]
    return reward
