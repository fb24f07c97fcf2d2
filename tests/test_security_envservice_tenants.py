"""Two tenants of one env server, one of them hostile: it cannot take every session, cannot make the
server build a huge env (kwargs bounded in size and by the env's declared limits, ``/describe``
included), and its calls that time out keep running against its own threads only."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from envservice_fixtures import GatedResetEnv
from security_fixtures import wait_until

from rollart.envservice.server import EnvServerSettings, ThreadedServer, build_env_app

pytestmark = pytest.mark.timeout(180)
ENVS = {
    "reverse": "reverse",
    "counting": "envservice_fixtures:CountingEnv",
    "gated": "envservice_fixtures:GatedResetEnv",
}
TOKENS = {"a": "env-tenant-a-0123456789", "b": "env-tenant-b-0123456789"}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[tenant]}"}


def sid() -> str:
    return uuid.uuid4().hex


@contextmanager
def two_tenants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> Iterator[str]:
    for name, token in TOKENS.items():
        monkeypatch.setenv(f"ENV_TENANT_{name.upper()}", token)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  a: {token_env: ENV_TENANT_A}\n  b: {token_env: ENV_TENANT_B}\n")
    app = build_env_app(ENVS, EnvServerSettings(tenants_file=str(tenants), **settings))
    with ThreadedServer(app) as srv:
        yield srv.url


def open_session(url: str, tenant: str, env: str = "counting", **kwargs: Any) -> httpx.Response:
    body = {"session_id": sid(), "env": env, "kwargs": kwargs}
    return httpx.post(url + "/sessions", json=body, headers=auth(tenant), timeout=30)


def test_one_tenant_cannot_take_every_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with two_tenants(tmp_path, monkeypatch, max_sessions=4) as url:  # two each by default
        assert [open_session(url, "a").status_code for _ in range(2)] == [200, 200]
        refused = open_session(url, "a")
        assert refused.status_code == 429 and "tenant_max_sessions=2" in refused.json()["detail"]
        assert refused.headers["Retry-After"]
        described = httpx.post(url + "/describe", json={"env": "counting"}, headers=auth("a"))
        assert described.status_code == 429  # a describe builds an env too: under the same quota
        assert [open_session(url, "b").status_code for _ in range(2)] == [200, 200]  # b keeps its share


def test_kwargs_are_bounded_in_size_and_by_the_envs_declared_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with two_tenants(tmp_path, monkeypatch) as url:
        for path in ("/sessions", "/describe"):
            body: dict[str, Any] = {"env": "reverse", "kwargs": {"length": 8_000_000}}
            if path == "/sessions":
                body["session_id"] = sid()
            r = httpx.post(url + path, json=body, headers=auth("a"))
            assert r.status_code == 422 and "kwargs.length=8000000" in r.json()["detail"], r.text
            assert "[1, 4096]" in r.json()["detail"]
            body["kwargs"] = {"letters": "ab" * 50_000}  # 100 kB of JSON
            r = httpx.post(url + path, json=body, headers=auth("a"))
            assert r.status_code == 422 and "bytes of JSON" in r.json()["detail"], r.text
        ok = open_session(url, "a", "reverse", length=4096)
        assert ok.status_code == 200 and ok.json()["tag"] == "reverse-4096"


def test_calls_that_timed_out_hold_their_tenants_threads_not_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tenant a's resets run away (504 after 1 s, their threads go on): they hold a's threads until they
    end, and a's next call waits for one of them, while b's calls run at once."""
    GatedResetEnv.GATE.clear()
    with two_tenants(tmp_path, monkeypatch, max_threads=4, call_timeout_s=1) as url:  # two threads each
        try:
            started = GatedResetEnv.STARTED
            opened = [open_session(url, "a", "gated").json()["session_id"] for _ in range(3)]
            for s in opened:
                r = httpx.post(f"{url}/sessions/{s}/reset", json={"seq": 1, "timeout_s": 1}, headers=auth("a"),
                               timeout=30)  # fmt: skip
                assert r.status_code == 504 and r.json()["error"] == "env_timeout"
            # the first two still run in a's two threads; the third never got one
            assert GatedResetEnv.RUNNING == 2 and GatedResetEnv.STARTED - started == 2
            late = open_session(url, "a", "counting")  # building an env needs one of a's threads too
            assert late.status_code == 504 and "took longer" in late.json()["detail"]
            s = open_session(url, "b", "counting").json()["session_id"]
            r = httpx.post(f"{url}/sessions/{s}/reset", json={"seq": 1, "timeout_s": 10}, headers=auth("b"))
            assert r.status_code == 200 and r.json()["observation"].startswith("start")
        finally:
            GatedResetEnv.GATE.set()
        wait_until(lambda: GatedResetEnv.RUNNING == 0, 30, "a's runaway resets returned")
        s = open_session(url, "a", "counting").json()["session_id"]  # a's threads are free again
        r = httpx.post(f"{url}/sessions/{s}/reset", json={"seq": 1, "timeout_s": 10}, headers=auth("a"))
        assert r.status_code == 200


def test_runaway_calls_of_one_tenant_do_not_starve_another_with_default_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight runaway resets of tenant a (more than a small machine's default thread pool) leave tenant b
    its threads: b opens and plays a session at once."""
    GatedResetEnv.GATE.clear()
    with two_tenants(tmp_path, monkeypatch) as url:
        try:
            for _ in range(8):
                s = open_session(url, "a", "gated").json()["session_id"]
                r = httpx.post(f"{url}/sessions/{s}/reset", json={"seq": 1, "timeout_s": 1}, headers=auth("a"),
                               timeout=30)  # fmt: skip
                assert r.status_code == 504
            opened = httpx.post(url + "/sessions", json={"session_id": sid(), "env": "counting"}, headers=auth("b"),
                                timeout=20)  # fmt: skip
            assert opened.status_code == 200
            s = opened.json()["session_id"]
            r = httpx.post(f"{url}/sessions/{s}/reset", json={"seq": 1}, headers=auth("b"), timeout=20)
            assert r.status_code == 200
        finally:
            GatedResetEnv.GATE.set()
        wait_until(lambda: GatedResetEnv.RUNNING == 0, 30, "a's runaway resets returned")
