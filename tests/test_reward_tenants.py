"""The reward service shared by several jobs: a token per tenant, a concurrency quota per tenant,
per-tenant metrics and an idempotency cache that never answers one tenant with another's result."""

import asyncio
import threading

import httpx
import pytest
from reward_fixtures import ThreadServer

from rollart.cluster.serverless import RetryPolicy
from rollart.reward.client import RewardClient
from rollart.reward.server import ServerSettings, build_app, load_tenants

pytestmark = pytest.mark.timeout(120)
CALLS = {"count": 0}
GATE = threading.Event()


def length(trajectory: dict) -> float:
    CALLS["count"] += 1
    return len(trajectory["response"]) / 10.0


def gated(trajectory: dict) -> float:
    GATE.wait(timeout=60)
    return 1.0


def bearer(token: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **extra}


@pytest.fixture
def tenants_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TOK_A", "token-of-tenant-a-0123")
    monkeypatch.setenv("TOK_B", "token-of-tenant-b-4567")
    path = tmp_path / "tenants.yaml"
    path.write_text(
        "tenants:\n"
        "  job-a: {token_env: TOK_A, max_concurrency: 1}\n"
        "  job-b: {token_env: TOK_B}\n"  # the server's default quota (tenant_max_concurrency)
    )
    return str(path)


def serve(tenants_file: str, **kw) -> ThreadServer:
    settings = ServerSettings(tenants_file=tenants_file, **kw)
    return ThreadServer(build_app({"length": length, "gated": gated}, settings))


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


def test_the_token_names_the_tenant_and_the_cache_is_per_tenant(tenants_file):
    with serve(tenants_file) as srv:
        url = srv.url("/rewards/length")
        one = {"trajectories": [{"response": "abc"}]}
        other = {"trajectories": [{"response": "abcdefghij"}]}
        assert httpx.post(url, json=one).status_code == 401
        assert httpx.post(url, json=one, headers=bearer("token-of-tenant-c-0000")).status_code == 401
        # a tenant cannot be metered (or cached, or throttled) as another
        claim = httpx.post(url, json=one, headers=bearer("token-of-tenant-a-0123", **{"X-Rollart-Tenant": "job-b"}))
        assert claim.status_code == 403 and "job-a" in claim.json()["detail"]
        same = bearer("token-of-tenant-a-0123", **{"X-Rollart-Tenant": "job-a", "Idempotency-Key": "k"})
        assert httpx.post(url, json=one, headers=same).json()["result"] == [0.3]
        before = CALLS["count"]
        # the same Idempotency-Key from tenant B is B's own request: computed, with B's answer
        b = httpx.post(url, json=other, headers=bearer("token-of-tenant-b-4567", **{"Idempotency-Key": "k"}))
        assert b.status_code == 200 and b.json()["result"] == [1.0] and CALLS["count"] == before + 1
        # A's retry with that key is answered from A's cache entry, not recomputed
        again = httpx.post(url, json=one, headers=bearer("token-of-tenant-a-0123", **{"Idempotency-Key": "k"}))
        assert again.json()["result"] == [0.3] and CALLS["count"] == before + 1
        text = httpx.get(srv.url("/metrics"), headers=bearer("token-of-tenant-a-0123")).text
        assert metric(text, 'rollart_reward_trajectories_total{function="length",tenant="job-a"}') == 1.0
        assert metric(text, 'rollart_reward_trajectories_total{function="length",tenant="job-b"}') == 1.0
        assert metric(text, 'rollart_reward_requests_total{function="length",status="403",tenant="job-a"}') == 1.0
        assert (
            metric(text, 'rollart_reward_requests_total{function="length",status="401",tenant="unauthenticated"}') == 2
        )
        assert 'tenant="default"' not in text  # every authenticated request is metered under its token's tenant


def test_a_flooding_tenant_gets_429_and_the_others_are_served(tenants_file):
    GATE.clear()
    with serve(tenants_file, tenant_max_concurrency=4, retry_after_s=1) as srv:

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                a = bearer("token-of-tenant-a-0123")
                first = asyncio.ensure_future(
                    http.post(srv.url("/rewards/gated"), json={"trajectories": [{"response": "x"}]}, headers=a)
                )
                while (
                    'rollart_reward_tenant_in_flight{tenant="job-a"} 1.0'
                    not in (await http.get(srv.url("/metrics"), headers=a)).text
                ):
                    await asyncio.sleep(0.01)
                over = await http.post(
                    srv.url("/rewards/length"), json={"trajectories": [{"response": "x"}]}, headers=a
                )
                assert over.status_code == 429 and over.headers["Retry-After"] == "1"
                assert "job-a" in over.json()["detail"]
                # tenant B (quota 4) is served while A is over its quota; so are its concurrent requests
                b = bearer("token-of-tenant-b-4567")
                bs = await asyncio.gather(
                    *(
                        http.post(srv.url("/rewards/length"), json={"trajectories": [{"response": "xy"}]}, headers=b)
                        for _ in range(3)
                    )
                )
                assert [r.status_code for r in bs] == [200, 200, 200]
                # A's client waits out its 429s (Retry-After) without using up its retries, and gets the
                # real score once A's first request is done: never a 0
                client = RewardClient(
                    srv.url("/rewards/length"), retry=RetryPolicy(retries=0), token_env="TOK_A", tenant="job-a"
                )
                scoring = asyncio.ensure_future(client.score({"response": "abcd"}))
                text = ""
                while metric(text, 'rollart_reward_requests_total{function="length",status="429",tenant="job-a"}') < 2:
                    text = (await http.get(srv.url("/metrics"), headers=a)).text
                    await asyncio.sleep(0.01)
                GATE.set()
                assert (await first).status_code == 200
                assert await scoring == 0.4
                await client.aclose()
                text = (await http.get(srv.url("/metrics"), headers=a)).text
                assert metric(text, 'rollart_reward_requests_total{function="length",status="429",tenant="job-b"}') == 0
                assert metric(text, 'rollart_reward_requests_total{function="length",status="200",tenant="job-b"}') == 3
                assert metric(text, 'rollart_reward_requests_total{function="length",status="200",tenant="job-a"}') == 1
                assert metric(text, 'rollart_reward_compute_seconds_total{function="gated",tenant="job-a"}') > 0

        try:
            asyncio.run(scenario())
        finally:
            GATE.set()


def test_tenants_file_errors_name_the_tenant_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("TOK_A", "same-token-for-two-0000")
    monkeypatch.setenv("TOK_B", "same-token-for-two-0000")
    path = tmp_path / "t.yaml"
    path.write_text("tenants:\n  a: {token_env: TOK_A}\n  b: {token_env: TOK_B}\n")
    with pytest.raises(ValueError, match="share a token"):
        load_tenants(str(path))
    path.write_text("tenants:\n  a: {token_env: NOT_SET_ANYWHERE_123}\n")
    with pytest.raises(ValueError, match=r"tenant 'a': \$NOT_SET_ANYWHERE_123 is not set"):
        load_tenants(str(path))
    path.write_text("tenants:\n  a: {token_env: TOK_A, token: abcdefghijklmnopqrst}\n")
    with pytest.raises(ValueError, match="exactly one of token_env"):
        load_tenants(str(path))
    path.write_text("tenants:\n  'a b': {token_env: TOK_A}\n")
    with pytest.raises(ValueError, match="tenant 'a b'"):
        load_tenants(str(path))
    path.write_text("tenants:\n  a: {token_env: TOK_A}\n")
    with pytest.raises(ValueError, match="--token-env and --tenants"):
        build_app({"length": length}, ServerSettings(tenants_file=str(path), token_env="TOK_B"))


def test_the_documented_shared_service_commands_run_as_written(tmp_path):
    """The reward-service page's tenants.yaml and `rollart serve rewards ... --tenants` line, on a free port."""
    import os
    import re
    import shlex
    import signal
    from pathlib import Path

    from reward_fixtures import free_port, start_reward_server

    page = (Path(__file__).parents[1] / "docs" / "reward-service.md").read_text()
    section = page[page.index("## Shared reward service") :]
    (tmp_path / "tenants.yaml").write_text(re.search(r"<<'YAML'\n(.*?)\nYAML\n", section, re.S).group(1) + "\n")
    command = re.search(r"\n(rollart serve rewards .*?--tenants tenants\.yaml[^\n]*)\n", section.replace("\\\n", ""))
    args = shlex.split(command.group(1))[3:]
    args[args.index("--host") + 1] = "127.0.0.1"
    args = [str(tmp_path / a) if a == "tenants.yaml" else a for a in args]
    del args[args.index("--port") : args.index("--port") + 2]
    env = {**os.environ, "TOKEN_JOB_A": "a" * 32, "TOKEN_JOB_B": "b" * 32}
    port = free_port()
    proc = start_reward_server(args, port, env=env)
    try:
        url = f"http://127.0.0.1:{port}/rewards/reverse"
        body = {"trajectories": [{"prompt": "abc", "response": "cba", "ground_truth": "cba"}]}
        ok = httpx.post(url, json=body, headers=bearer("a" * 32))
        assert ok.status_code == 200 and len(ok.json()["result"]) == 1
        assert httpx.post(url, json=body, headers=bearer("c" * 32)).status_code == 401
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=bearer("a" * 32)).text
        assert metric(text, 'rollart_reward_requests_total{function="reverse",status="200",tenant="job-a"}') == 1
        assert metric(text, "rollart_reward_slots") == 16
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    # a tenant whose token variable is not set: the command fails at once, naming it
    env.pop("TOKEN_JOB_B")
    with pytest.raises(RuntimeError, match=r"job-b.*TOKEN_JOB_B is not set"):
        start_reward_server(args, free_port(), env=env)
