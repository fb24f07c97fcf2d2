"""The client side of :mod:`rollart.envservice.protocol`: :class:`EnvServiceClient` (one server),
:class:`ServerPool` (the warm servers of one task, sessions spread by least sessions) and
:class:`RemoteEnv` (a :class:`~rollart.envs.TextEnv` whose async ``reset``/``step`` run in a session).

A backend (``ray``, ``kubernetes``) is a :class:`ServerPool` subclass that starts servers and calls
:meth:`ServerPool.add` with each one's URL; everything else is shared.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import httpx

from rollart.cluster.serverless import RetryPolicy
from rollart.envs.base import EnvError, EnvTimeout, StepResult, TextEnv
from rollart.envservice.protocol import (
    EnvDescription,
    EnvOverrides,
    EnvProtocolError,
    EnvServiceError,
    EnvServiceRequestError,
    EnvServiceUnavailable,
    EnvSessionLost,
)

log = logging.getLogger(__name__)

DEFAULT_RETRY = RetryPolicy(retries=5, backoff_base_s=0.1, backoff_max_s=5.0)


class EnvCallTimeout(EnvServiceError, EnvTimeout):
    """The env call took longer than its ``timeout_s`` on the server (504); the session is gone."""


def endpoint_url(endpoint: str) -> str:
    """``host:port`` or a URL → ``http://host:port`` (no trailing slash)."""
    return (endpoint if "://" in endpoint else f"http://{endpoint}").rstrip("/")


def _detail(resp: httpx.Response) -> tuple[str, str]:
    try:
        body = resp.json()
    except ValueError:
        return "", resp.text[:300]
    if isinstance(body, dict):
        return str(body.get("error", "")), str(body.get("detail", body))[:2000]
    return "", str(body)[:300]


class EnvServiceClient:
    """Calls one env server (``endpoint``: ``host:port`` or ``http://host:port``). Transport errors,
    429 and 5xx other than the env's own answers are retried with ``retry`` (exponential backoff and
    jitter); each HTTP attempt waits ``timeout_s + grace_s`` at most. ``token``: the server's bearer token
    (its ``--token-env``, or this client's tenant's), sent with every call."""

    def __init__(
        self,
        endpoint: str,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout_s: float = 60.0,
        grace_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        token: str | None = None,
    ):
        self.url = endpoint_url(endpoint)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retry, self.timeout_s, self.grace_s, self.connect_timeout_s = retry, timeout_s, grace_s, connect_timeout_s
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:  # a client's connections belong to one event loop
            self._http, self._loop = httpx.AsyncClient(), loop
        return self._http

    async def aclose(self) -> None:
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http = None

    async def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        session_id: str | None = None,
    ) -> dict[str, Any]:
        """One protocol call, retried as the class says; raises the typed errors of the protocol."""
        wait = (timeout_s or self.timeout_s) + self.grace_s
        timeout = httpx.Timeout(wait, connect=min(self.connect_timeout_s, wait))
        last, status, retry_after = "", None, None
        for attempt in range(self.retry.retries + 1):
            try:
                resp = await self._client().request(
                    method, self.url + path, json=body, timeout=timeout, headers=self._headers
                )
            except httpx.TransportError as err:  # refused, reset, dropped mid-answer, our own timeout
                last, status, retry_after = f"{type(err).__name__}: {err}", None, None
            else:
                if resp.status_code == 200:
                    out = resp.json()
                    return out if isinstance(out, dict) else {"result": out}
                kind, detail = _detail(resp)
                err_kw: dict[str, Any] = {"url": self.url, "session_id": session_id, "status": resp.status_code}
                if resp.status_code in (404, 410):
                    raise EnvSessionLost(detail, **err_kw)
                if resp.status_code == 409:
                    raise EnvProtocolError(detail, **err_kw)
                if resp.status_code == 500 and kind == "env_error":
                    raise EnvError(f"{self.url} session {session_id}: {detail}")
                if resp.status_code == 504 and kind == "env_timeout":
                    raise EnvCallTimeout(detail, **err_kw)
                if resp.status_code < 500 and resp.status_code not in (408, 429):
                    raise EnvServiceRequestError(detail, **err_kw)
                last, status, retry_after = detail or kind, resp.status_code, resp.headers.get("Retry-After")
            if attempt < self.retry.retries:
                delay = self.retry.delay(attempt, retry_after)
                log.info(
                    "env server %s %s %s failed (%s %s); retry in %.2fs", self.url, method, path, status, last, delay
                )
                await asyncio.sleep(delay)
        raise EnvServiceUnavailable(
            f"no answer after {self.retry.retries + 1} attempts (last: {status} {last})",
            url=self.url,
            session_id=session_id,
            status=status,
        )

    async def healthz(self) -> dict[str, Any]:
        return await self.request("GET", "/healthz", timeout_s=self.connect_timeout_s)

    async def describe(self, env: str, kwargs: dict[str, Any], overrides: EnvOverrides | None = None) -> EnvDescription:
        body = {"env": env, "kwargs": kwargs, "overrides": (overrides or EnvOverrides()).model_dump()}
        return EnvDescription.model_validate(await self.request("POST", "/describe", body))

    async def open(
        self,
        session_id: str,
        env: str,
        kwargs: dict[str, Any],
        overrides: EnvOverrides | None = None,
        seed: int | None = None,
    ) -> EnvDescription:
        body = {
            "session_id": session_id,
            "env": env,
            "kwargs": kwargs,
            "overrides": (overrides or EnvOverrides()).model_dump(),
            "seed": seed,
        }
        return EnvDescription.model_validate(await self.request("POST", "/sessions", body, session_id=session_id))

    async def call(
        self, session_id: str, op: str, seq: int, args: dict[str, Any], timeout_s: float | None = None
    ) -> dict[str, Any]:
        """``op`` (``reset`` or ``step``) number ``seq`` of the session."""
        body = {"seq": seq, "timeout_s": timeout_s, **args}
        return await self.request(
            "POST", f"/sessions/{session_id}/{op}", body, timeout_s=timeout_s, session_id=session_id
        )

    async def close_session(self, session_id: str) -> bool:
        out = await self.request(
            "DELETE", f"/sessions/{session_id}", session_id=session_id, timeout_s=self.connect_timeout_s
        )
        return bool(out.get("closed"))


class ServerPool:
    """The env servers of one task. A new session goes to the live server holding the fewest; a server
    whose calls find it unreachable is marked down (:meth:`mark_down`) until a backend brings it back
    (:meth:`add` with its new URL). Backends subclass it and override :meth:`start` / :meth:`stop`.
    ``token``: the servers' bearer token (backends make one per pool and give it to their servers)."""

    def __init__(
        self,
        name: str,
        urls: list[str] | None = None,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        token: str | None = None,
    ):
        self.name, self.retry, self.token = name, retry, token
        self.sessions: dict[str, int] = {}
        self.down: set[str] = set()
        self._clients: dict[str, EnvServiceClient] = {}
        for url in urls or []:
            self.add(url)

    @property
    def urls(self) -> list[str]:
        return list(self.sessions)

    def add(self, url: str) -> None:
        url = endpoint_url(url)
        self.sessions.setdefault(url, 0)
        self.down.discard(url)

    def remove(self, url: str) -> None:
        self.sessions.pop(url, None)
        self.down.discard(url)
        self._clients.pop(url, None)

    def client(self, url: str) -> EnvServiceClient:
        if url not in self._clients:
            self._clients[url] = EnvServiceClient(url, retry=self.retry, token=self.token)
        return self._clients[url]

    def acquire(self) -> str:
        live = [u for u in self.sessions if u not in self.down]
        if not live:
            raise EnvServiceUnavailable(f"task {self.name}: no live env server (down: {sorted(self.down)})")
        url = min(live, key=lambda u: self.sessions[u])
        self.sessions[url] += 1
        return url

    def release(self, url: str) -> None:
        if self.sessions.get(url, 0) > 0:
            self.sessions[url] -= 1

    def mark_down(self, url: str) -> None:
        """``url`` did not answer: no new session goes there (a backend may bring it back)."""
        if url in self.sessions and url not in self.down:
            log.warning("env server %s of task %s is down", url, self.name)
            self.down.add(url)

    async def describe(
        self, env: str, kwargs: dict[str, Any] | None = None, overrides: EnvOverrides | None = None
    ) -> EnvDescription:
        """The env's tag, sizes and instructions, as one of the servers builds it."""
        return await self.client(self.acquire_any()).describe(env, kwargs or {}, overrides)

    def acquire_any(self) -> str:
        url = self.acquire()
        self.release(url)
        return url

    def start(self) -> None:
        """Start the servers (backends); the base pool serves the URLs it was given."""

    def stop(self) -> None:
        """Stop the servers this pool started (backends)."""


class RemoteEnv(TextEnv):
    """A :class:`~rollart.envs.TextEnv` played in a session on one of ``pool``'s servers. ``reset``
    opens a session on the least-loaded live server when it has none (or its session was lost), then
    resets it; ``step`` runs in that session. Both are coroutines. ``description`` (tag, max_steps,
    max_new_tokens, instructions) is read once per task (:meth:`ServerPool.describe`)."""

    def __init__(
        self,
        pool: ServerPool,
        env: str,
        description: EnvDescription,
        *,
        kwargs: dict[str, Any] | None = None,
        overrides: EnvOverrides | None = None,
        timeout_s: float | None = None,
    ):
        self.pool, self.env_name = pool, env
        self.kwargs = dict(kwargs or {})
        self.overrides = overrides or EnvOverrides()
        self.timeout_s = timeout_s
        self.tag = description.tag
        self.max_steps = description.max_steps
        self.max_new_tokens = description.max_new_tokens
        self.instructions = description.instructions
        self.url: str | None = None
        self.session_id: str | None = None
        self._seq = 0  # the last answered call
        self._pending: tuple[str, dict[str, Any], int] | None = None  # a call sent that got no answer
        self.sessions_opened = 0
        self.lost_reason: str | None = None  # why the last session was lost (until a reset opens another)

    def _drop(self) -> None:
        if self.url is not None:
            self.pool.release(self.url)
        self.url = self.session_id = None
        self._seq, self._pending = 0, None

    async def _open(self, seed: int | None) -> None:
        self._drop()
        url = self.pool.acquire()
        sid = uuid.uuid4().hex
        try:
            await self.pool.client(url).open(sid, self.env_name, self.kwargs, self.overrides, seed)
        except EnvServiceUnavailable:
            self.pool.release(url)
            self.pool.mark_down(url)
            raise
        except BaseException:
            self.pool.release(url)
            raise
        self.url, self.session_id, self.lost_reason = url, sid, None
        self.sessions_opened += 1

    async def _numbered(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if self.url is None or self.session_id is None:
            if self.lost_reason is not None:
                raise EnvSessionLost(f"{op}: the session was lost ({self.lost_reason}); a reset opens a new one")
            raise EnvSessionLost(f"{op} without a session (reset first)")
        client = self.pool.client(self.url)
        if self._pending is not None and self._pending[:2] != (op, args):
            # an earlier call got no answer and this is another one: settle it first (applied once)
            pop, pargs, pseq = self._pending
            try:
                await client.call(self.session_id, pop, pseq, pargs, self.timeout_s)
            except EnvSessionLost as err:
                self._drop()
                self.lost_reason = f"{type(err).__name__}: {err}"
                raise
            except EnvError:
                pass
            self._seq, self._pending = pseq, None
        seq = self._pending[2] if self._pending is not None else self._seq + 1
        self._pending = (op, args, seq)
        try:
            out = await client.call(self.session_id, op, seq, args, self.timeout_s)
        except (EnvSessionLost, EnvCallTimeout) as err:
            if isinstance(err, EnvServiceUnavailable):
                self.pool.mark_down(client.url)
            self._drop()
            self.lost_reason = f"{type(err).__name__}: {err}"
            raise
        except asyncio.CancelledError:
            raise  # no answer: the next call resends this seq (or settles it)
        except BaseException:
            self._seq, self._pending = seq, None  # answered (an env error, a refusal)
            raise
        self._seq, self._pending = seq, None
        return out

    async def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if self.session_id is None:
            await self._open(seed)
        out = await self._numbered("reset", {"seed": seed})
        return out["observation"], out.get("info") or {}

    async def step(self, action: str) -> StepResult:
        out = await self._numbered("step", {"action": action})
        return (
            out["observation"],
            float(out["reward"]),
            bool(out["terminated"]),
            bool(out["truncated"]),
            out.get("info") or {},
        )

    async def aclose(self) -> None:
        """Close the session (best effort: a server that is gone has closed it already)."""
        if self.url is not None and self.session_id is not None:
            try:
                await self.pool.client(self.url).close_session(self.session_id)
            except EnvError as err:
                log.info("closing session %s on %s: %s", self.session_id, self.url, err)
        self._drop()

    def close(self) -> None:
        """Forget the session without a call (servers close idle sessions after their TTL); use
        :meth:`aclose` inside an event loop to close it on the server now."""
        self._drop()
