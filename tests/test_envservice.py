"""The env session protocol (rollart.envservice): exactly-once steps when an answer is lost, typed
errors for gone sessions, per-call timeouts, and the EnvManager turning each fault into a failed or
retried trajectory — never a reward."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from envservice_fixtures import CountingEnv, DropProxy, SlowEnv
from rollout_fixtures import CharCodec

from rollart.cluster.serverless import RetryPolicy
from rollart.engines.base import SamplingParams
from rollart.envservice import (
    EnvProtocolError,
    EnvServiceClient,
    EnvServiceRequestError,
    EnvServiceUnavailable,
    EnvSessionLost,
    RemoteEnv,
    ServerPool,
)
from rollart.envservice.protocol import EnvOverrides
from rollart.envservice.server import ThreadedServer, build_env_app
from rollart.rollout.config import EnvManagerConfig
from rollart.rollout.env_manager import EnvManager
from rollart.rollout.types import GenerateOutput, GenerateRequest

ENVS = {"counting": "envservice_fixtures:CountingEnv", "slow": "envservice_fixtures:SlowEnv", "reverse": "reverse"}
FAST = RetryPolicy(retries=3, backoff_base_s=0.01, backoff_max_s=0.05)


@pytest.fixture(scope="module")
def server():
    with ThreadedServer(build_env_app(ENVS)) as srv:
        yield srv


class Proxy:
    """An LLMProxy stand-in: answers every turn with ``ids``; ``before`` runs before turn ``at``."""

    def __init__(self, ids: list[int], at: int = -1, before: Any = None):
        self.ids, self.at, self.before, self.turn = ids, at, before, 0

    async def generate(self, request: GenerateRequest, tag: str, *, trace=None, cost=None) -> GenerateOutput:
        if self.turn == self.at and self.before is not None:
            await asyncio.to_thread(self.before)
        self.turn += 1
        n = len(self.ids)
        return GenerateOutput(
            request_id=request.request_id,
            output_token_ids=list(self.ids),
            output_logprobs=[-0.1] * n,
            token_versions=[0] * n,
            finish_reason="stop",
        )

    async def abort(self, request_ids: list[str]) -> None:
        return None


async def remote(url: str, env: str, key: str, *, timeout_s: float | None = None) -> RemoteEnv:
    pool = ServerPool(env, [url], retry=FAST)
    description = await pool.describe(env, {"key": key}, EnvOverrides())
    return RemoteEnv(pool, env, description, kwargs={"key": key}, timeout_s=timeout_s)


async def test_a_step_whose_answer_is_lost_is_resent_and_applied_once(server):
    proxy = DropProxy(("127.0.0.1", server.port))
    env = await remote(await proxy.start(), "counting", key := uuid.uuid4().hex)
    try:
        assert (env.tag, env.max_steps, env.max_new_tokens) == ("counting", 2, 4)
        assert await env.reset(7) == ("start 7:", {"seed": 7})
        proxy.arm(b"/step")  # the server applies step 1, its answer never reaches the client
        assert await env.step("a") == ("obs1:", 1.0, False, False, {"t": 1})
        assert proxy.dropped == 1
        assert CountingEnv.APPLIED[key] == 1  # resent with the same seq: answered from the stored result
        assert await env.step("b") == ("obs2:", 1.0, True, False, {"t": 2})
        assert CountingEnv.APPLIED[key] == 2
        metrics = (await EnvServiceClient(server.url).request("GET", "/healthz"))["sessions"]
        assert metrics >= 1
        import httpx

        text = httpx.get(server.url + "/metrics").text
        assert "rollart_env_replays_total 1.0" in text
        assert 'rollart_env_calls_total{op="step",status="200"} 3.0' in text  # 2 applied + 1 replay
    finally:
        await env.aclose()
        await proxy.stop()


async def test_protocol_errors_are_typed(server):
    client = EnvServiceClient(server.url, retry=FAST)
    assert (await client.healthz())["envs"] == ["counting", "reverse", "slow"]
    sid = uuid.uuid4().hex
    described = await client.open(sid, "counting", {"key": sid}, seed=3)
    assert described.tag == "counting"
    assert (await client.open(sid, "counting", {"key": sid}, seed=3)).tag == "counting"  # a repeated open: same session
    assert (await client.call(sid, "reset", 1, {"seed": None}))["observation"] == "start 3:"  # the session's seed
    with pytest.raises(EnvProtocolError, match="got seq 5, expected 2"):
        await client.call(sid, "step", 5, {"action": "x"})
    with pytest.raises(EnvServiceRequestError, match="'nope' is not served here"):
        await client.open(uuid.uuid4().hex, "nope", {})
    with pytest.raises(EnvServiceRequestError, match="unknown argument 'colour'"):
        await client.open(uuid.uuid4().hex, "counting", {"colour": 1})
    assert await client.close_session(sid)
    with pytest.raises(EnvSessionLost, match="ended: closed by the client") as gone:
        await client.call(sid, "step", 2, {"action": "x"})
    assert gone.value.status == 410 and gone.value.session_id == sid
    with pytest.raises(EnvSessionLost, match="no session") as unknown:
        await client.call(uuid.uuid4().hex, "step", 1, {"action": "x"})
    assert unknown.value.status == 404
    await client.aclose()


async def test_a_restarted_server_has_lost_the_session_and_a_reset_opens_a_new_one():
    first = ThreadedServer(build_env_app(ENVS)).start()
    port = first.port
    env = await remote(first.url, "counting", uuid.uuid4().hex)
    await env.reset(1)
    first.stop()
    second = ThreadedServer(build_env_app(ENVS), port=port).start()
    try:
        with pytest.raises(EnvSessionLost, match="no session") as lost:
            await env.step("a")
        assert lost.value.status == 404
        with pytest.raises(EnvSessionLost, match="the session was lost"):  # no silent new session mid-episode
            await env.step("a")
        assert await env.reset(2) == ("start 2:", {"seed": 2})
        assert env.sessions_opened == 2
        assert (await env.step("a"))[1] == 1.0
    finally:
        await env.aclose()
        second.stop()


async def test_a_fail_slow_env_times_out_the_call_and_the_env_manager_retries_or_fails_it(server):
    key = uuid.uuid4().hex
    gate = SlowEnv.GATES.setdefault(key, threading.Event())
    env = await remote(server.url, "slow", key, timeout_s=0.3)
    cfg = EnvManagerConfig(reset_retries=2, reset_backoff_s=0.01, step_retries=1)
    try:
        SlowEnv.SLOW[key] = {"reset"}  # the first reset hangs: 504, its session ends; the retry opens another
        traj = await EnvManager(env, Proxy([5, 6]), CharCodec(), config=cfg, sampling=SamplingParams()).run(seed=4)
        assert traj.status == "ok" and traj.reward == 2.0 and env.sessions_opened == 2
        SlowEnv.SLOW[key] = {"step"}  # a step hangs: the episode cannot go on
        traj = await EnvManager(env, Proxy([5, 6]), CharCodec(), config=cfg).run(seed=5)
        assert traj.status == "failed" and traj.reward is None
        # the 504 ended the session; the step retry found it gone and says why
        assert "step 0: EnvSessionLost" in traj.error and "EnvCallTimeout" in traj.error, traj.error
        assert CountingEnv.APPLIED[key] == 2  # only the first episode's two steps were applied
    finally:
        gate.set()
        await env.aclose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_rollart_serve_env_killed_mid_episode_fails_the_trajectory_without_a_reward(tmp_path):
    (tmp_path / "my_envs.py").write_text(
        "from rollart.envs import TextEnv\n\n"
        "class Echo(TextEnv):\n"
        "    tag = 'echo'\n"
        "    max_steps = 3\n"
        "    def reset(self, seed=None):\n"
        "        return 'say:', {}\n"
        "    def step(self, action):\n"
        "        return 'again:', 1.0, False, False, {}\n"
    )
    port = _free_port()
    env_vars = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollart.cli", "serve", "env", "echo=my_envs:Echo", "--port", str(port)],
        cwd=tmp_path,
        env=env_vars,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        waiting = EnvServiceClient(
            f"127.0.0.1:{port}", retry=RetryPolicy(retries=100, backoff_base_s=0.1, backoff_max_s=0.3)
        )
        assert (await waiting.healthz())["envs"] == ["echo"]  # `rollart serve env` serves the user's class
        await waiting.aclose()
        pool = ServerPool("echo", [f"127.0.0.1:{port}"], retry=FAST)
        env = RemoteEnv(pool, "echo", await pool.describe("echo", {}, EnvOverrides()))

        def kill() -> None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

        # the server dies after the first step was answered, while the model writes the second action
        manager = EnvManager(env, Proxy([5], at=1, before=kill), CharCodec(), config=EnvManagerConfig(step_retries=1))
        traj = await manager.run(seed=0)
        assert traj.status == "failed" and traj.reward is None
        assert "step 1: EnvSessionLost" in traj.error and "EnvServiceUnavailable" in traj.error, traj.error
        assert traj.env_return == 1.0  # the first step's reward is kept, the trajectory is not scored
        assert pool.down == {f"http://127.0.0.1:{port}"}  # no new session goes there
        with pytest.raises(EnvServiceUnavailable, match="no live env server"):
            await env.reset(0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_remote_env_gives_the_trajectory_the_local_env_gives(server):
    from rollart.envs import EnvSpec, make_env

    spec = EnvSpec(name="reverse", max_new_tokens=3, kwargs={"length": 3})
    pool = ServerPool("reverse", [server.url], retry=FAST)
    overrides = EnvOverrides(max_new_tokens=3)
    env = RemoteEnv(
        pool,
        "reverse",
        await pool.describe("reverse", {"length": 3}, overrides),
        kwargs={"length": 3},
        overrides=overrides,
    )
    local = make_env(spec)
    assert (env.tag, env.max_steps, env.max_new_tokens, env.instructions) == (
        local.tag,
        local.max_steps,
        local.max_new_tokens,
        local.instructions,
    )
    try:
        for seed in (0, 1, 2):
            ids = [2 + seed, 3, 4]
            a = await EnvManager(local, Proxy(ids), CharCodec()).run(seed=seed, traj_id="t")
            b = await EnvManager(env, Proxy(ids), CharCodec()).run(seed=seed, traj_id="t")
            assert a.status == b.status == "ok"
            # the wall time of the episode (info.duration_s) is the only field allowed to differ
            info_a, info_b = ({k: v for k, v in t.info.items() if k != "duration_s"} for t in (a, b))
            assert (a.token_ids, a.loss_mask, a.reward, a.token_rewards, info_a) == (
                b.token_ids,
                b.loss_mask,
                b.reward,
                b.token_rewards,
                info_b,
            )
        assert env.sessions_opened == 1  # one session, reset for every episode
    finally:
        await env.aclose()


def test_config_checks_the_backend_of_each_env():
    from rollart.config import ConfigError, validate_config

    base = {
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
        "rollout": {"num_env_groups": 1, "batch_groups": 1},
    }
    with pytest.raises(ConfigError, match=r"envs\[0\].pool: backend ray places env servers on pool 'env'"):
        validate_config({**base, "envs": [{"name": "reverse", "backend": "ray"}]})
    pools = {**base["pools"], "env": {"hardware": "CPU", "cpus": 2}}
    with pytest.raises(ConfigError, match=r"ask for 3 env servers .* pools.env.cpus is 2"):
        validate_config({**base, "pools": pools, "envs": [{"name": "reverse", "backend": "ray", "servers": 3}]})
    cfg = validate_config({**base, "pools": pools, "envs": [{"name": "reverse", "backend": "ray", "servers": 2}]})
    assert (cfg.envs[0].backend, cfg.envs[0].servers, cfg.envs[0].pool) == ("ray", 2, "env")
    with pytest.raises(ConfigError, match=r"envs\[0\]: kubernetes: a pod spec is set but backend is 'local'"):
        validate_config({**base, "envs": [{"name": "reverse", "kubernetes": {"image": "x"}}]})
    from rollart.envservice.config import kubernetes_problem

    if kubernetes_problem() is not None:  # until the Kubernetes backend is in this build: refused, saying so
        with pytest.raises(ConfigError, match=r"envs\[0\]: backend: kubernetes is not available"):
            validate_config({**base, "envs": [{"name": "reverse", "backend": "kubernetes"}]})
