"""The env server: :mod:`rollart.envservice.protocol` over FastAPI (``rollart serve env``, the Ray
backend's actors, the Kubernetes backend's pods).

Each session owns one env instance. Calls of one session run one after the other, in the order of
their ``seq``; sessions run concurrently (a sync env's calls in worker threads, an async env's on the
event loop). A call is applied by a task of its own, so a client that hangs up does not cancel it: its
answer is kept for the repeat. Idle sessions are closed after ``session_ttl_s``.

Guards (:mod:`rollart.reward.http_guard`, :mod:`rollart.reward.http_server`, as the reward service has
them): connections over ``max_connections`` are refused (503), headers or a body not sent within
``read_timeout_s`` get 408; with ``token_env`` (one shared token) or ``tenants_file`` (a token per
tenant) every endpoint but ``/healthz`` needs ``Authorization: Bearer <token>`` (401 from the headers
alone, before any body byte is read); a body over ``max_body_bytes`` is 413. A session belongs to
the tenant that opened it: another tenant's calls, repeats and closes of it answer 404 as for a session
that does not exist. ``max_sessions`` counts the sessions being opened too, so concurrent opens cannot
exceed it.

Tenants share the server fairly: a tenant has at most ``tenant_max_sessions`` sessions open or being
opened (``/describe`` builds count too; default: ``max_sessions`` split evenly between the tenants of
``tenants_file``), and its sync env calls (build, reset, step, close) hold at most ``tenant_threads``
of the server's ``max_threads`` threads (:class:`~rollart.reward.fair.FairSlots`), a call that timed
out until it really returns: a runaway call costs its own tenant, never another. A session's kwargs
are at most ``max_kwargs_bytes`` of JSON and within the env's declared
:attr:`~rollart.envs.TextEnv.kwarg_limits` (422 otherwise), and building an env (an open, a
``/describe``) has ``call_timeout_s`` (504). A call's deadline kills: an env call past its ``timeout_s`` (504) has every code sandbox it
started killed (:func:`rollart.reward.sandbox.deadline`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from rollart.envservice.protocol import (
    PROTOCOL_VERSION,
    DescribeRequest,
    EnvDescription,
    EnvOverrides,
    OpenRequest,
    OpenResponse,
    ResetRequest,
    ResetResponse,
    StepRequest,
    StepResponse,
)
from rollart.reward.fair import FairSlots
from rollart.reward.http_guard import BearerAuth, RequestGuard, check_token, load_tenants, read_token
from rollart.reward.http_server import ConnectionLimits, ThreadedServer
from rollart.reward.sandbox import SandboxCancelled, SandboxLimits, deadline

log = logging.getLogger(__name__)

Answer = tuple[int, dict[str, Any]]


class EnvServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_sessions: int = Field(default=1024, gt=0)
    session_ttl_s: float = Field(default=900.0, gt=0)  # an idle session is closed after this
    call_timeout_s: float = Field(default=60.0, gt=0)  # a call that names no timeout_s
    max_call_timeout_s: float = Field(default=600.0, gt=0)
    forgotten: int = Field(default=100_000, ge=0)  # ids of ended sessions remembered (410 instead of 404)
    retry_after_s: int = Field(default=1, ge=0)
    token_env: str | None = None  # the variable holding the shared bearer token
    tenants_file: str | None = None  # a token per tenant (the reward service's tenants file format)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # the code sandbox of this process (rollart serve env --sandbox-*, --unsafe-no-sandbox); None: as is
    sandbox: SandboxLimits | None = None
    unsafe_no_sandbox: bool = False
    max_connections: int = Field(default=512, gt=0)  # connections open at once (503 past it)
    read_timeout_s: float = Field(default=30.0, gt=0)  # seconds to send the headers, and again the body (408)
    # sessions one tenant has open or opening at once; None: max_sessions shared evenly by the tenants
    # of tenants_file (all of them with one shared token)
    tenant_max_sessions: int | None = Field(default=None, gt=0)
    max_threads: int = Field(default=32, gt=0)  # threads running sync env calls (build, reset, step, close)
    # threads one tenant's env calls hold at once (a call that timed out holds its thread until it
    # returns); None: max_threads shared evenly by the tenants of tenants_file
    tenant_threads: int | None = Field(default=None, gt=0)
    max_kwargs_bytes: int = Field(default=64 * 1024, gt=0)  # a session's kwargs and overrides, as JSON

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(max_connections=self.max_connections, read_timeout_s=self.read_timeout_s)


def _error(status: int, kind: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": kind, "detail": detail}, status_code=status, headers=headers)


@dataclass
class _Session:
    sid: str
    env_name: str
    kwargs: dict[str, Any]
    env: Any
    seed: int | None
    owner: str | None = None  # the tenant that opened it (None: the shared token, or no token)
    last_seq: int = 0
    last: asyncio.Future[Answer] | None = None  # the answer of call ``last_seq`` (pending while it runs)
    gone: str | None = None  # why the session ended (then every call is 410)
    used: float = field(default_factory=time.monotonic)

    @property
    def busy(self) -> bool:
        return self.last is not None and not self.last.done()


def _describe(env: Any) -> EnvDescription:
    return EnvDescription(
        tag=str(getattr(env, "tag", type(env).__name__)),
        max_steps=int(getattr(env, "max_steps", 1)),
        max_new_tokens=int(getattr(env, "max_new_tokens", 16)),
        instructions=str(getattr(env, "instructions", "") or ""),
    )


class _Threads:
    """The threads sync env calls run in, shared fairly by tenants
    (:class:`~rollart.reward.fair.FairSlots`): a tenant's calls hold at most ``per_tenant`` of them,
    and a call's thread stays counted against its tenant until the call returns, also when its request
    gave up waiting (a timeout)."""

    def __init__(self, threads: int, per_tenant: int):
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env-call")
        self.slots = FairSlots(threads, per_tenant)

    async def call(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Any:
        if inspect.iscoroutinefunction(fn):  # an async env runs on the loop
            return await fn(*args)
        await self.slots.acquire(tenant)
        try:
            future = self.executor.submit(contextvars.copy_context().run, fn, *args)
        except BaseException:
            self.slots.release(tenant)
            raise
        future.add_done_callback(lambda _: self.slots.release_soon(tenant))
        return await asyncio.wrap_future(future)


def kwargs_problems(cls: Any, kwargs: dict[str, Any], overrides: EnvOverrides, max_bytes: int) -> list[str]:
    """What the env server refuses in a session's constructor arguments before building anything: more
    than ``max_bytes`` of JSON, and values outside the env's declared ``kwarg_limits``."""
    size = len(json.dumps(kwargs, default=str)) + len(overrides.model_dump_json())
    if size > max_bytes:
        return [f"kwargs and overrides take {size} bytes of JSON; this server takes at most {max_bytes}"]
    out = []
    for name, (low, high) in (getattr(cls, "kwarg_limits", None) or {}).items():
        value = kwargs.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not low <= value <= high:
            out.append(f"kwargs.{name}={value!r} is outside what this env takes when served: [{low:g}, {high:g}]")
    return out


def build_env_app(
    envs: dict[str, str], settings: EnvServerSettings | None = None, *, token: str | None = None
) -> FastAPI:
    """The env server app. ``envs`` maps each served name to a registry name or ``MODULE:CLASS``
    (imported here: a name that does not resolve fails now, before anything listens). ``token``: a
    shared bearer token given in memory (the backends' servers), in place of ``settings.token_env``."""
    from rollart.envs import EnvSpec, env_class, make_env

    settings = settings or EnvServerSettings()
    if not envs:
        raise ValueError("build_env_app needs at least one env to serve")
    classes = {name: env_class(spec, "env") for name, spec in envs.items()}
    if token is None and settings.token_env:
        token = read_token(settings.token_env, "--token-env")
    elif token is not None:
        check_token(token, "the env server's token")
    tenant_tokens = load_tenants(settings.tenants_file) if settings.tenants_file else {}
    auth = BearerAuth(
        token, tenant_tokens, description="the token of `--token-env`, or the caller's own of `--tenants`"
    )
    if settings.sandbox is not None:
        from rollart.reward.sandbox import configure

        configure(settings.sandbox, unsafe_no_sandbox=settings.unsafe_no_sandbox)
    code = sorted(n for n, c in classes.items() if getattr(c, "needs_sandbox", False))
    if code:
        from rollart.reward import sandbox

        sandbox.check()  # refuse to serve code envs without isolation (unless the operator opted in)
        log.info("%s (for %s)", sandbox.describe(), ", ".join(code))
    sessions: dict[str, _Session] = {}
    opening = {"n": 0}  # sessions being built: counted against max_sessions
    building: dict[str, int] = {}  # per tenant: sessions being opened and envs being described
    shares = max(1, len(tenant_tokens))  # the tenants max_sessions and max_threads are shared by
    tenant_sessions = settings.tenant_max_sessions or max(1, settings.max_sessions // shares)
    threads = _Threads(settings.max_threads, settings.tenant_threads or max(1, settings.max_threads // shares))
    ended: OrderedDict[str, tuple[str, str | None]] = OrderedDict()  # session id -> (why it ended, owner)
    registry = CollectorRegistry()
    calls = Counter("rollart_env_calls", "env protocol calls", ["op", "status"], registry=registry)
    replays = Counter("rollart_env_replays", "calls answered from a stored answer (a retried seq)", registry=registry)
    latency = Histogram("rollart_env_call_latency_seconds", "env call latency", ["op"], registry=registry)
    open_sessions = Gauge("rollart_env_sessions", "open sessions", registry=registry)
    open_sessions.set_function(lambda: len(sessions))

    def check(name: str, kwargs: dict[str, Any], overrides: EnvOverrides) -> None:
        from rollart.envs import env_kwargs_problems

        problems = kwargs_problems(classes[name], kwargs, overrides, settings.max_kwargs_bytes)
        problems = problems or env_kwargs_problems(classes[name], kwargs)
        if problems:
            raise ValueError(f"env {name!r}: " + "; ".join(problems))

    def build(name: str, kwargs: dict[str, Any], overrides: EnvOverrides) -> Any:
        return make_env(EnvSpec(name=envs[name], kwargs=kwargs, **overrides.model_dump()))

    def label(owner: str | None) -> str:
        return owner or ""

    def held(owner: str | None) -> int:
        """Sessions ``owner`` has open or is opening (describes included)."""
        return sum(1 for x in sessions.values() if x.owner == owner) + building.get(label(owner), 0)

    def over_quota(owner: str | None) -> JSONResponse | None:
        if len(sessions) + opening["n"] >= settings.max_sessions:
            return _error(
                429,
                "too_many_sessions",
                f"{len(sessions)} sessions open, {opening['n']} opening (max_sessions={settings.max_sessions})",
                {"Retry-After": str(settings.retry_after_s)},
            )
        if held(owner) >= tenant_sessions:
            return _error(
                429,
                "too_many_sessions",
                f"this tenant has {held(owner)} sessions open or opening, its quota "
                f"(tenant_max_sessions={tenant_sessions}); close some or retry later",
                {"Retry-After": str(settings.retry_after_s)},
            )
        return None

    async def built(name: str, kwargs: dict[str, Any], overrides: EnvOverrides, owner: str | None) -> Any:
        """The env, built in the tenant's threads within ``call_timeout_s`` (``TimeoutError`` past it:
        the build goes on in its thread, counted against the tenant until it ends, and its env is
        closed then)."""
        check(name, kwargs, overrides)
        work = asyncio.ensure_future(threads.call(label(owner), build, name, kwargs, overrides))
        try:
            return await asyncio.wait_for(asyncio.shield(work), settings.call_timeout_s)
        except TimeoutError:

            def close_late(done: asyncio.Future[Any]) -> None:
                if not done.cancelled() and done.exception() is None:
                    asyncio.ensure_future(threads.call(label(owner), done.result().close))

            work.add_done_callback(close_late)
            raise

    def end(session: _Session, why: str) -> None:
        """Mark ``session`` gone and close its env in the background (a hung env must not block)."""
        if session.gone is None:
            session.gone = why
        sessions.pop(session.sid, None)
        ended[session.sid] = (session.gone or why, session.owner)
        while len(ended) > settings.forgotten:
            ended.popitem(last=False)

        async def close() -> None:
            try:
                await threads.call(label(session.owner), session.env.close)
            except Exception as err:  # a failing close must not take the server down
                log.warning("closing env of session %s failed: %s: %s", session.sid, type(err).__name__, err)

        asyncio.get_running_loop().create_task(close())

    async def reap() -> None:
        while True:
            await asyncio.sleep(min(30.0, settings.session_ttl_s / 4))
            now = time.monotonic()
            for s in list(sessions.values()):
                if not s.busy and now - s.used > settings.session_ttl_s:
                    end(s, f"expired: idle for more than session_ttl_s={settings.session_ttl_s:g}s")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(reap())
        try:
            yield
        finally:
            task.cancel()
            for s in list(sessions.values()):
                end(s, "the server shut down")
            await asyncio.sleep(0)

    app = FastAPI(
        title="rollart env server",
        version=str(PROTOCOL_VERSION),
        lifespan=lifespan,
        openapi_url=None if auth.enabled else "/openapi.json",
        docs_url=None if auth.enabled else "/docs",
        redoc_url=None if auth.enabled else "/redoc",
    )
    caller = Depends(auth.dependency)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(
            422, "bad_request", "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        )

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "version": PROTOCOL_VERSION, "envs": sorted(envs), "sessions": len(sessions)}

    @app.get("/metrics")
    async def metrics(_: str | None = caller) -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    if auth.enabled:

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(_: str | None = caller) -> JSONResponse:
            return JSONResponse(get_openapi(title=app.title, version=app.version, routes=app.routes))

    def unknown_env(name: str) -> JSONResponse:
        return _error(422, "bad_request", f"env {name!r} is not served here; this server serves {sorted(envs)}")

    @app.post("/describe")
    async def describe(body: DescribeRequest, owner: str | None = caller) -> Any:
        """The env's description: built and closed under the limits of a session's open (kwargs,
        the tenant's sessions and threads, call_timeout_s)."""
        if body.env not in envs:
            return unknown_env(body.env)
        refused = over_quota(owner)
        if refused is not None:
            return refused
        building[label(owner)] = building.get(label(owner), 0) + 1
        try:
            env = await built(body.env, body.kwargs, body.overrides, owner)
        except TimeoutError:
            return _error(
                504, "env_timeout", f"building env {body.env!r} took longer than {settings.call_timeout_s:g}s"
            )
        except Exception as err:
            return _error(422, "bad_request", f"{type(err).__name__}: {err}")
        finally:
            building[label(owner)] -= 1
        try:
            return _describe(env).model_dump()
        finally:
            await threads.call(label(owner), env.close)

    @app.post("/sessions")
    async def open_session(body: OpenRequest, owner: str | None = caller) -> Any:
        t0 = time.perf_counter()
        try:
            return await opened(body, owner)
        finally:
            latency.labels(op="open").observe(time.perf_counter() - t0)

    async def opened(body: OpenRequest, owner: str | None) -> Any:
        old = sessions.get(body.session_id)
        if old is not None:
            if (old.env_name, old.kwargs, old.owner) != (body.env, body.kwargs, owner):
                calls.labels(op="open", status="409").inc()
                return _error(409, "seq_conflict", f"session {body.session_id} exists with another env or kwargs")
            calls.labels(op="open", status="200").inc()
            return OpenResponse(session_id=old.sid, **_describe(old.env).model_dump()).model_dump()
        if body.session_id in ended:
            why, was = ended[body.session_id]
            status = 410 if was == owner else 409
            calls.labels(op="open", status=str(status)).inc()
            if status == 409:
                return _error(409, "seq_conflict", f"session id {body.session_id} is taken; pick another")
            return _error(410, "session_gone", f"session {body.session_id} ended: {why}")
        if body.env not in envs:
            calls.labels(op="open", status="422").inc()
            return unknown_env(body.env)
        refused = over_quota(owner)
        if refused is not None:
            calls.labels(op="open", status="429").inc()
            return refused
        opening["n"] += 1  # held while the env is built: concurrent opens cannot pass max_sessions
        building[label(owner)] = building.get(label(owner), 0) + 1  # nor the tenant's quota
        try:
            try:
                env = await built(body.env, body.kwargs, body.overrides, owner)
            except TimeoutError:
                calls.labels(op="open", status="504").inc()
                return _error(
                    504, "env_timeout", f"building env {body.env!r} took longer than {settings.call_timeout_s:g}s"
                )
            except Exception as err:
                calls.labels(op="open", status="422").inc()
                return _error(422, "bad_request", f"{type(err).__name__}: {err}")
        finally:
            opening["n"] -= 1
            building[label(owner)] -= 1
        if body.session_id in sessions:  # a repeat of this open finished first
            await threads.call(label(owner), env.close)
            return await opened(body, owner)
        sessions[body.session_id] = _Session(body.session_id, body.env, body.kwargs, env, body.seed, owner)
        calls.labels(op="open", status="200").inc()
        return OpenResponse(session_id=body.session_id, **_describe(env).model_dump()).model_dump()

    def lookup(sid: str, owner: str | None) -> _Session | JSONResponse:
        """The session ``sid`` of ``owner``; another tenant's session is not found, as one that never was."""
        s = sessions.get(sid)
        if s is not None and s.owner == owner:
            return s
        if s is None and sid in ended and ended[sid][1] == owner:
            return _error(410, "session_gone", f"session {sid} ended: {ended[sid][0]}")
        return _error(404, "session_not_found", f"no session {sid} on this server (it may have restarted)")

    async def apply(
        s: _Session, op: str, seq: int, timeout_s: float, prev: asyncio.Future[Answer] | None, fn: Callable[[], Any]
    ) -> Answer:
        if prev is not None:  # calls of one session run in seq order
            await asyncio.wait([prev])
        if s.gone is not None:
            return 410, {"error": "session_gone", "detail": f"session {s.sid} ended: {s.gone}"}
        # the sandboxes the call starts end by its deadline (a backstop a second later: the timeout below
        # cancels them first)
        with deadline(timeout_s + 1.0) as scope:
            task = asyncio.ensure_future(fn())
        try:
            return 200, await asyncio.wait_for(task, timeout_s)
        except (TimeoutError, SandboxCancelled):
            scope.cancel()  # kill the call's sandboxes now: the env is abandoned, its work must not go on
            end(s, f"{op} seq {seq} took longer than timeout_s={timeout_s:g}s (the env's state is unknown)")
            return 504, {"error": "env_timeout", "detail": f"{op} seq {seq} took longer than {timeout_s:g}s"}
        except asyncio.CancelledError:
            scope.cancel()
            raise
        except Exception as err:
            log.info("session %s %s seq %d: env raised %s: %s", s.sid, op, seq, type(err).__name__, err)
            return 500, {"error": "env_error", "detail": f"{type(err).__name__}: {err}"}

    async def numbered(
        sid: str, owner: str | None, op: str, seq: int, timeout_s: float | None, fn: Callable[[_Session], Any]
    ) -> Any:
        t0 = time.perf_counter()
        found = lookup(sid, owner)
        if isinstance(found, JSONResponse):
            calls.labels(op=op, status=str(found.status_code)).inc()
            return found
        s = found
        s.used = time.monotonic()
        if seq == s.last_seq and s.last is not None:
            replays.inc()
            status, body = await asyncio.shield(s.last)
        elif seq != s.last_seq + 1:
            calls.labels(op=op, status="409").inc()
            return _error(
                409,
                "seq_conflict",
                f"session {sid}: got seq {seq}, expected {s.last_seq + 1} (or a repeat of {s.last_seq})",
            )
        else:
            limit = min(timeout_s or settings.call_timeout_s, settings.max_call_timeout_s)
            prev, s.last_seq = s.last, seq
            s.last = asyncio.ensure_future(apply(s, op, seq, limit, prev, lambda: fn(s)))
            status, body = await asyncio.shield(s.last)
            latency.labels(op=op).observe(time.perf_counter() - t0)
        s.used = time.monotonic()
        calls.labels(op=op, status=str(status)).inc()
        return body if status == 200 else JSONResponse(body, status_code=status)

    @app.post("/sessions/{sid}/reset")
    async def reset(sid: str, body: ResetRequest, owner: str | None = caller) -> Any:
        async def run(s: _Session) -> dict[str, Any]:
            obs, info = await threads.call(label(s.owner), s.env.reset, body.seed if body.seed is not None else s.seed)
            return ResetResponse(seq=body.seq, observation=obs, info=info or {}).model_dump()

        return await numbered(sid, owner, "reset", body.seq, body.timeout_s, run)

    @app.post("/sessions/{sid}/step")
    async def step(sid: str, body: StepRequest, owner: str | None = caller) -> Any:
        async def run(s: _Session) -> dict[str, Any]:
            obs, reward, terminated, truncated, info = await threads.call(label(s.owner), s.env.step, body.action)
            return StepResponse(
                seq=body.seq,
                observation=obs,
                reward=float(reward),
                terminated=bool(terminated),
                truncated=bool(truncated),
                info=info or {},
            ).model_dump()

        return await numbered(sid, owner, "step", body.seq, body.timeout_s, run)

    @app.delete("/sessions/{sid}")
    async def close(sid: str, owner: str | None = caller) -> dict[str, Any]:
        s = sessions.get(sid)
        calls.labels(op="close", status="200").inc()
        if s is None or s.owner != owner:  # only its owner closes a session
            return {"closed": False}
        end(s, "closed by the client")
        return {"closed": True}

    app.add_middleware(
        RequestGuard,
        limit=settings.max_body_bytes,
        auth=auth,
        public=("/healthz",),
        read_timeout_s=settings.read_timeout_s,
        error=_guard_error,
    )
    return app


def _guard_error(status: int, detail: str) -> bytes:
    """The env server's error body for the guard's answers (401, 408, 413)."""
    kind = {401: "unauthorized", 408: "request_timeout", 413: "body_too_large"}.get(status, "bad_request")
    return json.dumps({"error": kind, "detail": detail}).encode()


__all__ = ["EnvServerSettings", "ThreadedServer", "build_env_app"]
