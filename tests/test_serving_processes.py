"""The endpoint in server processes of its own (``serving.processes``), beside the LLMProxy in the driver.

Two endpoint processes over the scripted engine (``serving_fixtures.ScriptedEngine``; the inference
worker, the LLMProxy, the endpoint processes, the internal socket and the tokenizer are the real
ones): sessions opened by the driver are spread over both, the official clients reach them on each
process's port, and a closed session comes back to the driver token-exact, with its reward; the job's
token guards every process; a stream's first text reaches the client while the engine still holds the
reply; a process that dies is started again on its port, the episode whose session it held fails
(never a 0) and the next episode plays.
"""

from __future__ import annotations

import json
import os
import signal
from urllib.parse import urlparse

import anthropic
import httpx
import pytest
from serving_fixtures import TOOLS, ServedPolicy, build_merging_tokenizer, script_logprob

import rollart as ra
from rollart.rollout.inference_worker import inference_worker_class

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "12+7"}}</tool_call>'


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory):
    folder = build_merging_tokenizer(tmp_path_factory.mktemp("tok"))
    rm = ra.ResourceManager({"procs": {"hardware": "H20", "devices": 1}}, store=tmp_path_factory.mktemp("s") / "m.db")
    cluster = ra.Cluster(
        "infer-procs",
        inference_worker_class({"*": ["H20"]}),
        rm,
        pool="procs",
        worker_kwargs={"engine": {"kind": "serving_fixtures:ScriptedEngine", "model": str(folder)}},
    )
    policy = ServedPolicy(cluster, str(folder), serving={"processes": 2, "max_n": 2})
    yield policy
    policy.close()
    cluster.shutdown()
    rm.shutdown()


@pytest.fixture(scope="module")
def tok(served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served.model_path)


def _check_exact(traj, calls) -> None:
    """The trajectory is the last call's prompt and reply, and each reply is the engine's ids and
    log-probs at their positions."""
    assert traj.token_ids == calls[-1].prompt.token_ids + calls[-1].choices[0].token_ids
    assert len(traj.turns) == len(calls)
    for (s, e), call in zip(traj.turns, calls):
        assert traj.token_ids[s:e] == call.choices[0].token_ids
        assert traj.logprobs[s:e] == [script_logprob(t, p) for p, t in enumerate(traj.token_ids[s:e], start=s)]
        assert traj.loss_mask[s:e] == [1] * (e - s)


def test_sessions_spread_over_the_processes_and_come_back_token_exact(served, tok):
    """Four sessions on two processes (two ports, neither the driver's process), each a tool call then
    an answer generated character by character (its text re-tokenises into other ids): the sessions the
    driver gets back hold exactly the engine's ids and log-probs, and the reward one was given."""
    endpoint = served.endpoint
    assert len(endpoint.pids()) == 2 and os.getpid() not in endpoint.pids()
    sessions = [served.open_session() for _ in range(4)]
    ports = [urlparse(endpoint.session_url(s)).port for s in sessions]
    assert sorted(ports) == sorted([p.port for p in endpoint.processes.values()] * 2)  # two on each
    for session in sessions:
        client = served.client(session)
        messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": f"SAY:{CALL}"}]
        r1 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        call = r1.choices[0].message.tool_calls[0]
        assert json.loads(call.function.arguments) == {"expression": "12+7"}
        messages += [r1.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "SAY:SPLIT:hello 19"}]
        r2 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert r2.choices[0].message.content == "hello 19"
    reward = httpx.post(
        f"{endpoint.session_url(sessions[0])[:-3]}/reward", json={"reward": 0.5}, headers=served.headers
    )
    assert reward.status_code == 200
    recorded = [served.recorded(s) for s in sessions]
    split_ids = [i for ch in "hello 19" for i in tok.encode(ch, add_special_tokens=False)]
    for session in recorded:
        c1, c2 = session.calls
        assert c2.parent == (0, 0) and c2.choices[0].token_ids == [*split_ids, tok.eos_token_id]
        _check_exact(session.trajectory("t"), [c1, c2])
    assert [s.reward for s in recorded] == [0.5, None, None, None]
    assert tok.encode("hello 19", add_special_tokens=False) != split_ids  # the text re-tokenises differently


def test_each_process_speaks_every_protocol_and_checks_the_jobs_token(served, tok):
    """Completions with log-probs, the Responses API and the Anthropic Messages API through a
    process, recorded token-exact; a call without the job's token is refused 401 on every process."""
    session = served.open_session()
    client = served.client(session)
    r = client.completions.create(model="policy", prompt="SAY:hello", max_tokens=8, logprobs=0)
    assert r.choices[0].text == "hello" and r.choices[0].logprobs.token_logprobs
    response = client.responses.create(model="policy", input="SAY:ok done", max_output_tokens=8)
    assert response.output_text == "ok done"
    url = urlparse(served.endpoint.session_url(session))
    claude = anthropic.Anthropic(base_url=f"http://{url.netloc}{url.path[:-3]}", api_key=served.endpoint.token)
    message = claude.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "SAY:world"}])
    assert message.content[0].text == "world"
    recorded = served.recorded(session)
    assert [c.kind for c in recorded.calls] == ["completion", "chat", "chat"]
    for call in recorded.calls:
        out = call.choices[0]
        start = len(call.prompt.token_ids)
        assert out.logprobs == [script_logprob(t, p) for p, t in enumerate(out.token_ids, start=start)]
    # the addresses a session records are its calls' peers, never a forwarding header
    spoof = served.open_session()
    r = httpx.post(
        f"{served.endpoint.session_url(spoof)}/completions",
        json={"model": "policy", "prompt": "SAY:x", "max_tokens": 4},
        headers={**served.headers, "X-Forwarded-For": "10.9.9.9"},
    )
    assert r.status_code == 200 and served.recorded(spoof).clients == {"127.0.0.1"}
    for base in served.endpoint.urls():
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/v1/models", headers=served.headers).json()["data"][0]["id"] == "policy"


def test_a_streams_first_text_arrives_while_the_engine_holds_the_reply(served, tok, tmp_path):
    """Through a process: the scripted engine decodes one token and holds the request until the test
    creates a file; the client has the first text while the worker's step records show the reply not
    ended, and the whole reply once the test lets it go on."""
    gate = tmp_path / "gate"
    session = served.open_session()
    client = served.client(session).with_options(timeout=60, max_retries=0)
    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": f"SAY:GATE:{gate}"}], max_tokens=8, stream=True
    )
    pieces = (c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content)
    try:
        first = next(pieces)
        records = {k: v for per_worker in served.cluster.stream_records().result() for k, v in per_worker.items()}
        record = records[f"{session.id}:0:0"]
        assert first == "a" and record["first_step"] is not None and record["end_step"] is None
        gate.touch()
        rest = "".join(pieces)
    finally:
        stream.close()
    assert first + rest == "a" * 8
    assert tok.decode(served.recorded(session).calls[0].choices[0].token_ids) == "a" * 8


def test_a_dead_process_starts_again_and_its_episode_fails_never_a_zero(served):
    """An agent's process is killed mid-episode: the endpoint starts it again on the same port, the
    episode is ``failed`` with the reason (its session went with the process; the 1.0 the agent
    returned is not trusted), and the next episode on that process is scored."""
    from rollart.serving.agent import AgentEnvManager, AgentSpec

    endpoint = served.endpoint

    async def killing(client, task):
        await client.completions.create(model="policy", prompt="SAY:one", max_tokens=8)
        [process] = [p for p in endpoint.processes.values() if p.port == client.base_url.port]
        task["port"] = process.port
        os.kill(process.popen.pid, signal.SIGKILL)
        await endpoint.starts.wait(process.index, endpoint.starts[process.index] + 1)
        return 1.0

    async def fine(client, task):
        r = await client.completions.create(model="policy", prompt="SAY:two", max_tokens=8)
        return 1.0 if r.choices[0].text == "two" else 0.0

    task: dict = {}
    spec = AgentSpec(agent="unused:unused")
    manager = AgentEnvManager(spec, endpoint, agent=killing, tasks=lambda seed: task)
    traj = served.run(manager.run(seed=0))
    assert traj.status == "failed" and traj.reward is None
    assert "session is gone" in traj.error and "endpoint process went away" in traj.error
    assert task["port"] in [p.port for p in endpoint.processes.values()]  # started again on its port
    fresh = AgentEnvManager(spec, endpoint, agent=fine, tasks=lambda seed: {})
    outcomes = [served.run(fresh.run(seed=i)) for i in range(2)]  # one episode on each process
    assert [(t.status, t.reward) for t in outcomes] == [("ok", 1.0), ("ok", 1.0)]


@pytest.fixture(scope="module")
def harness(served):
    from pathlib import Path

    from rollart.serving.harness import HarnessPool

    pool = HarnessPool(2, [str(Path(__file__).parent)])
    served.run(pool.start())
    yield pool
    served.run(pool.stop())


def _manager(served, harness, agent: str, task: dict):
    from rollart.serving.agent import AgentEnvManager, AgentSpec, load_agent

    spec = AgentSpec(agent=f"serving_agents:{agent}", timeout_s=60)
    return AgentEnvManager(
        spec, served.endpoint, agent=load_agent(spec.agent), tasks=lambda seed: task, harness=harness
    )


@pytest.mark.parametrize("agent", ["where_i_run", "blocking_where_i_run"])
def test_agent_episodes_play_in_the_harness_processes(served, harness, agent, tmp_path):
    """With harness processes, an agent (async, or blocking in a thread) plays in one of them, not in the
    driver's process, through its session on an endpoint process; the episode's trajectory and its
    reward reach the driver as with an agent in the driver."""
    pid_file = tmp_path / "pid"
    traj = served.run(_manager(served, harness, agent, {"pid_file": str(pid_file), "say": "hello"}).run(seed=0))
    assert (traj.status, traj.reward) == ("ok", 1.0)
    pid = int(pid_file.read_text())
    assert pid in harness.pids() and pid != os.getpid()
    assert traj.info["calls"] == 1 and traj.turns and sum(traj.loss_mask) == traj.turns[0][1] - traj.turns[0][0]


def test_a_harness_processs_failures_name_the_users_line_and_a_dead_one_starts_again(served, harness, caplog):
    """An agent's KeyError in a harness process fails its episode with the error and is logged once with
    the user's own file and line; a harness process that dies mid-episode fails that episode (never a 0)
    and is started again, and the next episode plays."""
    import logging

    from rollart.rollout.failures import FailureLog

    failures = FailureLog()
    manager = _manager(served, harness, "misreads", {})
    manager.failures = failures
    with caplog.at_level(logging.ERROR, logger="rollart.rollout.failures"):
        traj = served.run(manager.run(seed=0))
    assert traj.status == "failed" and traj.reward is None and traj.error == "agent: KeyError: 'answer'"
    [kind] = failures.kinds.values()
    assert kind.location.endswith("serving_agents.py:" + str(_line_of("serving_agents.py", 'float(task["answer"])')))
    assert "serving_agents.py" in caplog.text and "KeyError" in caplog.text

    starts = harness.starts.total
    traj = served.run(_manager(served, harness, "dies", {}).run(seed=1))
    assert traj.status == "failed" and traj.reward is None and "harness process" in traj.error
    served.run(harness.starts.wait(None, starts + 1))  # the dead one started again
    assert len(harness.pids()) == 2
    again = served.run(_manager(served, harness, "where_i_run", {"pid_file": os.devnull, "say": "ok"}).run(seed=2))
    assert (again.status, again.reward) == ("ok", 1.0)


def _line_of(name: str, text: str) -> int:
    from pathlib import Path

    lines = (Path(__file__).parent / name).read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if text in line)


def test_a_process_answers_the_version_its_calls_were_served_with(served):
    """After a weight update, a call through a process is served at the new version and says so, and the
    process's ``/v1/models`` then names it."""
    served.run(served.proxy.model_update({}, 3))  # the workers now serve weight version 3
    session = served.open_session()
    r = served.client(session).completions.create(model="policy", prompt="SAY:v", max_tokens=4)
    assert r.system_fingerprint == "rollart-v3"
    base = served.endpoint.session_url(session).split("/sessions/")[0]
    assert httpx.get(f"{base}/v1/models", headers=served.headers).json()["data"][0]["version"] == 3
    assert set(served.recorded(session).calls[0].choices[0].versions) == {3}
