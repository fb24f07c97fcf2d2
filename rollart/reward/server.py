"""The reward service: reward functions behind HTTP (seed 004 §4.3, §7.5 "Reward-as-a-Service").

``POST /rewards/<name>`` with ``{"trajectories": [...]}`` answers ``{"result": [scores], "details": [...]}``.
Guards, in the order a request meets them: body size (413), bearer token compared in constant time
(401), concurrency limit (429 + ``Retry-After``), schema (422, never 500), per-request timeout (504).
A reward function that raises gives a 500 carrying its message — never a made-up score. A repeated
``Idempotency-Key`` (per tenant and function) is answered from a bounded cache without recomputing or
counting twice. ``/metrics`` is Prometheus text (requests, latency, in flight, per tenant);
``/healthz`` lists the functions. JSON only, never pickle.

The token is checked by FastAPI's ``HTTPBearer`` (so ``/openapi.json`` declares the scheme) before the
body is validated: an unauthenticated caller learns nothing about the schema. The tenant label
(``X-Rollart-Tenant``) must match ``[A-Za-z0-9][A-Za-z0-9._:-]{0,63}`` (else 422); the first
``max_tenants`` distinct tenants keep their own label in ``/metrics``, later ones are counted as
``other`` (and unauthenticated requests as ``unauthenticated``), so a client cannot grow the metrics
without bound. A reward function that raises ``RewardInputError`` answers 422 with its message.

Tenants (``ServerSettings.tenants_file``, ``rollart serve rewards --tenants FILE``): every job gets a
token of its own, and the bearer token alone says which tenant calls (a request whose
``X-Rollart-Tenant`` names another tenant is refused with 403), so a client cannot be metered, cached or
throttled as someone else. Each tenant may have a concurrency quota (``max_concurrency`` in the file,
else ``tenant_max_concurrency``): a request over it gets 429 with ``Retry-After`` while the other
tenants are served. The idempotency cache is keyed by tenant: the same key from two tenants are two
requests. ``slots`` bounds the trajectories computed at once (the service's capacity, e.g. the GPUs of
a reward model); ``rollart_reward_compute_seconds`` counts the seconds trajectories spent computing,
so ``compute_seconds / (slots * wall)`` is the service's utilisation.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
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
from rollart.reward.schemas import RewardRequest, RewardResponse

log = logging.getLogger(__name__)

RewardFn = Callable[[dict[str, Any]], float | dict[str, Any] | Awaitable[float | dict[str, Any]]]


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_env: str | None = None
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    timeout_s: float = Field(default=60.0, gt=0)
    max_concurrency: int = Field(default=64, gt=0)
    idempotency_cache: int = Field(default=10_000, ge=0)
    retry_after_s: int = Field(default=1, ge=0)
    max_tenants: int = Field(default=100, ge=0)
    tenants_file: str | None = None  # YAML/JSON: tenants: {NAME: {token_env | token, max_concurrency}}
    tenant_max_concurrency: int | None = Field(default=None, gt=0)  # default quota per tenant
    slots: int | None = Field(default=None, gt=0)  # trajectories computed at once (None: unbounded)


TENANT_FORMAT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


class TenantSpec(BaseModel):
    """One tenant of a shared reward service: its bearer token (``token_env``: the variable holding it,
    or ``token`` itself) and its concurrency quota (requests computed at once)."""

    model_config = ConfigDict(extra="forbid")

    token_env: str | None = None
    token: str | None = Field(default=None, min_length=16)
    max_concurrency: int | None = Field(default=None, gt=0)


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantSpec] = Field(min_length=1)


def load_tenants(path: str) -> dict[str, tuple[bytes, int | None]]:
    """``{tenant: (token, quota)}`` from a tenants file; a clear error naming the tenant and the fix."""
    import yaml

    where = f"--tenants {path}"
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"{where}: cannot read the file ({err})") from None
    try:
        spec = TenantsFile.model_validate(raw)
    except ValueError as err:
        raise ValueError(
            f"{where}: {err}; expected 'tenants: {{NAME: {{token_env: VAR, max_concurrency: N}}}}'"
        ) from None
    out: dict[str, tuple[bytes, int | None]] = {}
    seen: dict[bytes, str] = {}
    for name, tenant in spec.tenants.items():
        if not TenantLabels.valid(name):
            raise ValueError(f"{where}: tenant {name!r}: use 1-64 characters from [A-Za-z0-9._:-]")
        if (tenant.token is None) == (tenant.token_env is None):
            raise ValueError(f"{where}: tenant {name!r}: give exactly one of token_env (preferred) or token")
        token = tenant.token if tenant.token is not None else os.environ.get(tenant.token_env or "")
        if not token:
            raise ValueError(f"{where}: tenant {name!r}: ${tenant.token_env} is not set; export it")
        if token.encode() in seen:
            raise ValueError(f"{where}: tenants {seen[token.encode()]!r} and {name!r} share a token; give each its own")
        seen[token.encode()] = name
        out[name] = (token.encode(), tenant.max_concurrency)
    return out


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


class BodyLimit:
    """ASGI middleware: refuse bodies over ``limit`` bytes with 413 (declared or streamed)."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await self._too_large(send)
                return
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Callable) -> None:
        body = b'{"detail":"request body too large"}'
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _score_of(value: Any) -> tuple[float, dict[str, Any]]:
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError("a reward function that returns a dict must include 'score'")
        return float(value["score"]), {k: v for k, v in value.items() if k != "score"}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a reward function must return a number or a dict with 'score', got {type(value).__name__}")
    return float(value), {}


def build_app(functions: dict[str, RewardFn], settings: ServerSettings | None = None) -> FastAPI:
    """The reward service app (used by ``rollart serve rewards``, tests and Ray Serve)."""
    settings = settings or ServerSettings()
    if not functions:
        raise ValueError("build_app needs at least one reward function")
    token = os.environ.get(settings.token_env) if settings.token_env else None
    if settings.token_env and not token:
        raise ValueError(f"--token-env {settings.token_env}: the variable is not set; export it or drop the flag")
    tenant_tokens = load_tenants(settings.tenants_file) if settings.tenants_file else {}
    if tenant_tokens and token is not None:
        raise ValueError("--token-env and --tenants: give one (a shared token, or a token per tenant)")
    registry = CollectorRegistry()
    requests = Counter(
        "rollart_reward_requests", "reward requests", ["function", "status", "tenant"], registry=registry
    )
    scored = Counter("rollart_reward_trajectories", "trajectories scored", ["function", "tenant"], registry=registry)
    latency = Histogram("rollart_reward_latency_seconds", "reward request latency", ["function"], registry=registry)
    in_flight = Gauge("rollart_reward_in_flight", "reward requests being computed", registry=registry)
    tenant_in_flight = Gauge(
        "rollart_reward_tenant_in_flight", "reward requests being computed, per tenant", ["tenant"], registry=registry
    )
    compute = Counter(
        "rollart_reward_compute_seconds",
        "seconds trajectories spent in reward functions (slot-seconds: busy time)",
        ["function", "tenant"],
        registry=registry,
    )
    Gauge("rollart_reward_slots", "trajectories computed at once (0: unbounded)", registry=registry).set(
        settings.slots or 0
    )
    state = {"in_flight": 0}
    per_tenant: dict[str, int] = {}  # requests in flight per tenant label (bounded like the labels)
    slots = asyncio.Semaphore(settings.slots) if settings.slots else None
    tenants = TenantLabels(settings.max_tenants, reserved=set(tenant_tokens))
    cache: OrderedDict[tuple[str, str, str], dict[str, Any]] = OrderedDict()

    def quota(tenant: str) -> int | None:
        spec = tenant_tokens.get(tenant)
        if spec is not None and spec[1] is not None:
            return spec[1]
        return settings.tenant_max_concurrency

    app = FastAPI(title="rollart reward service", version="1")

    @app.exception_handler(StarletteHTTPException)
    async def malformed_is_422(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # a body that is not even JSON (FastAPI says 400) is malformed input like any other: 422
        status = 422 if exc.status_code == 400 else exc.status_code
        return JSONResponse({"detail": exc.detail}, status_code=status, headers=getattr(exc, "headers", None))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "functions": sorted(functions), "in_flight": state["in_flight"]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    def count(name: str, status: int, tenant: str) -> None:
        # label values are bounded: served function names only, tenants through TenantLabels
        requests.labels(function=name if name in functions else "unknown", status=str(status), tenant=tenant).inc()

    async def call(fn: RewardFn, traj: dict[str, Any], name: str, tenant: str) -> Any:
        if slots is not None:
            async with slots:
                return await timed(fn, traj, name, tenant)
        return await timed(fn, traj, name, tenant)

    async def timed(fn: RewardFn, traj: dict[str, Any], name: str, tenant: str) -> Any:
        t0 = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(traj)
            return await asyncio.get_running_loop().run_in_executor(None, fn, traj)
        finally:
            compute.labels(function=name, tenant=tenant).inc(time.perf_counter() - t0)

    bearer = HTTPBearer(
        auto_error=False,
        description="the token of `--token-env`, or the caller's own token of `--tenants` (when the server has one)",
    )
    authenticated = token is not None or bool(tenant_tokens)

    async def authenticate(
        request: Request,
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008 (FastAPI's idiom)
    ) -> str | None:
        """The tenant the token belongs to (``--tenants``), else None; 401 for a missing or wrong token.
        A dependency runs before the body is validated: an unauthenticated caller learns nothing about
        the schema."""
        given = credentials.credentials.encode() if credentials is not None else b""
        if token is not None and credentials is not None and hmac.compare_digest(given, token.encode()):
            return None
        owner = None
        for name, (secret, _) in tenant_tokens.items():  # compare with every token: no early exit
            if hmac.compare_digest(given, secret) and credentials is not None:
                owner = name
        if owner is not None:
            return owner
        count(request.path_params.get("name", ""), 401, "unauthenticated")
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    async def anyone() -> None:  # no token configured: no scheme advertised in /openapi.json
        return None

    @app.post("/rewards/{name}", response_model=RewardResponse)
    async def score(
        name: str,
        body: RewardRequest,
        owner: str | None = Depends(authenticate if authenticated else anyone),
        x_rollart_tenant: str | None = Header(default=None, description="tenant (job id) for metering"),
        idempotency_key: str | None = Header(default=None),
    ) -> Any:
        if owner is not None:  # the token says who calls; the header may only agree
            if x_rollart_tenant is not None and x_rollart_tenant != owner:
                count(name, 403, owner)
                raise HTTPException(
                    403, f"X-Rollart-Tenant {x_rollart_tenant[:80]!r}: this token belongs to tenant {owner!r}"
                )
            x_rollart_tenant = owner
        elif x_rollart_tenant is not None and not TenantLabels.valid(x_rollart_tenant):
            count(name, 422, "invalid")
            raise HTTPException(
                422,
                f"X-Rollart-Tenant {x_rollart_tenant[:80]!r}: use 1-64 characters from "
                "[A-Za-z0-9._:-], starting with a letter or digit",
            )
        tenant = tenants.label(x_rollart_tenant)
        fn = functions.get(name)
        if fn is None:
            count(name, 404, tenant)
            raise HTTPException(404, f"no reward function {name!r}; served: {sorted(functions)}")
        key = (x_rollart_tenant or "", name, idempotency_key) if idempotency_key else None
        if key is not None and key in cache:
            count(name, 200, tenant)
            return cache[key]
        limit = quota(tenant)
        if limit is not None and per_tenant.get(tenant, 0) >= limit:
            count(name, 429, tenant)
            return JSONResponse(
                {"detail": f"tenant {tenant!r} has {limit} reward requests in flight (its quota); retry later"},
                status_code=429,
                headers={"Retry-After": str(settings.retry_after_s)},
            )
        if state["in_flight"] >= settings.max_concurrency:
            count(name, 429, tenant)
            return JSONResponse(
                {"detail": "reward service saturated; retry later"},
                status_code=429,
                headers={"Retry-After": str(settings.retry_after_s)},
            )
        state["in_flight"] += 1
        per_tenant[tenant] = per_tenant.get(tenant, 0) + 1
        in_flight.inc()
        tenant_in_flight.labels(tenant=tenant).inc()
        t0 = time.perf_counter()
        try:
            trajs = [t.model_dump() for t in body.trajectories]
            try:
                values = await asyncio.wait_for(
                    asyncio.gather(*(call(fn, t, name, tenant) for t in trajs)), settings.timeout_s
                )
                pairs = [_score_of(v) for v in values]
            except RewardInputError as err:  # the caller asked for something the server refuses
                count(name, 422, tenant)
                raise HTTPException(422, f"reward function {name!r} refused the input: {err}") from None
            except TimeoutError:
                count(name, 504, tenant)
                raise HTTPException(504, f"reward function {name!r} took longer than {settings.timeout_s}s") from None
            except Exception as err:
                count(name, 500, tenant)
                log.warning("reward function %s raised %s: %s", name, type(err).__name__, err)
                raise HTTPException(500, f"reward function {name!r} raised {type(err).__name__}: {err}") from None
            answer = {"result": [s for s, _ in pairs], "details": [d for _, d in pairs]}
            if key is not None and settings.idempotency_cache > 0:
                cache[key] = answer
                while len(cache) > settings.idempotency_cache:
                    cache.popitem(last=False)
            count(name, 200, tenant)
            scored.labels(function=name, tenant=tenant).inc(len(trajs))
            return answer
        finally:
            latency.labels(function=name).observe(time.perf_counter() - t0)
            state["in_flight"] -= 1
            per_tenant[tenant] -= 1
            in_flight.dec()
            tenant_in_flight.labels(tenant=tenant).dec()

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
