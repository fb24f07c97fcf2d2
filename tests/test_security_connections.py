"""Hostile connections against the three HTTP services (the reward service, the env server, the policy
endpoint), on raw sockets: no token is 401 from the headers alone, before any body byte is sent; a
body or headers that do not arrive in time get 408; connections over the cap are refused at once.
Every wait is on the socket, bounded."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from security_fixtures import wait_until

pytestmark = pytest.mark.timeout(120)
TOKEN = "connection-suite-token-0123456789"
WAIT_S = 20.0  # the most a test waits for the server's answer on a socket


@dataclass
class Service:
    port: int
    path: str  # an endpoint that needs the token and takes a JSON body
    body: bytes  # a valid body for it


def _reward(tmp: Path, **limits: Any) -> Iterator[Service]:
    import reward_fixtures as rf

    from rollart.reward.http_server import ThreadedServer
    from rollart.reward.server import ServerSettings, build_app

    settings = ServerSettings(token_env="CONN_SUITE_TOKEN", **limits)
    with ThreadedServer(build_app({"length": rf.length_score}, settings), limits=settings.connection_limits()) as srv:
        yield Service(srv.port, "/rewards/length", b'{"trajectories": [{"response": "abc"}]}')


def _env(tmp: Path, **limits: Any) -> Iterator[Service]:
    from rollart.envservice.server import EnvServerSettings, ThreadedServer, build_env_app

    settings = EnvServerSettings(token_env="CONN_SUITE_TOKEN", **limits)
    with ThreadedServer(build_env_app({"reverse": "reverse"}, settings), limits=settings.connection_limits()) as srv:
        yield Service(srv.port, "/describe", b'{"env": "reverse", "kwargs": {}}')


def _policy(tmp: Path, **limits: Any) -> Iterator[Service]:
    from rollart.models.tiny import build_tokenizer, default_corpus
    from rollart.rollout.types import GenerateOutput
    from rollart.serving.config import ServingConfig
    from rollart.serving.endpoint import PolicyEndpoint, build_service

    class Echo:
        async def generate(self, request: Any, tag: str, *, affinity: str | None = None) -> GenerateOutput:
            return GenerateOutput(request_id=request.request_id, output_token_ids=[40], output_logprobs=[-1.0],
                                  token_versions=[0], finish_reason="stop")  # fmt: skip

        async def abort(self, ids: list[str]) -> None:
            return None

    config = ServingConfig(**limits)
    tok = build_tokenizer(default_corpus(50), tmp, 320, chat=True)
    service = build_service(Echo(), tok, config, model="m")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    endpoint = PolicyEndpoint(service, config, token=TOKEN)
    asyncio.run_coroutine_threadsafe(endpoint.start(), loop).result(60)
    try:
        yield Service(endpoint.port, "/v1/completions", b'{"model": "m", "prompt": "hi", "max_tokens": 1}')
    finally:
        asyncio.run_coroutine_threadsafe(endpoint.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


SERVICES: dict[str, Callable[..., Iterator[Service]]] = {"reward": _reward, "env": _env, "policy": _policy}


@contextlib.contextmanager
def serving(name: str, tmp: Path, monkeypatch: pytest.MonkeyPatch, **limits: Any) -> Iterator[Service]:
    monkeypatch.setenv("CONN_SUITE_TOKEN", TOKEN)
    yield from SERVICES[name](tmp, **limits)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def head(path: str, length: int, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{auth}\r\n"
    ).encode()


def answer(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sends until it closes the connection (``closed``: it did), or until it
    has sent nothing for ``WAIT_S`` seconds (then ``closed`` is False)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    return data, True


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_no_token_is_401_from_the_headers_alone(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A POST announcing a 1 MB body without a token gets 401 without sending a byte of the body, and
    the server closes the connection; 40 of them at once hold nothing."""
    with serving(name, tmp_path, monkeypatch) as svc:
        socks = [connect(svc.port) for _ in range(40)]
        try:
            for s in socks:
                s.sendall(head(svc.path, 1_000_000))
            for s in socks:
                data, closed = answer(s)
                assert data.startswith(b"HTTP/1.1 401"), data[:200]
                assert b"bearer" in data.lower() and closed
        finally:
            for s in socks:
                s.close()
        # a wrong token is refused the same way; the right one is served
        with connect(svc.port) as s:
            s.sendall(head(svc.path, 1_000_000, token="wrong-token-0123456789abc"))
            data, closed = answer(s)
            assert data.startswith(b"HTTP/1.1 401") and closed
        with connect(svc.port) as s:
            s.sendall(head(svc.path, len(svc.body), token=TOKEN) + svc.body)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_a_slow_body_or_slow_headers_get_408(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(name, tmp_path, monkeypatch, read_timeout_s=1.0) as svc:
        with connect(svc.port) as s:  # authenticated, but the body stops after 5 bytes
            s.sendall(head(svc.path, len(svc.body), token=TOKEN) + svc.body[:5])
            data, closed = answer(s)
            assert data.startswith(b"HTTP/1.1 408") and closed, data[:200]
        with connect(svc.port) as s:  # headers that never end
            s.sendall(b"POST " + svc.path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            data, closed = answer(s)
            assert data.startswith(b"HTTP/1.1 408") and closed, data[:200]
        with connect(svc.port) as s:  # a connection that sends nothing
            data, closed = answer(s)
            assert data.startswith(b"HTTP/1.1 408") and closed, data[:200]
        with connect(svc.port) as s:  # in time: served
            s.sendall(head(svc.path, len(svc.body), token=TOKEN) + svc.body)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_connections_over_the_cap_are_refused(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(name, tmp_path, monkeypatch, max_connections=4) as svc:
        held = [connect(svc.port) for _ in range(4)]
        try:
            with connect(svc.port) as extra:  # refused at once: it has sent nothing
                data, closed = answer(extra)
                assert data.startswith(b"HTTP/1.1 503") and closed, data[:200]
            assert all(_quiet(s) for s in held)  # the four are still open and waiting
        finally:
            for s in held:
                s.close()

        def served() -> bool:  # once the server has seen the four close, a new connection is served
            with connect(svc.port) as s:
                s.sendall(head(svc.path, len(svc.body), token=TOKEN) + svc.body)
                return s.recv(65536).startswith(b"HTTP/1.1 200")

        wait_until(served, WAIT_S, "a connection under the cap is served again")


def _quiet(sock: socket.socket) -> bool:
    """Nothing received and not closed (looked at without waiting)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
        return False
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(WAIT_S)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_an_answer_before_the_body_reaches_a_client_still_sending_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends its whole body before reading gets the 413 (body over the limit) or the 401
    (no token) the server answered after the headers, not a connection reset: the server half-closes and
    discards the rest of the body, then closes."""
    big = b"x" * (16 << 20)
    with serving(name, tmp_path, monkeypatch, max_body_bytes=65536) as svc:
        for token, status in ((TOKEN, b"413"), (None, b"401")):
            with connect(svc.port) as s:
                s.sendall(head(svc.path, len(big), token=token) + big)
                data, closed = answer(s)
                assert data.startswith(b"HTTP/1.1 " + status) and closed, data[:200]
        with connect(svc.port) as s:  # the server serves on
            s.sendall(head(svc.path, len(svc.body), token=TOKEN) + svc.body)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
