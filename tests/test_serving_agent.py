"""The ``agent`` env kind: harnesses written against the ``openai`` SDK run as episodes of the rollout
scheduler, with their rewards, failures (replayed, never scored 0), aborts and token-exact trajectories."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from serving_fixtures import ServedPolicy, build_merging_tokenizer

import rollart as ra
from rollart.rollout.inference_worker import inference_worker_class
from rollart.rollout.scheduler import RolloutConfig, RolloutScheduler
from rollart.serving.agent import AgentEnvManager, AgentSpec, load_tasks

SPEC = AgentSpec(agent="unused:unused")


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory):
    folder = build_merging_tokenizer(tmp_path_factory.mktemp("tok"))
    rm = ra.ResourceManager({"rollout": {"hardware": "H20", "devices": 1}}, store=tmp_path_factory.mktemp("s") / "m.db")
    cluster = ra.Cluster(
        "infer",
        inference_worker_class({"*": ["H20"]}),
        rm,
        pool="rollout",
        worker_kwargs={
            "engine": {"kind": "serving_fixtures:ScriptedEngine", "model": str(folder), "options": {"step_s": 0.005}}
        },
    )
    policy = ServedPolicy(cluster, str(folder))
    yield policy
    policy.close()
    cluster.shutdown()
    rm.shutdown()


async def two_turn_agent(client: openai.AsyncOpenAI, task: dict) -> float:
    msgs = [{"role": "user", "content": f"SAY:SPLIT:{task['word']}"}]
    r = await client.chat.completions.create(model="policy", messages=msgs)
    msgs += [r.choices[0].message, {"role": "user", "content": "SAY:done"}]
    r2 = await client.chat.completions.create(model="policy", messages=msgs)
    return 1.0 if r.choices[0].message.content == task["word"] and r2.choices[0].message.content == "done" else 0.5


def words(seed: int) -> dict:
    return {"word": f"w{seed % 10}"}


def test_an_agent_episode_trains_on_its_sessions_tokens(served):
    mgr = AgentEnvManager(SPEC, served.endpoint, tag="agent", agent=two_turn_agent, tasks=words)
    traj = served.run(mgr.run(seed=3, group_id="0:0", traj_id="0:0:0:v0"))
    assert traj.status == "ok" and traj.reward == 1.0 and traj.info["task"] == {"word": "w3"}
    assert traj.info["calls"] == 2 and traj.info["chains"] == 1 and len(traj.turns) == 2
    tok = served.endpoint.service.tokenizer
    s, e = traj.turns[0]
    assert traj.token_ids[s:e] == [*(tok.encode(c, add_special_tokens=False)[0] for c in "w3"), tok.eos_token_id]
    assert len(served.endpoint.sessions) == 0  # the session was closed with the episode


def test_reward_posted_to_the_session_or_from_the_config(served):
    async def posting(client: openai.AsyncOpenAI, task: dict) -> None:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:x"}])
        base = str(client.base_url).rstrip("/").removesuffix("/v1")
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{base}/reward", json={"reward": 0.25}, headers={"Authorization": f"Bearer {client.api_key}"}
            )
            r.raise_for_status()

    mgr = AgentEnvManager(SPEC, served.endpoint, agent=posting, tasks=words)
    assert served.run(mgr.run(seed=1)).reward == 0.25

    async def silent(client: openai.AsyncOpenAI, task: dict) -> None:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:xyz"}])

    scored = AgentEnvManager(SPEC, served.endpoint, agent=silent, tasks=words, reward_fn=lambda t: len(t.turns) / 4)
    assert served.run(scored.run(seed=1)).reward == 0.25
    unscored = served.run(AgentEnvManager(SPEC, served.endpoint, agent=silent, tasks=words).run(seed=1))
    assert unscored.status == "failed" and unscored.reward is None and "no reward" in unscored.error


def test_a_blocking_agent_runs_in_a_thread_with_the_sync_client(served):
    def blocking(client: openai.OpenAI, task: dict) -> float:
        r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:sync"}])
        return float(r.choices[0].message.content == "sync")

    traj = served.run(AgentEnvManager(SPEC, served.endpoint, agent=blocking, tasks=words).run(seed=2))
    assert traj.status == "ok" and traj.reward == 1.0


def test_agent_faults_fail_the_episode_never_a_zero(served):
    async def raising(client: openai.AsyncOpenAI, task: dict) -> float:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:x"}])
        raise RuntimeError("tool sandbox crashed")

    async def nan(client: openai.AsyncOpenAI, task: dict) -> float:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:x"}])
        return float("nan")

    async def idle(client: openai.AsyncOpenAI, task: dict) -> float:
        return 1.0

    for agent, why in ((raising, "tool sandbox crashed"), (nan, "finite number"), (idle, "made no call")):
        traj = served.run(AgentEnvManager(SPEC, served.endpoint, agent=agent, tasks=words).run(seed=0))
        assert traj.status == "failed" and traj.reward is None and why in traj.error
    slow = AgentSpec(agent="unused:unused", timeout_s=0.5)

    async def hangs(client: openai.AsyncOpenAI, task: dict) -> float:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:x"}])
        await asyncio.Event().wait()
        return 1.0

    traj = served.run(AgentEnvManager(slow, served.endpoint, agent=hangs, tasks=words).run(seed=0))
    assert traj.status == "failed" and "timeout_s" in traj.error


def _run_scheduler(served, groups, config):
    async def go():
        sched = RolloutScheduler(groups, config)
        sched.start()
        batch = await sched.get_batch()
        await sched.stop()
        return sched, batch

    return served.run(go(), timeout=300)


def test_a_round_without_a_reward_is_failed_and_played_again(served):
    attempts: dict[int, int] = {}

    async def agent(client: openai.AsyncOpenAI, task: dict) -> float | None:
        attempts[task["seed"]] = attempts.get(task["seed"], 0) + 1
        first = attempts[task["seed"]] == 1
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:go"}])
        return None if first else float(len(r.choices[0].message.content))  # the first forgets its reward

    config = RolloutConfig(num_env_groups=2, group_size=2, batch_groups=2)
    groups = [
        [AgentEnvManager(SPEC, served.endpoint, agent=agent, tasks=load_tasks(None, {})) for _ in range(2)]
        for _ in range(2)
    ]
    sched, batch = _run_scheduler(served, groups, config)
    trajs = [t for g in batch for t in g]
    assert len(trajs) == 4 and all(t.status == "ok" and t.reward == 2.0 for t in trajs)
    assert sched.counts["trajectories_failed"] == 2 and sched.counts["rounds_failed"] == 2
    assert sorted(attempts.values()) == [4, 4]  # each seed played twice by its two members
    ledger = sched.ledger()
    assert ledger["lost"] == 0 and ledger["failed"] == 2 and ledger["trained"] == 4


def test_a_redundant_agent_is_aborted_in_its_call(served):
    """One group of three keeping two: the third agent is in a long call when the round completes; it
    is aborted (its generation stopped, its session closed) and counted, not trained."""
    order = {"n": 0}
    before = sum(m["aborted"] for m in served.run(served.proxy.worker_metrics()))

    async def agent(client: openai.AsyncOpenAI, task: dict) -> float:
        order["n"] += 1
        content = "SAY:RAMBLE" if order["n"] == 3 else "SAY:go"
        r = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": content}], max_tokens=1500
        )
        return 1.0 if r.choices[0].message.content == "go" else 0.0

    config = RolloutConfig(num_env_groups=1, group_size=3, group_keep=2, batch_groups=1)
    groups = [[AgentEnvManager(SPEC, served.endpoint, agent=agent, tasks=load_tasks(None, {})) for _ in range(3)]]
    sched, batch = _run_scheduler(served, groups, config)
    assert [t.reward for t in batch[0]] == [1.0, 1.0]
    assert sched.counts["trajectories_aborted"] == 1
    assert sum(m["aborted"] for m in served.run(served.proxy.worker_metrics())) == before + 1
    assert len(served.endpoint.sessions) == 0 and sched.ledger()["lost"] == 0


def test_agent_entries_are_checked_before_anything_starts(tmp_path):
    from rollart.config import ConfigError, validate_config

    (tmp_path / "my_agent.py").write_text(
        "async def solve(client, task):\n    return 1.0\n\n"
        "def three(client, task, extra):\n    return 1.0\n\n"
        "def make(seed, level=1):\n    return {'seed': seed, 'level': level}\n"
    )
    base = {
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
        "rollout": {"num_env_groups": 1, "group_size": 2, "batch_groups": 1},
    }

    def problems(entry: dict) -> str:
        with pytest.raises(ConfigError) as err:
            validate_config({**base, "envs": [entry]}, source=tmp_path / "c.yaml")
        return str(err.value)

    cfg = validate_config(
        {**base, "envs": [{"agent": "my_agent:solve", "tasks": "my_agent:make", "kwargs": {"level": 3}}]},
        source=tmp_path / "c.yaml",
    )
    assert cfg.envs[0].agent == "my_agent:solve" and cfg.serving.host == "127.0.0.1"
    assert "give name (an env) or agent" in problems({"name": "reverse", "agent": "my_agent:solve"})
    assert "give name (an env) or agent" in problems({"groups": 2})
    assert "no attribute 'solv'" in problems({"agent": "my_agent:solv"})
    assert "must take (client, task)" in problems({"agent": "my_agent:three"})
    assert "is not a file" in problems({"agent": "my_agent:solve", "tasks": "missing.jsonl"})
    assert "drop backend" in problems({"agent": "my_agent:solve", "backend": "ray"})
    assert "only an agent entry has tasks" in problems({"name": "reverse", "tasks": "my_agent:make"})
    with pytest.raises(ConfigError, match="serving.tool_parser"):
        validate_config({**base, "serving": {"tool_parser": "nope"}})
    rows = tmp_path / "tasks.jsonl"
    rows.write_text('{"q": 1}\n{"q": 2}\n')
    assert load_tasks(str(rows), {})(3) == {"q": 2}
    assert load_tasks("my_agent:make", {"level": 3})(5) == {"seed": 5, "level": 3}


# ---- failures a user can act on: the first of each kind with the user's own code, repeats counted


async def answer_agent(client: openai.AsyncOpenAI, task: dict) -> float:
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:x"}])
    parsed = {"text": r.choices[0].message.content}
    return float(parsed["answer"])  # the harness's bug: a key its parser never writes


ANSWER_LINE = answer_agent.__code__.co_firstlineno + 3


def _errors(caplog, logger="rollart.rollout.failures"):
    return [r for r in caplog.records if r.name == logger and r.levelname == "ERROR"]


def test_an_agents_exception_is_logged_once_with_its_own_file_and_line(served, caplog):
    from rollart.rollout.failures import FailureLog

    log = FailureLog()
    caplog.set_level("WARNING", logger="rollart.rollout.failures")
    for seed in range(12):
        mgr = AgentEnvManager(SPEC, served.endpoint, tag="calc", agent=answer_agent, tasks=words)
        mgr.failures = log
        traj = served.run(mgr.run(seed=seed))
        assert traj.status == "failed" and traj.reward is None and "KeyError: 'answer'" in traj.error
    errors = _errors(caplog)
    assert len(errors) == 1, [r.getMessage() for r in errors]  # the first one, not twelve
    first = errors[0].getMessage()
    assert "calc episode failed: agent: KeyError: 'answer'" in first
    assert f'test_serving_agent.py", line {ANSWER_LINE}, in answer_agent' in first
    shown = first.split("your code", 1)[1]  # only the harness's frames: not rollart's, asyncio's or openai's
    assert 'parsed["answer"]' in shown and "serving/agent.py" not in shown and "asyncio" not in shown
    repeats = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "times now" in r.getMessage()]
    assert repeats == [f"calc the same failure, 10 times now: {log.summary()[0].replace('(12 times)', '(10 times)')}"]
    assert log.cause() == f"agent: KeyError: 'answer' at {__file__}:{ANSWER_LINE} (12 times)"


def test_a_verifier_returning_none_and_an_agent_without_calls_say_what_to_do(served, caplog):
    from rollart.rollout.failures import FailureLog

    async def silent(client: openai.AsyncOpenAI, task: dict) -> None:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:x"}])

    async def no_calls(client: openai.AsyncOpenAI, task: dict) -> float:
        return 1.0

    log = FailureLog()
    caplog.set_level("ERROR", logger="rollart.rollout.failures")
    for agent, reward_fn in ((silent, lambda t: None), (no_calls, None)):
        for seed in range(3):
            mgr = AgentEnvManager(SPEC, served.endpoint, agent=agent, tasks=words, reward_fn=reward_fn)
            mgr.failures = log
            assert served.run(mgr.run(seed=seed)).status in ("failed", "reward_failed")
    messages = [r.getMessage() for r in _errors(caplog)]
    assert len(messages) == 2, messages
    assert "reward function returned None: return the episode's reward (a number)" in messages[0]
    assert "made no call to its session: call the client it is given" in messages[1]
    assert [k.count for k in log.kinds.values()] == [3, 3]


def test_a_rollout_that_keeps_failing_names_the_cause_and_the_users_line(served):
    from rollart.rollout.sample_buffer import RolloutError

    config = RolloutConfig(num_env_groups=1, group_size=2, batch_groups=1, max_consecutive_failed_rounds=3)
    groups = [[AgentEnvManager(SPEC, served.endpoint, agent=answer_agent, tasks=words) for _ in range(2)]]
    with pytest.raises(RolloutError) as info:
        _run_scheduler(served, groups, config)
    assert "3 rounds in a row failed" in str(info.value)
    assert f"most frequent failure: agent: KeyError: 'answer' at {__file__}:{ANSWER_LINE}" in str(info.value)
