"""Faults behind the endpoint: the inference worker serving a session's call is killed mid-call.

With a restart policy the LLMProxy sends the call again from its stored state (prompt + the tokens
already returned) and the call answers as if nothing happened: the session records exactly the tokens
and log-probs the engine produced (here a fixed function of token and position, so a lost, doubled or
shifted token shows), and the rollout's ledger loses and invents nothing. With no worker left the
endpoint answers 503 with ``Retry-After``, and an agent episode raises the cluster's error out of
``run`` (the scheduler stops with the cause), as every env does.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal

import openai
import pytest
import ray
from serving_fixtures import ServedPolicy, build_merging_tokenizer, script_logprob

import rollart as ra
from rollart.cluster.errors import ClusterError
from rollart.cluster.fault import RestartPolicy
from rollart.rollout.inference_worker import inference_worker_class
from rollart.rollout.scheduler import RolloutConfig, RolloutScheduler
from rollart.serving.agent import AgentEnvManager, AgentSpec, load_tasks

pytestmark = pytest.mark.timeout(420)
SPEC = AgentSpec(agent="unused:unused", timeout_s=240)


def _cluster(rm, folder, step_s=0.004):
    return ra.Cluster(
        "infer",
        inference_worker_class({"*": ["H20"]}),
        rm,
        pool="rollout",
        worker_kwargs={
            "engine": {"kind": "serving_fixtures:ScriptedEngine", "model": str(folder), "options": {"step_s": step_s}}
        },
    )


def kill(cluster, rank: int) -> int:
    pid = ray.get(cluster.workers[rank]._rollart_info.remote(), timeout=60)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


async def _running(proxy, n: int) -> None:
    async with asyncio.timeout(120):
        while sum(m["running"] for m in await proxy.worker_metrics()) < n:
            await asyncio.sleep(0.02)


def test_a_worker_killed_mid_call_the_call_is_sent_again_and_nothing_is_lost(make_rm, tmp_path):
    folder = build_merging_tokenizer(tmp_path / "tok")
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    cluster = _cluster(rm, folder)
    served = ServedPolicy(cluster, str(folder), restart=RestartPolicy(max_restarts=1, backoff_s=0.0))

    async def agent(client: openai.AsyncOpenAI, task: dict) -> float:
        r = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "SAY:RAMBLE"}], max_tokens=300
        )
        return float(r.choices[0].finish_reason == "length")

    config = RolloutConfig(num_env_groups=2, group_size=2, batch_groups=2)
    groups = [
        [AgentEnvManager(SPEC, served.endpoint, agent=agent, tasks=load_tasks(None, {})) for _ in range(2)]
        for _ in range(2)
    ]

    async def go():
        sched = RolloutScheduler(groups, config)
        sched.start()
        await _running(served.proxy, 4)  # every episode is in its call
        pid = await asyncio.to_thread(kill, cluster, 0)
        batch = await asyncio.wait_for(sched.get_batch(), 300)
        await sched.stop()
        return sched, batch, pid

    try:
        sched, batch, pid = served.run(go(), timeout=360)
        trajs = [t for g in batch for t in g]
        assert len(trajs) == 4 and all(t.status == "ok" and t.reward == 1.0 for t in trajs)
        assert served.proxy.fault_metrics()["migrated"] >= 1 and cluster.pids()[0] != pid
        for t in trajs:  # the engine's tokens and log-probs, position by position: nothing lost or doubled
            ((s, e),) = t.turns
            assert e - s == 300 and sum(t.loss_mask) == 300
            assert t.logprobs[s:e] == [script_logprob(tok, p) for p, tok in enumerate(t.token_ids[s:e], start=s)]
            assert all(math.isfinite(x) for x in t.logprobs)
        ledger = sched.ledger()
        assert ledger["lost"] == 0 and ledger["trained"] == 4 and ledger["trained_twice"] == 0
    finally:
        served.close()
        cluster.shutdown()


def test_no_worker_left_answers_503_and_the_episode_raises_the_cause(make_rm, tmp_path):
    folder = build_merging_tokenizer(tmp_path / "tok")
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    cluster = _cluster(rm, folder)
    served = ServedPolicy(cluster, str(folder), restart=RestartPolicy(max_restarts=0, on_exhausted="remove"))
    try:
        ok = served.client(max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "SAY:up"}]
        )
        assert ok.choices[0].message.content == "up"
        kill(cluster, 0)
        with pytest.raises(openai.InternalServerError) as err:
            served.client(max_retries=0).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "SAY:down"}]
            )
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "5"

        async def agent(client: openai.AsyncOpenAI, task: dict) -> float:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:x"}])
            return 1.0

        manager = AgentEnvManager(
            AgentSpec(agent="unused:unused", client_max_retries=0),
            served.endpoint,
            agent=agent,
            tasks=load_tasks(None, {}),
        )
        with pytest.raises(ClusterError):
            served.run(manager.run(seed=0))
    finally:
        served.close()
        cluster.shutdown()


# ---------------------------------------------------------------------- the whole pipeline
@pytest.mark.timeout(900)
def test_an_agent_pipeline_survives_a_worker_killed_mid_call_and_the_ledger_holds(ray_local, tmp_path):
    """An AgenticPipeline of ``agent`` episodes (tests/serving_agents.py: one completion call each,
    rewarded by what the policy wrote) on the tiny model, one inference worker with a restart policy.
    After step 1 the next episode kills the worker while its call is in flight: the LLMProxy waits
    for the restart and sends the call again from its stored state, so the harness sees an answer.
    Two episodes started after it raise (a harness that lost its connection): their rounds fail and
    are played again. The run completes; every trained trajectory carries exactly the reward its
    agent returned (none is a 0 it did not return, none comes from a crashed episode); the ledger
    loses, invents and trains twice nothing."""
    import serving_agents
    from transformers import AutoTokenizer

    from rollart.config import PipelineConfig
    from rollart.pipelines.agentic import AgenticPipeline

    cfg = PipelineConfig.model_validate(
        {
            "name": "agent-fault",
            "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
            "envs": [{"agent": "serving_agents:faulty", "groups": 2, "tag": "faulty", "timeout_s": 300}],
            "rollout": {"num_env_groups": 2, "group_size": 4, "batch_groups": 2, "alpha": 0},
            "sampling": {"temperature": 1.0, "max_new_tokens": 48, "seed": 0},
            "serving": {"model_name": "policy"},
            "advantage": "grpo",
            "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
            "train": {"lr": 0.001},
            "steps": 3,
            "checkpoint_every": 0,
            "fault": {"inference": {"max_restarts": 2, "backoff_s": 0}},
            "output_dir": str(tmp_path / "run"),
            "cluster": {"metadata_store": str(tmp_path / "meta.sqlite")},
        }
    )
    plan = serving_agents.PLAN = serving_agents.Plan()
    trained: list = []
    killed: list[int] = []

    class Killing(AgenticPipeline):
        async def _kill_mid_call(self) -> None:
            pid = (await asyncio.to_thread(self.infer.pids))[0]
            await _running(self.proxy, 1)  # this episode's call (at least) is in the engine
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

        async def on_step_end(self, step, record, trajs):
            trained.extend(trajs)
            if step == 1:
                plan.kill, plan.crash = self._kill_mid_call, 2

    pipe = Killing(cfg, progress=False)
    try:
        history = pipe.run()
        ledger = pipe.scheduler.ledger()
        counts = dict(pipe.scheduler.counts)
        faults = pipe.proxy.fault_metrics()
        tok = AutoTokenizer.from_pretrained(pipe._model_path())
    finally:
        pipe.shutdown()
    assert [h["step"] for h in history] == [1, 2, 3] and killed
    assert faults["deaths"] == 1 and faults["restarts"] == 1
    assert faults["migrated"] >= 1  # the call in flight was sent again: the worker died mid-call
    assert history[-1]["faults"]["deaths"] == 1
    # the crashed episodes failed (never scored) and their rounds were played again
    assert len(plan.crashed) == 2 and counts["trajectories_failed"] >= 2
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and ledger["in_flight"] == 0
    assert ledger["trained"] == len(trained) == 3 * 2 * 4 and len({t.traj_id for t in trained}) == len(trained)
    assert ledger["started"] == ledger["trained"] + ledger["retried"] + ledger["failed"] + ledger["buffered"]
    for t in trained:
        session = t.info["session"]
        assert t.status == "ok" and session not in plan.crashed
        assert t.reward == plan.returned[session]  # the agent's own number, not a default
        ((s, e),) = t.turns  # the reward is recomputed from the tokens that train
        assert t.reward == serving_agents.reward_of(tok.decode(t.token_ids[s:e], skip_special_tokens=True))
        assert sum(t.loss_mask) == e - s and len(t.logprobs) == len(t.token_ids)
        assert all(math.isfinite(x) for x in t.logprobs[s:e])
