"""@register_serverless through a Cluster, against a real HTTP server on 127.0.0.1."""

import asyncio

import pytest
from http_fixtures import ScriptedServer

import rollart as ra
from rollart.cluster.serverless import ServerlessRequestError, ServerlessRetriesExhausted


def score(body):
    return {"result": [len(t["response"]) / 10 for t in body["trajectories"]]}


def reward_class(url, retries=3, token_env=None, is_async=False):
    if is_async:

        class Reward(ra.Worker):
            @ra.register_serverless(url=url, timeout_s=5, retries=retries, token_env=token_env, backoff_base_s=0.01)
            async def compute_rewards(self, trajectories: list, scale: float = 1.0) -> list:
                raise AssertionError("never runs locally")
    else:

        class Reward(ra.Worker):
            @ra.register_serverless(url=url, timeout_s=5, retries=retries, token_env=token_env, backoff_base_s=0.01)
            def compute_rewards(self, trajectories: list, scale: float = 1.0) -> list:
                raise AssertionError("never runs locally")

    return Reward


TRAJS = [{"response": "abc"}, {"response": "abcdefghij"}]


def test_503_then_success_with_token_and_one_idempotency_key(make_rm, monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN", "s3cret")
    rm = make_rm({"env": {"hardware": "CPU", "cpus": 1}})
    with ScriptedServer() as srv:
        srv.script.extend([(503, {"detail": "warming up"}, {}), (503, {"detail": "warming up"}, {}), (200, score, {})])
        reward = ra.Cluster("reward", reward_class(srv.url("/rewards/math"), token_env="REWARD_TOKEN"), rm, pool=None)
        assert reward.compute_rewards(TRAJS) == [0.3, 1.0]
        assert len(srv.requests) == 3
        assert {r["headers"]["Authorization"] for r in srv.requests} == {"Bearer s3cret"}
        assert len({r["headers"]["Idempotency-Key"] for r in srv.requests}) == 1
        assert srv.requests[0]["body"] == {"trajectories": TRAJS, "scale": 1.0}
        assert srv.requests[0]["headers"]["X-Rollart-Tenant"] == rm.job_id


def test_429_honours_retry_after_then_succeeds(make_rm):
    rm = make_rm({"env": {"hardware": "CPU", "cpus": 1}})
    with ScriptedServer() as srv:
        srv.script.extend([(429, {"detail": "busy"}, {"Retry-After": "0"}), (200, score, {})])
        reward = ra.Cluster("reward", reward_class(srv.url("/r")), rm, pool=None)
        assert reward.compute_rewards(TRAJS, scale=2.0) == [0.3, 1.0]
        assert len(srv.requests) == 2


def test_persistent_failure_raises_never_a_default(make_rm):
    rm = make_rm({"env": {"hardware": "CPU", "cpus": 1}})
    with ScriptedServer() as srv:
        srv.default = (500, {"detail": "reward crashed: division by zero"}, {})
        reward = ra.Cluster("reward", reward_class(srv.url("/r"), retries=2), rm, pool=None)
        with pytest.raises(ServerlessRetriesExhausted, match="division by zero") as info:
            reward.compute_rewards(TRAJS)
        assert info.value.attempts == 3 and info.value.status == 500 and len(srv.requests) == 3


def test_400_is_not_retried_and_carries_the_message(make_rm):
    rm = make_rm({"env": {"hardware": "CPU", "cpus": 1}})
    with ScriptedServer() as srv:
        srv.default = (400, {"detail": "trajectories[0].response missing"}, {})
        reward = ra.Cluster("reward", reward_class(srv.url("/r")), rm, pool=None)
        with pytest.raises(ServerlessRequestError, match=r"trajectories\[0\]\.response missing"):
            reward.compute_rewards(TRAJS)
        assert len(srv.requests) == 1


def test_missing_token_variable_fails_before_any_request(make_rm, monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    rm = make_rm({"env": {"hardware": "CPU", "cpus": 1}})
    with ScriptedServer() as srv:
        srv.default = (200, score, {})
        reward = ra.Cluster("reward", reward_class(srv.url("/r"), token_env="NO_SUCH_TOKEN"), rm, pool=None)
        with pytest.raises(ServerlessRequestError, match="NO_SUCH_TOKEN"):
            reward.compute_rewards(TRAJS)
        assert srv.requests == []


def test_connection_refused_is_retried_then_raises(make_rm):
    rm = make_rm({"env": {"hardware": "CPU", "cpus": 1}})
    with ScriptedServer() as srv:
        dead_url = srv.url("/r")
    reward = ra.Cluster("reward", reward_class(dead_url, retries=2), rm, pool=None)
    with pytest.raises(ServerlessRetriesExhausted, match="ConnectError") as info:
        reward.compute_rewards(TRAJS)
    assert info.value.attempts == 3 and info.value.status is None


async def test_async_and_non_blocking_forms(make_rm):
    rm = make_rm({"env": {"hardware": "CPU", "cpus": 1}})
    with ScriptedServer() as srv:
        srv.default = (200, score, {})
        areward = ra.Cluster("areward", reward_class(srv.url("/r"), is_async=True), rm, pool=None)
        results = await asyncio.gather(*[areward.compute_rewards(TRAJS) for _ in range(3)])
        assert results == [[0.3, 1.0]] * 3
        reward = ra.Cluster("reward", reward_class(srv.url("/r")), rm, pool=None)
        fut = reward.compute_rewards(TRAJS, blocking=False)
        assert await asyncio.wrap_future(fut) == [0.3, 1.0]
