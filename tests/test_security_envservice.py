"""Hostile clients against the env server (rollart serve env): tokens, per-tenant sessions that other
clients cannot drive or close, the body-size limit, concurrent opens racing max_sessions, limits a
session cannot raise, and a call's deadline that kills the code it started."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from envservice_fixtures import SlowOpenEnv
from reward_fixtures import free_port
from security_fixtures import descendants, wait_until

from rollart.envservice.client import EnvServiceClient
from rollart.envservice.protocol import EnvServiceRequestError
from rollart.envservice.server import EnvServerSettings, ThreadedServer, build_env_app

pytestmark = pytest.mark.timeout(300)
ENVS = {"counting": "envservice_fixtures:CountingEnv", "slow_open": "envservice_fixtures:SlowOpenEnv"}
TOKEN_A, TOKEN_B = "tenant-a-token-0123456789", "tenant-b-token-0123456789"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def sid() -> str:
    return uuid.uuid4().hex


def open_body(session: str, env: str = "counting", **kwargs: object) -> dict:
    return {"session_id": session, "env": env, "kwargs": kwargs}


def test_every_endpoint_but_healthz_needs_the_token_and_big_bodies_are_413(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENV_TOKEN", TOKEN_A)
    with ThreadedServer(build_env_app(ENVS, EnvServerSettings(token_env="ENV_TOKEN", max_body_bytes=4096))) as srv:
        s = sid()
        assert httpx.post(srv.url + "/sessions", json=open_body(s)).status_code == 401
        assert httpx.post(srv.url + "/sessions", json=open_body(s), headers=bearer(TOKEN_B)).status_code == 401
        assert httpx.post(srv.url + "/describe", json={"env": "counting"}).status_code == 401
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/openapi.json").status_code == 401
        assert httpx.get(srv.url + "/openapi.json", headers=bearer(TOKEN_A)).status_code == 200
        assert httpx.get(srv.url + "/docs").status_code == 401  # no page, and nothing said without the token
        assert httpx.get(srv.url + "/docs", headers=bearer(TOKEN_A)).status_code == 404
        assert httpx.get(srv.url + "/healthz").status_code == 200  # readiness probes need no token
        assert httpx.post(srv.url + "/sessions", json=open_body(s), headers=bearer(TOKEN_A)).status_code == 200
        step = {"seq": 1, "action": "x" * 10_000}
        assert httpx.post(f"{srv.url}/sessions/{s}/step", json=step, headers=bearer(TOKEN_A)).status_code == 413

        async def client_calls() -> None:
            good = EnvServiceClient(srv.url, token=TOKEN_A)
            assert (await good.describe("counting", {})).tag == "counting"
            await good.aclose()
            with pytest.raises(EnvServiceRequestError):
                await EnvServiceClient(srv.url).describe("counting", {})

        asyncio.run(client_calls())


def test_a_session_belongs_to_the_tenant_that_opened_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOK_A", TOKEN_A)
    monkeypatch.setenv("TOK_B", TOKEN_B)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  a: {token_env: TOK_A}\n  b: {token_env: TOK_B}\n")
    with ThreadedServer(build_env_app(ENVS, EnvServerSettings(tenants_file=str(tenants)))) as srv:
        s = sid()
        a, b = bearer(TOKEN_A), bearer(TOKEN_B)
        assert httpx.post(srv.url + "/sessions", json=open_body(s), headers=a).status_code == 200
        assert httpx.post(f"{srv.url}/sessions/{s}/reset", json={"seq": 1}, headers=a).status_code == 200
        # B knows the id: it can neither drive, repeat, reopen nor close A's session
        assert httpx.post(f"{srv.url}/sessions/{s}/step", json={"seq": 2, "action": "x"}, headers=b).status_code == 404
        assert httpx.post(f"{srv.url}/sessions/{s}/reset", json={"seq": 1}, headers=b).status_code == 404
        assert httpx.post(srv.url + "/sessions", json=open_body(s), headers=b).status_code == 409
        assert httpx.delete(f"{srv.url}/sessions/{s}", headers=b).json() == {"closed": False}
        step = httpx.post(f"{srv.url}/sessions/{s}/step", json={"seq": 2, "action": "x"}, headers=a)
        assert step.status_code == 200 and step.json()["seq"] == 2  # A's session goes on
        assert httpx.delete(f"{srv.url}/sessions/{s}", headers=a).json() == {"closed": True}
        assert httpx.post(f"{srv.url}/sessions/{s}/step", json={"seq": 3, "action": "x"}, headers=b).status_code == 404
        assert httpx.post(f"{srv.url}/sessions/{s}/step", json={"seq": 3, "action": "x"}, headers=a).status_code == 410


def test_concurrent_opens_cannot_exceed_max_sessions() -> None:
    SlowOpenEnv.GATE.clear()
    key = uuid.uuid4().hex
    with ThreadedServer(build_env_app(ENVS, EnvServerSettings(max_sessions=2, retry_after_s=0))) as srv:

        async def race() -> list[int]:
            async with httpx.AsyncClient(timeout=90) as http:
                opens = [
                    asyncio.ensure_future(http.post(srv.url + "/sessions", json=open_body(sid(), "slow_open", key=key)))
                    for _ in range(10)
                ]
                end = asyncio.get_running_loop().time() + 30
                while sum(t.done() for t in opens) < 8:  # the refusals come while two envs are being built
                    assert asyncio.get_running_loop().time() < end, "no 429 while the first two were opening"
                    await asyncio.sleep(0.05)
                SlowOpenEnv.GATE.set()
                return [r.status_code for r in await asyncio.gather(*opens)]

        try:
            codes = asyncio.run(race())
        finally:
            SlowOpenEnv.GATE.set()
    assert sorted(codes) == [200, 200] + [429] * 8 and SlowOpenEnv.BUILT[key] == 2


def serve_env(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollart.cli", "serve", "env", *args, "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, 60, "the env server answers /healthz")
    return proc, url


@pytest.mark.skipif(not Path("/usr/bin/bwrap").exists(), reason="needs bubblewrap")
def test_a_timed_out_call_kills_the_code_it_started_and_sessions_cannot_raise_limits() -> None:
    proc, url = serve_env(["code_sandbox", "--sandbox-timeout-s", "30"])
    try:
        for bad in (float("nan"), float("inf"), -1):
            body = json.dumps(open_body(sid(), "code_sandbox", timeout_s=bad))  # NaN, Infinity as Python writes them
            r = httpx.post(url + "/sessions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 422 and "timeout_s" in r.text, (bad, r.text)
        s = sid()
        assert httpx.post(url + "/sessions", json=open_body(s, "code_sandbox", timeout_s=30)).status_code == 200
        assert httpx.post(f"{url}/sessions/{s}/reset", json={"seq": 1, "seed": 0}).status_code == 200
        spin = '<write file="solution.py">while True:\n    pass\n</write><run/>'
        r = httpx.post(f"{url}/sessions/{s}/step", json={"seq": 2, "action": spin, "timeout_s": 1}, timeout=60)
        assert r.status_code == 504 and r.json()["error"] == "env_timeout"
        wait_until(lambda: descendants(proc.pid) == [], 10, "the sandbox of the timed-out call is gone")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_serve_env_refuses_code_envs_without_isolation(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "ROLLART_SANDBOX"} | {"PATH": str(empty)}
    cmd = [sys.executable, "-m", "rollart.cli", "serve", "env", "code_sandbox", "--port", str(free_port())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "bubblewrap" in done.stderr and "--unsafe-no-sandbox" in done.stderr
