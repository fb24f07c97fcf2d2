"""Uvicorn as rollart's HTTP services run it (the reward service, the env server, the policy endpoint):
limits on connections that hold before a request reaches the application.

- **Connection cap** (``max_connections``): a connection accepted while that many are open is answered
  ``503`` with ``Connection: close`` at once, before it sends anything, and closed.
- **Header deadline** (``read_timeout_s``): a connection that has not sent a request's headers within
  that many seconds of being opened (or of its previous response, on a kept-alive connection) is
  answered ``408`` and closed, so a client cannot hold a connection by sending nothing or trickling
  header bytes. The body's own deadline is :class:`rollart.reward.http_guard.RequestGuard`'s.
- **Lingering close**: an answer given before the request's body has all arrived (413, 401, 408)
  closes the connection as HTTP/1.1 servers must (RFC 9112, section 9.6): the server half-closes its
  side, then reads and discards what the client still sends, for at most :data:`LINGER_S` seconds and
  :data:`LINGER_BYTES` bytes, and until the client closes or pauses for :data:`LINGER_IDLE_S` seconds. Closed at once instead, the kernel would answer the unread
  bytes with a reset, and a client still sending its body would get "connection reset" instead of the
  answer.

:class:`GuardedConfig` is a :class:`uvicorn.Config` with these limits (and, for ``--workers N``, the
secrets the worker processes need, handed over in the configuration each worker is spawned with rather
than in the environment); :func:`run_server` runs one, in this process or in worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
import time
from typing import Any

import uvicorn
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class ConnectionLimits(BaseModel):
    """What one client connection may hold."""

    model_config = ConfigDict(extra="forbid")

    max_connections: int = Field(default=512, gt=0)
    """Connections open at once; one more is answered 503 and closed."""
    read_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds a client has to send a request's headers, and as long again for its body (408 past it)."""


def _refusal(status: int, reason: bytes, detail: bytes) -> bytes:
    body = b'{"detail":"' + detail + b'"}'
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        status,
        reason,
        len(body),
        body,
    )


LINGER_S = 5.0
"""The most seconds a connection answered before its body arrived stays half-open, discarding input."""
LINGER_IDLE_S = 1.0
"""Such a connection is closed once the client has sent nothing for this long."""
LINGER_BYTES = 64 << 20
"""The most bytes discarded on such a connection before it is closed."""

FULL = _refusal(503, b"Service Unavailable", b"too many connections; retry later")
SLOW = _refusal(408, b"Request Timeout", b"the request's headers did not arrive in time")


class _LingeringTransport:
    """The transport uvicorn's protocol writes to, whose :meth:`close` lingers while the request being
    answered still has body bytes to come (see the module's docstring); everything else is the real
    transport's."""

    def __init__(self, transport: asyncio.Transport, guard: _Guard) -> None:
        self._transport = transport
        self._guard = guard
        self._closing = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        real = self._transport
        cycle = getattr(self._guard, "cycle", None)
        body_pending = cycle is not None and getattr(cycle, "more_body", False)
        if not body_pending or real.is_closing() or not real.can_write_eof():
            real.close()
            return
        try:
            real.write_eof()  # the answer already written goes out, then FIN
            real.resume_reading()
        except (OSError, RuntimeError):
            real.close()
            return
        self._guard._linger(real)


class _Guard:
    """Mixed into uvicorn's HTTP protocol classes (one instance per connection)."""

    config: Any
    connections: set[Any]
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    _header_timer: asyncio.TimerHandle | None = None
    _lingering: asyncio.Transport | None = None
    _linger_timer: asyncio.TimerHandle | None = None
    _linger_ends = 0.0
    _linger_heard = 0.0
    _discarded = 0

    def _limits(self) -> ConnectionLimits:
        return getattr(self.config, "limits", None) or ConnectionLimits()

    def _linger(self, real: asyncio.Transport) -> None:
        self._disarm()
        self._lingering = real
        self._linger_heard = self.loop.time()
        self._linger_ends = self._linger_heard + LINGER_S
        self._linger_timer = self.loop.call_later(LINGER_IDLE_S, self._linger_check)

    def _linger_check(self) -> None:
        assert self._lingering is not None
        now = self.loop.time()
        wake = min(self._linger_ends, self._linger_heard + LINGER_IDLE_S)
        if now >= wake:
            self._linger_timer = None
            self._lingering.close()
        else:
            self._linger_timer = self.loop.call_at(wake, self._linger_check)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # answered and half-closed: the rest of the body is discarded
            self._discarded += len(data)
            self._linger_heard = self.loop.time()
            if self._discarded > LINGER_BYTES:
                self._lingering.close()
            return
        super().data_received(data)  # type: ignore[misc]

    def eof_received(self) -> bool | None:
        if self._lingering is not None:
            self._lingering.close()
            return None
        return super().eof_received()  # type: ignore[misc, no-any-return]

    def connection_made(self, transport: Any) -> None:
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[misc]
        limits = self._limits()
        if len(self.connections) > limits.max_connections:
            transport.write(FULL)
            transport.close()
            return
        self._arm(None)

    def _arm(self, cycle: Any) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self._limits().read_timeout_s, self._headers_late, cycle)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self, cycle: Any) -> None:
        """No request began since the timer was armed (``cycle`` is still the last one): close."""
        self._header_timer = None
        if self.cycle is not cycle or self.transport.is_closing():
            return
        if cycle is not None and not cycle.response_complete:
            return  # a request is being answered: its body has a deadline of its own
        with contextlib.suppress(Exception):
            self.transport.write(SLOW)
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm(self.cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)  # type: ignore[misc]


def protocol_class() -> type[asyncio.Protocol]:
    """The guarded protocol over uvicorn's fastest available HTTP parser (httptools, else h11)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return GuardedH11
    return GuardedHttpTools


from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402


class GuardedH11(_Guard, H11Protocol):
    """h11 with the connection cap and the header deadline."""


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpTools(_Guard, HttpToolsProtocol):
        """httptools with the connection cap and the header deadline."""

except ImportError:  # httptools is optional in uvicorn
    GuardedHttpTools = GuardedH11  # type: ignore[misc,assignment]


class GuardedConfig(uvicorn.Config):
    """A :class:`uvicorn.Config` serving with :class:`ConnectionLimits`. ``secrets`` (``{VAR: value}``)
    are put in each worker process's environment just before it builds its app (``--workers N``):
    they travel in the pickled configuration a worker is spawned with, never in an environment a
    process starts with, and the app's builder forgets them once read."""

    def __init__(
        self, app: Any, *, limits: ConnectionLimits, secrets: dict[str, str] | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("log_level", "warning")
        kwargs.setdefault("access_log", False)
        super().__init__(app, http=protocol_class(), **kwargs)
        self.limits = limits
        self.secrets = dict(secrets or {})

    def load(self) -> None:
        os.environ.update(self.secrets)
        self.secrets = {}
        super().load()


def run_server(config: GuardedConfig) -> None:
    """Run ``config`` to completion: in this process, or in ``config.workers`` worker processes (the app
    then an import string of a factory)."""
    if config.workers <= 1:
        uvicorn.Server(config).run()
        return
    from uvicorn.supervisors import Multiprocess

    sock = config.bind_socket()
    try:
        if "target" in inspect.signature(Multiprocess).parameters:  # uvicorn before 0.3x
            Multiprocess(config, target=uvicorn.Server(config).run, sockets=[sock]).run()  # type: ignore[call-arg]
        else:
            Multiprocess(config, sockets=[sock]).run()
    finally:
        sock.close()


class ThreadedServer:
    """Uvicorn serving ``app`` in a daemon thread on ``host:port`` (port 0: a free one), with
    ``limits``. ``url`` is ``http://host:port`` once :meth:`start` returned (the env server of the
    ``ray`` backend's actors, tests)."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, *, limits: ConnectionLimits | None = None
    ) -> None:
        self.host = host
        config = GuardedConfig(app, limits=limits or ConnectionLimits(), host=host, port=port, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"http-server-{host}:{port}", daemon=True)
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:  # readiness of a server in another thread: nothing to wait on but the flag
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.host}:{self.port} did not start within {timeout_s:g}s")
            self.thread.join(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
