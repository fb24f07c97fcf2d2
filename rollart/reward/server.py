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


TENANT_FORMAT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


class TenantLabels:
    """Bounded Prometheus label values for tenants: the first ``limit`` distinct tenants keep their name,
    the rest share ``other``. Thread-safe (one instance per app)."""

    def __init__(self, limit: int):
        self.limit = limit
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
    registry = CollectorRegistry()
    requests = Counter(
        "rollart_reward_requests", "reward requests", ["function", "status", "tenant"], registry=registry
    )
    scored = Counter("rollart_reward_trajectories", "trajectories scored", ["function", "tenant"], registry=registry)
    latency = Histogram("rollart_reward_latency_seconds", "reward request latency", ["function"], registry=registry)
    in_flight = Gauge("rollart_reward_in_flight", "reward requests being computed", registry=registry)
    state = {"in_flight": 0}
    tenants = TenantLabels(settings.max_tenants)
    cache: OrderedDict[tuple[str, str, str], dict[str, Any]] = OrderedDict()

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

    async def call(fn: RewardFn, traj: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(traj)
        return await asyncio.get_running_loop().run_in_executor(None, fn, traj)

    bearer = HTTPBearer(auto_error=False, description="the token of `--token-env` (when the server has one)")

    async def authenticate(
        request: Request,
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008 (FastAPI's idiom)
    ) -> None:
        # a dependency runs before the body is validated: an unauthenticated caller learns nothing about the schema
        if token is None:
            return
        given = credentials.credentials.encode() if credentials is not None else b""
        if credentials is None or not hmac.compare_digest(given, token.encode()):
            count(request.path_params.get("name", ""), 401, "unauthenticated")
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @app.post(
        "/rewards/{name}",
        response_model=RewardResponse,
        dependencies=[Depends(authenticate)] if token is not None else [],
    )
    async def score(
        name: str,
        body: RewardRequest,
        x_rollart_tenant: str | None = Header(default=None, description="tenant (job id) for metering"),
        idempotency_key: str | None = Header(default=None),
    ) -> Any:
        if x_rollart_tenant is not None and not TenantLabels.valid(x_rollart_tenant):
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
        if state["in_flight"] >= settings.max_concurrency:
            count(name, 429, tenant)
            return JSONResponse(
                {"detail": "reward service saturated; retry later"},
                status_code=429,
                headers={"Retry-After": str(settings.retry_after_s)},
            )
        state["in_flight"] += 1
        in_flight.inc()
        t0 = time.perf_counter()
        try:
            trajs = [t.model_dump() for t in body.trajectories]
            try:
                values = await asyncio.wait_for(asyncio.gather(*(call(fn, t) for t in trajs)), settings.timeout_s)
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
            in_flight.dec()

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
