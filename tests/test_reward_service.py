"""The reward service against a real uvicorn server on 127.0.0.1, and its client."""

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest
import reward_fixtures as rf
from fastapi import Request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reward_fixtures import ThreadServer, free_port, start_reward_server

from rollart.cluster.serverless import RetryPolicy
from rollart.reward.builtin import exact_match
from rollart.reward.client import RewardClient, RewardFailed
from rollart.reward.server import AnswerCache, ServerSettings, build_app

pytestmark = pytest.mark.timeout(300)
TRAJ = {"trajectories": [{"response": "abc"}, {"response": "abcdefghij"}]}


def app(**kw):
    fns = {"length": rf.length_score, "gated": rf.gated, "broken": rf.broken, "exact_match": exact_match}
    return build_app(fns, ServerSettings(**kw))


def test_token_401_then_200(monkeypatch):
    monkeypatch.setenv("RW_TOKEN", "t0ken-0123456789abc")
    with ThreadServer(app(token_env="RW_TOKEN")) as srv:
        assert httpx.post(srv.url("/rewards/length"), json=TRAJ).status_code == 401
        wrong = httpx.post(srv.url("/rewards/length"), json=TRAJ, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = httpx.post(srv.url("/rewards/length"), json=TRAJ, headers={"Authorization": "Bearer t0ken-0123456789abc"})
        assert ok.status_code == 200 and ok.json()["result"] == [0.3, 1.0]
        assert httpx.get(srv.url("/healthz")).json()["functions"] == ["broken", "exact_match", "gated", "length"]


def test_oversize_body_413_and_unknown_function_404():
    with ThreadServer(app(max_body_bytes=1000)) as srv:
        big = {"trajectories": [{"response": "x" * 5000}]}
        assert httpx.post(srv.url("/rewards/length"), json=big).status_code == 413

        def chunks():
            for _ in range(10):
                yield b"x" * 500

        assert httpx.post(srv.url("/rewards/length"), content=chunks()).status_code == 413  # streamed, no length
        assert httpx.post(srv.url("/rewards/nope"), json=TRAJ).status_code == 404


def test_saturation_429_with_retry_after_then_success_on_retry():
    rf.GATE.clear()
    with ThreadServer(app(max_concurrency=1, retry_after_s=0)) as srv:

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as http:
                first = asyncio.ensure_future(http.post(srv.url("/rewards/gated"), json=TRAJ))
                while httpx.get(srv.url("/healthz")).json()["in_flight"] < 1:
                    await asyncio.sleep(0.01)
                busy = await http.post(srv.url("/rewards/gated"), json=TRAJ)
                assert busy.status_code == 429 and busy.headers["Retry-After"] == "0"
                rf.GATE.set()
                assert (await first).status_code == 200
                client = RewardClient(srv.url("/rewards/gated"), retry=RetryPolicy(retries=5, backoff_base_s=0.01))
                assert await client.score({"response": "x"}) == 1.0
                await client.aclose()

        asyncio.run(scenario())


def test_raising_reward_is_500_with_its_message_and_the_client_never_scores_zero():
    with ThreadServer(app()) as srv:
        r = httpx.post(srv.url("/rewards/broken"), json=TRAJ)
        assert r.status_code == 500 and "divided by zero" in r.json()["detail"]

        async def scenario():
            client = RewardClient(
                srv.url("/rewards/broken"), retry=RetryPolicy(retries=1, backoff_base_s=0.01), on_failure="drop"
            )
            with pytest.raises(RewardFailed) as info:
                await client.score({"response": "x"})
            await client.aclose()
            return info.value

        err = asyncio.run(scenario())
        assert err.policy == "drop" and "divided by zero" in str(err)


def test_idempotent_retry_is_counted_once_and_tenants_are_metered():
    with ThreadServer(app()) as srv:
        before = rf.CALLS["count"]
        headers = {"Idempotency-Key": "k1", "X-Rollart-Tenant": "job-a"}
        a = httpx.post(srv.url("/rewards/length"), json=TRAJ, headers=headers).json()
        b = httpx.post(srv.url("/rewards/length"), json=TRAJ, headers=headers).json()
        assert a == b and rf.CALLS["count"] - before == 2  # two trajectories, scored once
        httpx.post(srv.url("/rewards/length"), json=TRAJ, headers={"X-Rollart-Tenant": "job-b"})
        metrics = httpx.get(srv.url("/metrics")).text
        assert 'rollart_reward_trajectories_total{function="length",tenant="job-a"} 2.0' in metrics
        assert 'rollart_reward_trajectories_total{function="length",tenant="job-b"} 2.0' in metrics
        assert 'rollart_reward_requests_total{function="length",status="200",tenant="job-a"} 2.0' in metrics
        assert "rollart_reward_latency_seconds_bucket" in metrics


def test_the_idempotency_cache_keeps_only_the_newest_answers():
    """Bounded memory on a long run: past ``idempotency_cache`` answers the oldest key is forgotten (a
    retry of it is scored again), the newest ones are still answered from the cache."""
    with ThreadServer(app(idempotency_cache=3)) as srv:

        def post(key: str) -> None:
            r = httpx.post(srv.url("/rewards/length"), json=TRAJ, headers={"Idempotency-Key": key})
            assert r.status_code == 200 and r.json()["result"] == [0.3, 1.0]

        for key in ("k1", "k2", "k3", "k4"):
            post(key)
        before = rf.CALLS["count"]
        for key in ("k2", "k3", "k4"):
            post(key)
        assert rf.CALLS["count"] == before  # the three newest: from the cache
        post("k1")
        assert rf.CALLS["count"] - before == 2  # evicted: both trajectories scored again


def test_the_idempotency_cache_is_bounded_by_bytes_too():
    """A count bound alone lets big answers hold gigabytes: past ``idempotency_cache_mb`` the oldest
    answers are forgotten (scored again on a retry) although far fewer than ``idempotency_cache`` are
    kept, the newest is still answered from the cache, byte for byte, and an answer over the bound on
    its own is not kept at all."""
    big = {"trajectories": [{"response": "abc"}] * 300}  # its answer: over 1.5 KB encoded
    with ThreadServer(app(idempotency_cache=1000, idempotency_cache_mb=0.01)) as srv:  # 10 KB

        def post(key: str, body: dict = big) -> httpx.Response:
            r = httpx.post(srv.url("/rewards/length"), json=body, headers={"Idempotency-Key": key})
            assert r.status_code == 200 and r.json()["result"] == [0.3] * len(body["trajectories"])
            return r

        first = [post(f"k{i}") for i in range(10)]  # 15 KB or more of answers
        before = rf.CALLS["count"]
        assert post("k9").content == first[9].content and rf.CALLS["count"] == before  # the newest: cached
        post("k0")
        assert rf.CALLS["count"] - before == 300  # the oldest: forgotten, scored again
        huge = {"trajectories": [{"response": "abc"}] * 3000}  # over 10 KB on its own
        post("h1", huge)
        before = rf.CALLS["count"]
        post("h1", huge)
        assert rf.CALLS["count"] - before == 3000  # never cached


def test_answer_cache_never_holds_more_than_its_bounds():
    cache = AnswerCache(max_entries=4, max_bytes=2000)
    for i in range(50):
        cache.put(("t", "f", f"k{i}"), "d" * 64, b"x" * (i * 37 % 900))
        assert len(cache) <= 4 and cache.nbytes <= 2000
    assert cache.get(("t", "f", "k49")) == ("d" * 64, b"x" * (49 * 37 % 900))  # the newest kept
    before = cache.nbytes
    cache.put(("t", "f", "k49"), "e" * 64, b"y")  # a key stored again: its new answer, its new size
    assert cache.get(("t", "f", "k49")) == ("e" * 64, b"y") and len(cache) <= 4
    assert cache.nbytes == before - (49 * 37 % 900 - 1)
    cache.put(("t", "f", "big"), "d" * 64, b"x" * 2000)  # over the bound on its own: not kept
    assert cache.get(("t", "f", "big")) is None and cache.nbytes <= 2000


def test_tenant_labels_are_bounded_and_validated():
    with ThreadServer(app(max_tenants=2)) as srv:
        for tenant in ("job-a", "job-b", "job-c", "job-d", "job-a"):
            r = httpx.post(srv.url("/rewards/length"), json=TRAJ, headers={"X-Rollart-Tenant": tenant})
            assert r.status_code == 200
        bad = httpx.post(srv.url("/rewards/length"), json=TRAJ, headers={"X-Rollart-Tenant": 'a b"}'})
        assert bad.status_code == 422 and "X-Rollart-Tenant" in bad.json()["detail"]
        assert httpx.post(srv.url("/rewards/no-such-fn-1"), json=TRAJ).status_code == 404
        metrics = httpx.get(srv.url("/metrics")).text
        assert 'rollart_reward_trajectories_total{function="length",tenant="job-a"} 4.0' in metrics
        assert 'rollart_reward_trajectories_total{function="length",tenant="job-b"} 2.0' in metrics
        assert 'rollart_reward_trajectories_total{function="length",tenant="other"} 4.0' in metrics
        assert "job-c" not in metrics and "job-d" not in metrics and "no-such-fn" not in metrics
        assert 'rollart_reward_requests_total{function="length",status="422",tenant="invalid"} 1.0' in metrics
        assert 'rollart_reward_requests_total{function="unknown",status="404",tenant="default"} 1.0' in metrics


def test_openapi_declares_the_bearer_scheme_and_401_still_holds(monkeypatch):
    monkeypatch.setenv("RW_TOKEN", "t0ken-0123456789abc")
    with ThreadServer(app(token_env="RW_TOKEN")) as srv:
        auth = {"Authorization": "Bearer t0ken-0123456789abc"}
        spec = httpx.get(srv.url("/openapi.json"), headers=auth).json()
        assert spec["components"]["securitySchemes"]["HTTPBearer"] == {
            "type": "http",
            "scheme": "bearer",
            "description": spec["components"]["securitySchemes"]["HTTPBearer"].get("description"),
        }
        assert {"HTTPBearer": []} in spec["paths"]["/rewards/{name}"]["post"]["security"]
        # unauthenticated: 401 before the body is looked at (a schema error stays hidden)
        r = httpx.post(srv.url("/rewards/length"), json={"nonsense": 1})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = httpx.post(
            srv.url("/rewards/length"), json={"nonsense": 1}, headers={"Authorization": "Basic t0ken-0123456789abc"}
        )
        assert r.status_code == 401
        ok = httpx.post(srv.url("/rewards/length"), json=TRAJ, headers={"Authorization": "Bearer t0ken-0123456789abc"})
        assert ok.status_code == 200
        metrics = httpx.get(srv.url("/metrics"), headers=auth).text
        assert 'rollart_reward_requests_total{function="length",status="401",tenant="unauthenticated"} 2.0' in metrics
    with ThreadServer(app()) as srv:  # no token: no scheme advertised
        assert "securitySchemes" not in httpx.get(srv.url("/openapi.json")).json().get("components", {})


def test_llm_judge_url_comes_from_the_server_and_a_request_cannot_redirect_the_token():
    """``rollart serve rewards ... --judge-url`` as a real server: the judge receives the token; a request
    naming its own ``metadata.judge_url`` is refused with 422 and nothing reaches that address."""
    from fastapi import FastAPI

    seen: dict[str, list] = {"judge": [], "attacker": []}

    def fake(kind: str) -> FastAPI:
        api = FastAPI()

        @api.post("/v1/chat/completions")
        async def chat(request: Request) -> dict:
            seen[kind].append(request.headers.get("authorization"))
            return {"choices": [{"message": {"role": "assistant", "content": "Score: 8"}}]}

        return api

    with ThreadServer(fake("judge")) as judge, ThreadServer(fake("attacker")) as attacker:
        port = free_port()
        env = dict(os.environ, ROLLART_JUDGE_TOKEN="judge-secret")
        env.pop("ROLLART_JUDGE_URL", None)
        proc = start_reward_server(["rollart.reward.builtin:llm_judge", "--judge-url", judge.url()], port, env)
        try:
            url = f"http://127.0.0.1:{port}/rewards/llm_judge"
            traj = {"prompt": "2+2?", "response": "4", "ground_truth": "4"}
            evil = httpx.post(url, json={"trajectories": [dict(traj, metadata={"judge_url": attacker.url()})]})
            assert evil.status_code == 422 and "judge_url" in evil.json()["detail"]
            good = httpx.post(url, json={"trajectories": [traj]})
            assert good.status_code == 200 and good.json()["result"] == [0.8]
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert seen == {"judge": ["Bearer judge-secret"], "attacker": []}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def test_malformed_payloads_get_422_never_500():
    with ThreadServer(app()) as srv, httpx.Client() as http:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=json_values | st.fixed_dictionaries({"trajectories": json_values}))
        def check(body):
            r = http.post(srv.url("/rewards/exact_match"), json=body)
            assert r.status_code in (200, 422), (body, r.status_code, r.text)

        check()
        assert http.post(srv.url("/rewards/exact_match"), content=b"{not json").status_code == 422
        assert (
            http.post(
                srv.url("/rewards/exact_match"), content=b"\x80\x81", headers={"Content-Type": "application/json"}
            ).status_code
            == 422
        )


def test_serve_rewards_takes_the_idempotency_cache_bounds_from_its_flags():
    """``--idempotency-cache-mb 0`` reaches the served app: nothing is kept, so a key reused with
    another body is scored (200) instead of refused as a replay (422, the default)."""
    port = free_port()
    proc = start_reward_server(["rollart.envs.rewards:reverse", "--idempotency-cache-mb", "0"], port, dict(os.environ))
    try:
        url, key = f"http://127.0.0.1:{port}/rewards/reverse", {"Idempotency-Key": "reused-1"}
        one = {"trajectories": [{"response": "ba", "ground_truth": "ab"}]}
        other = {"trajectories": [{"response": "xy", "ground_truth": "ab"}]}
        assert httpx.post(url, json=one, headers=key).status_code == 200
        assert httpx.post(url, json=other, headers=key).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_server_killed_and_restarted_mid_stream_loses_no_reward(tmp_path):
    port = free_port()

    def start():
        return start_reward_server(["rollart.envs.rewards:reverse"], port, dict(os.environ))

    proc = start()
    words = [f"{a}{b}{c}" for a in "abc" for b in "xyz" for c in "mno"]
    trajs = [{"response": w[::-1] if i % 2 == 0 else w, "ground_truth": w[::-1]} for i, w in enumerate(words)]

    async def scenario():
        client = RewardClient(
            f"http://127.0.0.1:{port}/rewards/reverse",
            max_batch=4,
            max_wait_ms=1,
            max_concurrency=2,
            retry=RetryPolicy(retries=40, backoff_base_s=0.05, backoff_max_s=0.5),
        )
        first = await asyncio.gather(*(client.score(t) for t in trajs[:8]))
        os.killpg(proc.pid, signal.SIGKILL)  # the service dies mid-stream
        proc.wait()
        pending = asyncio.gather(*(client.score(t) for t in trajs[8:]))
        restarted = await asyncio.to_thread(start)
        rest = await pending
        await client.aclose()
        return first + rest, restarted

    scores, restarted = asyncio.run(scenario())
    try:
        expected = [exact_match({"response": t["response"], "ground_truth": t["ground_truth"]}) for t in trajs]
        assert scores == pytest.approx([1.0 if e else s for e, s in zip(expected, scores)])
        for t, s in zip(trajs, scores):  # every trajectory has its true score: right answers 1, never 0
            assert s == pytest.approx(rf_reverse(t))
    finally:
        os.killpg(restarted.pid, signal.SIGKILL)
        restarted.wait()


def rf_reverse(t):
    from rollart.envs.verifiable import ReverseTask

    return ReverseTask.verify(t["response"], t["ground_truth"])


def test_a_reward_past_the_timeout_is_504():
    rf.GATE.clear()
    try:
        with ThreadServer(app(timeout_s=0.2)) as srv:
            r = httpx.post(srv.url("/rewards/gated"), json=TRAJ, timeout=30)
            assert r.status_code == 504 and "longer than 0.2s" in r.json()["detail"]
    finally:
        rf.GATE.set()


def test_workers_serve_from_separate_processes_with_the_same_settings():
    """``--workers 2``: two uvicorn worker processes, each rebuilt with the functions and settings given
    on the command line (the bearer token included), and every request answered by one of them."""
    port = free_port()
    env = dict(
        os.environ,
        REWARD_TOKEN="s3cret-0123456789abcdef",
        PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
    )
    proc = start_reward_server(
        [
            "pid=reward_fixtures:process_id",
            "reverse=rollart.envs.rewards:reverse",
            "--workers",
            "2",
            "--token-env",
            "REWARD_TOKEN",
        ],
        port,
        env,
    )
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        workers = {int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()}
        assert len(workers) == 2
        url = f"http://127.0.0.1:{port}/rewards"
        assert httpx.post(f"{url}/pid", json=TRAJ).status_code == 401  # the token reached the workers
        auth = {"Authorization": "Bearer s3cret-0123456789abcdef"}
        for _ in range(8):  # a fresh connection each time: any worker may accept it
            r = httpx.post(f"{url}/pid", json=TRAJ, headers=auth)
            assert r.status_code == 200
            assert {int(s) for s in r.json()["result"]} <= workers
        trajs = [{"response": "cba", "ground_truth": "cba"}, {"response": "abc", "ground_truth": "cba"}]
        r = httpx.post(f"{url}/reverse", json={"trajectories": trajs}, headers=auth)
        assert r.json()["result"] == pytest.approx([rf_reverse(t) for t in trajs])
        assert r.json()["result"][0] == 1.0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
