"""The reward service: reward functions behind HTTP (RollArt paper §4.3, §7.5 "Reward-as-a-Service").

``POST /rewards/<name>`` with ``{"trajectories": [...]}`` answers ``{"result": [scores], "details": [...]}``.
Guards, in the order a request meets them: connections over ``max_connections`` (503) and headers
not sent within ``read_timeout_s`` (408) (:mod:`rollart.reward.http_server`); bearer token compared in
constant time, from the headers alone (401, before any body byte is read); body size (413) and a body
not sent within ``read_timeout_s`` (408) (:class:`~rollart.reward.http_guard.RequestGuard`); concurrency
limit (429 + ``Retry-After``), schema (422, never 500), per-request timeout (504).
A reward function that raises gives a 500 carrying its message — never a made-up score; one that raises
``RewardInputError`` (a malformed trajectory, a limit it refuses) answers 422 with its message. A
repeated ``Idempotency-Key`` (per tenant and function) with the same body is answered from a bounded
cache without recomputing or counting twice; the same key with another body is 422. JSON only, never
pickle.

Endpoints: ``/healthz`` (public: the functions, ``in_flight`` requests, ``running`` calls per function
-- counted until the call really returns, also after its request timed out -- and ``sandboxes`` alive);
``/metrics`` (Prometheus text) and ``/openapi.json`` need the token when the server has one (any
tenant's token, with ``--tenants``), and ``/docs`` is served only by a server without one.

The token is checked by :class:`~rollart.reward.http_guard.RequestGuard` before the body is read, and
again by FastAPI's ``HTTPBearer`` for the route (so ``/openapi.json`` declares the scheme): an
unauthenticated caller learns nothing about the schema and cannot make the server hold a body. The tenant label
(``X-Rollart-Tenant``) must match ``[A-Za-z0-9][A-Za-z0-9._:-]{0,63}`` (else 422); the first
``max_tenants`` distinct tenants keep their own label in ``/metrics``, later ones are counted as
``other`` (and unauthenticated requests as ``unauthenticated``), so a client cannot grow the metrics
without bound.

Tenants (``ServerSettings.tenants_file``, ``rollart serve rewards --tenants FILE``): every job gets a
token of its own, and the bearer token alone says which tenant calls (a request whose
``X-Rollart-Tenant`` names another tenant is refused with 403), so a client cannot be metered, cached or
throttled as someone else. Each tenant may have a concurrency quota (``max_concurrency`` in the file,
else ``tenant_max_concurrency``): a request over it gets 429 with ``Retry-After`` while the other
tenants are served. The idempotency cache is keyed by tenant: the same key from two tenants are two
requests. ``slots`` bounds the trajectories computed at once (the service's capacity, e.g. the GPUs of
a reward model); ``rollart_reward_compute_seconds`` counts the seconds trajectories spent computing,
so ``compute_seconds / (slots * wall)`` is the service's utilisation.

Slow work cannot starve cheap work: every synchronous reward function runs in a thread pool of its own
(``threads_per_function`` threads), so six requests of a slow code function leave ``math_answer``'s
threads free. One tenant cannot starve another: a pool's threads (and ``slots``) are handed out per
trajectory by :class:`~rollart.reward.fair.FairSlots` -- a tenant computes at most ``tenant_slots``
trajectories of a function at once (default: all threads but one), and a freed thread goes to the
tenant computing the fewest -- so a request of 16 slow trajectories leaves a thread for another
tenant's cheap one. ``/healthz`` shows the trajectories ``queued`` per function. A request's deadline kills: the request runs under a :func:`rollart.reward.sandbox.deadline`
scope of ``timeout_s``, and when it times out (504) or its client goes away, every sandbox it started is
killed, its trajectories not yet started are dropped, and a function still in ``run_python`` stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollart.reward.errors import RewardInputError
from rollart.reward.fair import FairSlots
from rollart.reward.http_guard import (
    TENANT_FORMAT,
    BearerAuth,
    BodyLimit,
    RequestGuard,
    TenantsFile,
    TenantSpec,
    load_tenants,
    read_token,
)
from rollart.reward.http_server import ConnectionLimits
from rollart.reward.sandbox import SandboxCancelled, SandboxLimits, deadline
from rollart.reward.sandbox import configure as configure_sandbox
from rollart.reward.sandbox import running as sandboxes_running
from rollart.reward.schemas import RewardRequest, RewardResponse

__all__ = [
    "TENANT_FORMAT",
    "AnswerCache",
    "BodyLimit",
    "RewardFn",
    "ServerSettings",
    "TenantLabels",
    "TenantSpec",
    "TenantsFile",
    "build_app",
    "load_tenants",
]

log = logging.getLogger(__name__)

RewardFn = Callable[[dict[str, Any]], float | dict[str, Any] | Awaitable[float | dict[str, Any]]]


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_env: str | None = None
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    timeout_s: float = Field(default=60.0, gt=0)
    max_concurrency: int = Field(default=64, gt=0)
    idempotency_cache: int = Field(default=10_000, ge=0)  # answers kept for repeated Idempotency-Keys (0: none)
    # and at most this many MB of them (the encoded answers plus ~0.5 KB per entry): a count alone lets
    # requests of many trajectories hold gigabytes
    idempotency_cache_mb: float = Field(default=32.0, ge=0)
    retry_after_s: int = Field(default=1, ge=0)
    max_tenants: int = Field(default=100, ge=0)
    tenants_file: str | None = None  # YAML/JSON: tenants: {NAME: {token_env | token, max_concurrency}}
    tenant_max_concurrency: int | None = Field(default=None, gt=0)  # default quota per tenant
    slots: int | None = Field(default=None, gt=0)  # trajectories computed at once (None: unbounded)
    threads_per_function: int = Field(default=8, gt=0)  # a sync function's own thread pool
    # the most trajectories one tenant computes at once in a function's pool (and of ``slots``);
    # None: all but one, so another tenant always finds one free
    tenant_slots: int | None = Field(default=None, gt=0)
    # the code sandbox of this process (rollart serve rewards --sandbox-*, --unsafe-no-sandbox); None: as is
    sandbox: SandboxLimits | None = None
    unsafe_no_sandbox: bool = False
    max_connections: int = Field(default=512, gt=0)  # connections open at once (503 past it)
    read_timeout_s: float = Field(default=30.0, gt=0)  # seconds to send the headers, and again the body (408)

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(max_connections=self.max_connections, read_timeout_s=self.read_timeout_s)


class TenantLabels:
    """Bounded Prometheus label values for tenants: the first ``limit`` distinct tenants keep their name,
    the rest share ``other``. Thread-safe (one instance per app)."""

    def __init__(self, limit: int, reserved: set[str] | None = None):
        self.limit = limit
        self._reserved = set(reserved or ())  # always their own label (a tenants file's names)
        self._known: set[str] = set()
        self._lock = threading.Lock()

    @staticmethod
    def valid(tenant: str) -> bool:
        return TENANT_FORMAT.fullmatch(tenant) is not None

    def label(self, tenant: str | None) -> str:
        if tenant is None:
            return "default"
        if not self.valid(tenant):
            return "invalid"
        if tenant in self._reserved:
            return tenant
        with self._lock:
            if tenant in self._known:
                return tenant
            if len(self._known) < self.limit:
                self._known.add(tenant)
                return tenant
        return "other"


def _score_of(value: Any) -> tuple[float, dict[str, Any]]:
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError("a reward function that returns a dict must include 'score'")
        return float(value["score"]), {k: v for k, v in value.items() if k != "score"}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a reward function must return a number or a dict with 'score', got {type(value).__name__}")
    return float(value), {}


class AnswerCache:
    """The idempotency cache: the newest answers, as their encoded JSON bodies, per ``(tenant, function,
    key)`` with the digest of the request they answered; bounded by ``max_entries`` and by ``max_bytes``
    (each entry counts its body, digest and key plus :attr:`ENTRY_OVERHEAD`), the oldest evicted first.
    An answer larger than ``max_bytes`` on its own is not kept. Used from the event loop only."""

    ENTRY_OVERHEAD = 512  # bytes of the entry's tuples, str and bytes headers and dict slot, roughly (CPython 3.11)

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple[str, str, str], tuple[str, bytes, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, str, str]) -> tuple[str, bytes] | None:
        entry = self._entries.get(key)
        return None if entry is None else (entry[0], entry[1])

    def put(self, key: tuple[str, str, str], digest: str, body: bytes) -> None:
        size = len(body) + len(digest) + sum(len(k) for k in key) + self.ENTRY_OVERHEAD
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old[2]
        if self.max_entries <= 0 or size > self.max_bytes:
            return
        self._entries[key] = (digest, body, size)
        self.nbytes += size
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self.nbytes -= self._entries.popitem(last=False)[1][2]


def _body_digest(body: RewardRequest) -> str:
    """What an ``Idempotency-Key`` promises to repeat: the request's trajectories, canonically."""
    text = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class _Pools:
    """A bounded thread pool per synchronous reward function, shared fairly by tenants
    (:class:`~rollart.reward.fair.FairSlots`: a tenant holds at most ``per_tenant`` of its threads, a
    freed thread goes to the tenant holding the fewest), and the calls really running in each (counted
    from the moment a thread starts the call until it returns, whether or not anyone still waits for
    it: its slot stays taken until then)."""

    def __init__(self, names: list[str], threads: int, per_tenant: int | None):
        self.executors = {
            n: ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"reward-{n}"[:40]) for n in names
        }
        self.slots = {n: FairSlots(threads, per_tenant) for n in names}
        self.running = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    async def run(self, name: str, fn: RewardFn, traj: dict[str, Any], tenant: str) -> Any:
        slots = self.slots[name]
        await slots.acquire(tenant)
        ctx = contextvars.copy_context()  # the request's sandbox deadline reaches the thread

        def call() -> Any:
            with self._lock:
                self.running[name] += 1
            try:
                return ctx.run(fn, traj)
            finally:
                with self._lock:
                    self.running[name] -= 1

        try:
            future = self.executors[name].submit(call)
        except BaseException:
            slots.release(tenant)
            raise
        future.add_done_callback(lambda _: slots.release_soon(tenant))  # when the call returns, not before
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        for executor in self.executors.values():
            executor.shutdown(wait=False, cancel_futures=True)

    def count(self, name: str) -> int:
        with self._lock:
            return self.running[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.running)

    def queued(self) -> dict[str, int]:
        """Trajectories waiting for a thread, per function."""
        return {n: s.waiting() for n, s in self.slots.items()}


def needs_sandbox(functions: dict[str, RewardFn]) -> list[str]:
    """The served functions that run code in the sandbox (they carry ``needs_sandbox = True``)."""
    return sorted(n for n, fn in functions.items() if getattr(fn, "needs_sandbox", False))


def build_app(functions: dict[str, RewardFn], settings: ServerSettings | None = None) -> FastAPI:
    """The reward service app (used by ``rollart serve rewards``, tests and Ray Serve). With
    ``settings.sandbox`` set it configures this process's code sandbox, and a function that runs code
    makes it fail (``SandboxUnavailable``) when no isolation layer is usable and the operator did not
    opt in with ``unsafe_no_sandbox``."""
    settings = settings or ServerSettings()
    if not functions:
        raise ValueError("build_app needs at least one reward function")
    token = read_token(settings.token_env, "--token-env") if settings.token_env else None
    tenant_tokens = load_tenants(settings.tenants_file) if settings.tenants_file else {}
    if settings.sandbox is not None:
        configure_sandbox(settings.sandbox, unsafe_no_sandbox=settings.unsafe_no_sandbox)
    code = needs_sandbox(functions)
    if code:
        from rollart.reward.sandbox import check, describe

        check()  # refuse to serve code functions without isolation (unless opted in)
        log.info("%s (for %s)", describe(), ", ".join(code))
    svc = _Service(functions, settings, tenant_tokens)
    auth = BearerAuth(
        token,
        tenant_tokens,
        description="the token of `--token-env`, or the caller's own token of `--tenants` (when the server has one)",
    )

    # a server with a token shows its schema and metrics to token holders only, and serves no docs page
    # (its script could not send the token)
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            svc.pools.shutdown()

    app = FastAPI(
        title="rollart reward service",
        version="1",
        lifespan=lifespan,
        openapi_url=None if auth.enabled else "/openapi.json",
        docs_url=None if auth.enabled else "/docs",
        redoc_url=None if auth.enabled else "/redoc",
    )
    _add_info_routes(app, svc, auth)
    _add_score_route(app, svc, auth)
    app.add_middleware(
        RequestGuard,
        limit=settings.max_body_bytes,
        auth=auth,
        public=("/healthz",),
        read_timeout_s=settings.read_timeout_s,
        on_reject=svc.rejected,
    )
    return app


class _Service:
    """What the reward app's routes share: the served functions, their metrics, thread pools and slots,
    the idempotency cache and the requests in flight (in all and per tenant label)."""

    def __init__(
        self,
        functions: dict[str, RewardFn],
        settings: ServerSettings,
        tenant_tokens: dict[str, tuple[bytes, int | None]],
    ):
        self.functions, self.settings, self.tenant_tokens = functions, settings, tenant_tokens
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "rollart_reward_requests", "reward requests", ["function", "status", "tenant"], registry=registry
        )
        self.scored = Counter(
            "rollart_reward_trajectories", "trajectories scored", ["function", "tenant"], registry=registry
        )
        self.latency = Histogram(
            "rollart_reward_latency_seconds", "reward request latency", ["function"], registry=registry
        )
        self.in_flight = Gauge("rollart_reward_in_flight", "reward requests being computed", registry=registry)
        self.tenant_in_flight = Gauge(
            "rollart_reward_tenant_in_flight",
            "reward requests being computed, per tenant",
            ["tenant"],
            registry=registry,
        )
        self.compute = Counter(
            "rollart_reward_compute_seconds",
            "seconds trajectories spent in reward functions (slot-seconds: busy time)",
            ["function", "tenant"],
            registry=registry,
        )
        Gauge("rollart_reward_slots", "trajectories computed at once (0: unbounded)", registry=registry).set(
            settings.slots or 0
        )
        sync = sorted(n for n, fn in functions.items() if not inspect.iscoroutinefunction(fn))
        self.pools = pools = _Pools(sync, settings.threads_per_function, settings.tenant_slots)
        running = Gauge("rollart_reward_running", "reward calls running in threads", ["function"], registry=registry)
        for name in pools.executors:
            running.labels(function=name).set_function(functools.partial(pools.count, name))
        Gauge("rollart_reward_sandboxes", "code sandboxes alive", registry=registry).set_function(sandboxes_running)
        self.busy = 0  # requests in flight
        self.per_tenant: dict[str, int] = {}  # requests in flight per tenant label (bounded like the labels)
        self.slots = FairSlots(settings.slots, settings.tenant_slots) if settings.slots else None
        self.tenants = TenantLabels(settings.max_tenants, reserved=set(tenant_tokens))
        self.cache = AnswerCache(settings.idempotency_cache, int(settings.idempotency_cache_mb * 1024 * 1024))

    def quota(self, tenant: str) -> int | None:
        spec = self.tenant_tokens.get(tenant)
        if spec is not None and spec[1] is not None:
            return spec[1]
        return self.settings.tenant_max_concurrency

    def count(self, name: str, status: int, tenant: str) -> None:
        # label values are bounded: served function names only, tenants through TenantLabels
        function = name if name in self.functions else "unknown"
        self.requests.labels(function=function, status=str(status), tenant=tenant).inc()

    def rejected(self, path: str) -> None:
        self.count(path.removeprefix("/rewards/") if path.startswith("/rewards/") else "", 401, "unauthenticated")

    async def call(self, fn: RewardFn, traj: dict[str, Any], name: str, tenant: str) -> Any:
        if self.slots is None:
            return await self.timed(fn, traj, name, tenant)
        await self.slots.acquire(tenant)
        try:
            return await self.timed(fn, traj, name, tenant)
        finally:
            self.slots.release(tenant)

    async def timed(self, fn: RewardFn, traj: dict[str, Any], name: str, tenant: str) -> Any:
        t0 = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(traj)
            return await self.pools.run(name, fn, traj, tenant)
        finally:
            self.compute.labels(function=name, tenant=tenant).inc(time.perf_counter() - t0)

    def caller(self, name: str, owner: str | None, header: str | None) -> str | None:
        """The calling tenant: the token's owner (an ``X-Rollart-Tenant`` naming another is 403), else the
        header, when it is a valid label (else 422)."""
        if owner is not None:  # the token says who calls; the header may only agree
            if header is not None and header != owner:
                self.count(name, 403, owner)
                raise HTTPException(403, f"X-Rollart-Tenant {header[:80]!r}: this token belongs to tenant {owner!r}")
            return owner
        if header is not None and not TenantLabels.valid(header):
            self.count(name, 422, "invalid")
            raise HTTPException(
                422,
                f"X-Rollart-Tenant {header[:80]!r}: use 1-64 characters from "
                "[A-Za-z0-9._:-], starting with a letter or digit",
            )
        return header

    def repeated(
        self, key: tuple[str, str, str], digest: str, name: str, tenant: str, idempotency_key: str
    ) -> Response | None:
        """The cached answer of a repeated ``Idempotency-Key`` (422 when it came with another body)."""
        cached = self.cache.get(key)
        if cached is None:
            return None
        seen_digest, encoded = cached
        if seen_digest != digest:
            self.count(name, 422, tenant)
            raise HTTPException(
                422,
                f"Idempotency-Key {str(idempotency_key)[:80]!r} was used with another body; "
                "send a new key for a new request",
            )
        self.count(name, 200, tenant)
        return Response(encoded, media_type="application/json")

    def refusal(self, name: str, tenant: str) -> JSONResponse | None:
        """The 429 of a request over its tenant's quota or the server's concurrency (None: admitted)."""
        limit = self.quota(tenant)
        if limit is not None and self.per_tenant.get(tenant, 0) >= limit:
            self.count(name, 429, tenant)
            return JSONResponse(
                {"detail": f"tenant {tenant!r} has {limit} reward requests in flight (its quota); retry later"},
                status_code=429,
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        if self.busy >= self.settings.max_concurrency:
            self.count(name, 429, tenant)
            return JSONResponse(
                {"detail": "reward service saturated; retry later"},
                status_code=429,
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        return None

    async def score(
        self, fn: RewardFn, name: str, tenant: str, body: RewardRequest, key: tuple[str, str, str] | None, digest: str
    ) -> Response:
        """Score an admitted request's trajectories under its deadline, and cache the answer under ``key``."""
        self.busy += 1
        self.per_tenant[tenant] = self.per_tenant.get(tenant, 0) + 1
        self.in_flight.inc()
        self.tenant_in_flight.labels(tenant=tenant).inc()
        t0 = time.perf_counter()
        scope, work = None, None
        try:
            trajs = [t.model_dump() for t in body.trajectories]
            try:
                # the sandboxes' own deadline is a backstop a second later: the request's timeout cancels them
                with deadline(self.settings.timeout_s + 1.0) as scope:
                    work = asyncio.gather(*(self.call(fn, t, name, tenant) for t in trajs))
                values = await asyncio.wait_for(work, self.settings.timeout_s)
                pairs = [_score_of(v) for v in values]
            except Exception as err:
                raise self.failure(name, tenant, err) from None
            encoded = _encode(pairs)
            if key is not None:
                self.cache.put(key, digest, encoded)
            self.count(name, 200, tenant)
            self.scored.labels(function=name, tenant=tenant).inc(len(trajs))
            return Response(encoded, media_type="application/json")
        finally:
            if work is not None and not work.done():  # one trajectory failed: the others stop too
                work.cancel()
            if scope is not None:  # timed out, failed or cancelled: its sandboxes die, none starts
                scope.cancel()
            self.latency.labels(function=name).observe(time.perf_counter() - t0)
            self.busy -= 1
            self.per_tenant[tenant] -= 1
            self.in_flight.dec()
            self.tenant_in_flight.labels(tenant=tenant).dec()

    def failure(self, name: str, tenant: str, err: Exception) -> HTTPException:
        """The answer to a request whose reward function failed (counted): 422 for input it refused, 504
        past the request's timeout, else 500 with the function's error."""
        if isinstance(err, RewardInputError):  # the caller asked for something the server refuses
            self.count(name, 422, tenant)
            return HTTPException(422, f"reward function {name!r} refused the input: {err}")
        if isinstance(err, (TimeoutError, SandboxCancelled)):
            self.count(name, 504, tenant)
            return HTTPException(504, f"reward function {name!r} took longer than {self.settings.timeout_s}s")
        self.count(name, 500, tenant)
        log.warning("reward function %s raised %s: %s", name, type(err).__name__, err)
        return HTTPException(500, f"reward function {name!r} raised {type(err).__name__}: {err}")


def _encode(pairs: list[tuple[float, dict[str, Any]]]) -> bytes:
    """The answer's JSON body, encoded once: the cache keeps these bytes, not the answer's Python objects
    (a float and a dict per trajectory: ~3 KB for a request of 18 trajectories against ~0.4 KB encoded)."""
    answer = RewardResponse(result=[s for s, _ in pairs], details=[d for _, d in pairs])
    return json.dumps(jsonable_encoder(answer), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _add_info_routes(app: FastAPI, svc: _Service, auth: BearerAuth) -> None:
    """The error handler, ``/healthz``, ``/metrics`` and (for a server with a token) ``/openapi.json``."""

    @app.exception_handler(StarletteHTTPException)
    async def malformed_is_422(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # a body that is not even JSON (FastAPI says 400) is malformed input like any other: 422
        status = 422 if exc.status_code == 400 else exc.status_code
        return JSONResponse({"detail": exc.detail}, status_code=status, headers=getattr(exc, "headers", None))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "functions": sorted(svc.functions),
            "in_flight": svc.busy,
            "running": svc.pools.snapshot(),
            "queued": svc.pools.queued(),
            "sandboxes": sandboxes_running(),
        }

    @app.get("/metrics")
    async def metrics(_: str | None = Depends(auth.dependency)) -> PlainTextResponse:
        return PlainTextResponse(generate_latest(svc.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    if auth.enabled:

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(_: str | None = Depends(auth.dependency)) -> JSONResponse:
            return JSONResponse(get_openapi(title=app.title, version=app.version, routes=app.routes))


def _add_score_route(app: FastAPI, svc: _Service, auth: BearerAuth) -> None:
    """``POST /rewards/{name}``: the guards in their order (tenant, function, idempotency, quota), then the scoring."""

    @app.post("/rewards/{name}", response_model=RewardResponse)
    async def score(
        name: str,
        body: RewardRequest,
        owner: str | None = Depends(auth.dependency),
        x_rollart_tenant: str | None = Header(default=None, description="tenant (job id) for metering"),
        idempotency_key: str | None = Header(default=None),
    ) -> Any:
        x_rollart_tenant = svc.caller(name, owner, x_rollart_tenant)
        tenant = svc.tenants.label(x_rollart_tenant)
        fn = svc.functions.get(name)
        if fn is None:
            svc.count(name, 404, tenant)
            raise HTTPException(404, f"no reward function {name!r}; served: {sorted(svc.functions)}")
        if idempotency_key:
            key = (x_rollart_tenant or "", name, idempotency_key)
            digest = _body_digest(body)
            cached = svc.repeated(key, digest, name, tenant, idempotency_key)
            if cached is not None:
                return cached
        else:
            key, digest = None, ""
        refused = svc.refusal(name, tenant)
        if refused is not None:
            return refused
        return await svc.score(fn, name, tenant, body, key, digest)
