"""Access control of rollart's HTTP services: the reward service's, shared with the env server.

- **Tokens.** One shared bearer token (``--token-env VAR``) or one token per tenant (``--tenants FILE``:
  ``tenants: {NAME: {token_env: VAR, max_concurrency: N}}``). Tokens have at least
  :data:`MIN_TOKEN_CHARS` characters (``python -c 'import secrets; print(secrets.token_urlsafe(32))'``)
  and are compared in constant time against every configured token (no early exit).
  :class:`RequestGuard` checks the token from the request's headers alone and answers 401 with
  ``WWW-Authenticate: Bearer`` (closing the connection) before any body byte is read;
  :class:`BearerAuth` is the FastAPI dependency that tells a route its tenant.
- **Body size and time.** :class:`RequestGuard` refuses a body over the limit with 413, declared
  (``Content-Length``) or streamed (chunked), and a body that has not arrived within the read timeout
  with 408, before the application sees it. Connections themselves are capped and must send their
  headers in time: :mod:`rollart.reward.http_server`.
- **Secrets out of the environment.** :func:`forget_env_secrets` removes the token variables from this
  process's environment once they are read -- children started later do not inherit them -- and blanks
  them in the process's initial environment block too, so ``/proc/<pid>/environ`` no longer shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import json
import logging
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
TOKEN_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
TENANT_FORMAT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def read_token(token_env: str, where: str) -> str:
    """The token in ``$token_env``; a clear error when it is unset or too short."""
    token = os.environ.get(token_env)
    if not token:
        raise ValueError(f"{where}: ${token_env} is not set; export it or drop the flag")
    check_token(token, f"{where}: ${token_env}")
    return token


def check_token(token: str, where: str) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{where} has {len(token)} characters; a bearer token needs at least {MIN_TOKEN_CHARS} "
            f"(make one with {TOKEN_HINT})"
        )


class TenantSpec(BaseModel):
    """One tenant of a shared service: its bearer token (``token_env``: the variable holding it, or
    ``token`` itself) and its concurrency quota (requests computed at once)."""

    model_config = ConfigDict(extra="forbid")

    token_env: str | None = None
    token: str | None = Field(default=None, min_length=MIN_TOKEN_CHARS)
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
        if TENANT_FORMAT.fullmatch(name) is None:
            raise ValueError(f"{where}: tenant {name!r}: use 1-64 characters from [A-Za-z0-9._:-]")
        if (tenant.token is None) == (tenant.token_env is None):
            raise ValueError(f"{where}: tenant {name!r}: give exactly one of token_env (preferred) or token")
        token = tenant.token if tenant.token is not None else os.environ.get(tenant.token_env or "")
        if not token:
            raise ValueError(f"{where}: tenant {name!r}: ${tenant.token_env} is not set; export it")
        check_token(token, f"{where}: tenant {name!r}: its token")
        if token.encode() in seen:
            raise ValueError(f"{where}: tenants {seen[token.encode()]!r} and {name!r} share a token; give each its own")
        seen[token.encode()] = name
        out[name] = (token.encode(), tenant.max_concurrency)
    return out


def tenant_token_envs(path: str) -> list[str]:
    """The variables a tenants file reads its tokens from (to forget them once read)."""
    import yaml

    try:
        spec = TenantsFile.model_validate(yaml.safe_load(Path(path).read_text()))
    except (OSError, ValueError):
        return []
    return [t.token_env for t in spec.tenants.values() if t.token_env]


class BearerAuth:
    """Who calls: a FastAPI dependency (:attr:`dependency`) returning the tenant of the token
    (``tenants``), or None for the shared token; 401 for a missing or wrong one. With neither a shared
    token nor tenants, every caller is accepted and no scheme is advertised in ``/openapi.json``.
    :class:`RequestGuard` asks :meth:`identify` the same question from the headers alone, before any
    body byte is read; the dependency asks it again for the route (and declares the scheme)."""

    def __init__(
        self,
        token: str | None,
        tenants: dict[str, tuple[bytes, int | None]],
        *,
        description: str,
        on_reject: Callable[[Request], None] | None = None,
    ):
        if token is not None and tenants:
            raise ValueError("--token-env and --tenants: give one (a shared token, or a token per tenant)")
        self.token = token.encode() if token is not None else None
        self.tenants = tenants
        self.enabled = token is not None or bool(tenants)
        self.on_reject = on_reject
        bearer = HTTPBearer(auto_error=False, description=description)

        async def authenticate(
            request: Request,
            credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008 (FastAPI's idiom)
        ) -> str | None:
            return self.owner(request, credentials)

        async def anyone() -> None:
            return None

        self.dependency: Callable[..., Any] = authenticate if self.enabled else anyone

    def identify(self, given: bytes | None) -> tuple[bool, str | None]:
        """``(accepted, tenant)`` of a bearer token (``None``: no token given). Compared in constant time
        with every configured token, no early exit."""
        if not self.enabled:
            return True, None
        token = given or b""
        if self.token is not None and given is not None and hmac.compare_digest(token, self.token):
            return True, None
        owner = None
        for name, (secret, _) in self.tenants.items():  # compare with every token: no early exit
            if hmac.compare_digest(token, secret) and given is not None:
                owner = name
        return owner is not None, owner

    def owner(self, request: Request, credentials: HTTPAuthorizationCredentials | None) -> str | None:
        accepted, owner = self.identify(credentials.credentials.encode() if credentials is not None else None)
        if accepted:
            return owner
        if self.on_reject is not None:
            self.on_reject(request)
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header value (the scheme in any case)."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(b" ")
    if scheme.lower() != b"bearer" or not value.strip():
        return None
    return value.strip()


def json_detail(status: int, message: str) -> bytes:
    """The error body of the reward service and the env server: ``{"detail": message}``."""
    return json.dumps({"detail": message}).encode()


class RequestGuard:
    """ASGI middleware in front of a service's app. In the order a request meets it:

    1. **Token, from the headers alone** (with ``auth``): a request to a path outside ``public`` without
       an accepted bearer token is answered 401 (``WWW-Authenticate: Bearer``) and its connection
       closed, before any body byte is read: a client without the token cannot make the server hold
       or buffer a body.
    2. **Declared size**: a ``Content-Length`` over ``limit`` is 413 (and the connection closed).
    3. **Body, under a deadline**: the body is read before the app runs; one that grows past ``limit``
       is 413, one that has not fully arrived ``read_timeout_s`` seconds after its headers is 408, each
       closing the connection (a slow body cannot hold the server).

    ``error(status, message)`` makes the response body (the service's own error format);
    ``on_reject(path)`` is told of each 401 (metrics); ``token_headers``: headers that carry the token
    as it is, where no ``Authorization: Bearer`` header does (``x-api-key``)."""

    def __init__(
        self,
        app: Any,
        limit: int,
        *,
        auth: BearerAuth | None = None,
        public: Collection[str] = ("/healthz",),
        read_timeout_s: float | None = None,
        error: Callable[[int, str], bytes] = json_detail,
        on_reject: Callable[[str], None] | None = None,
        token_headers: Collection[str] = (),
    ):
        self.app, self.limit = app, limit
        self.token_headers = [h.lower().encode() for h in token_headers]
        self.auth = auth if auth is not None and auth.enabled else None
        self.public = frozenset(public)
        self.read_timeout_s = read_timeout_s
        self.error, self.on_reject = error, on_reject

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.auth is not None and scope.get("path") not in self.public:
            given = bearer_token(headers.get(b"authorization"))
            for name in self.token_headers:  # e.g. x-api-key, where an Anthropic client sends its key
                if given is None and headers.get(name, b"").strip():
                    given = headers[name].strip()
            accepted, _ = self.auth.identify(given)
            if not accepted:
                if self.on_reject is not None:
                    self.on_reject(str(scope.get("path", "")))
                await self._answer(send, 401, "missing or wrong bearer token", [(b"www-authenticate", b"Bearer")])
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._answer(send, 413, "request body too large")
            return
        chunks, size, more = [], 0, True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s if self.read_timeout_s is not None else None
        while more:
            try:
                if deadline is None:
                    message = await receive()
                else:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                await self._answer(send, 408, f"the request body did not arrive within {self.read_timeout_s:g} s")
                return
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await self._answer(send, 413, "request body too large")
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

    async def _answer(
        self, send: Callable, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        """An error answer that closes the connection (what the client still sends is never read)."""
        body = self.error(status, message)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                    *(extra or []),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


BodyLimit = RequestGuard  # the body-size guard alone: ``add_middleware(BodyLimit, limit=N)``


def beyond_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` may be reached from other machines (anything but a loopback
    address or ``localhost``)."""
    import ipaddress

    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return True


def forget_env_secrets(names: list[str]) -> list[str]:
    """Remove the variables ``names`` from this process's environment (children no longer inherit them)
    and overwrite their values in the initial environment block (``/proc/self/environ``); the names
    forgotten. Call it once every token is read."""
    gone = [n for n in names if n and n in os.environ]
    for name in gone:
        os.environ.pop(name, None)
    if gone:
        with contextlib.suppress(OSError, ValueError, IndexError):
            _blank_initial_environ({n.encode() for n in gone})
    return gone


def _blank_initial_environ(names: set[bytes]) -> None:
    """Zero ``NAME=value`` entries of ``names`` in the memory ``/proc/self/environ`` is read from
    (between ``env_start`` and ``env_end`` of ``/proc/self/stat``). Their pointers were removed from
    ``environ`` by :func:`os.unsetenv` first, so nothing reads that memory any more."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    # fields after the command name start at field 3 (state); env_start, env_end are fields 50, 51
    start, end = int(fields[50 - 3]), int(fields[51 - 3])
    if not 0 < start < end:
        return
    block = ctypes.string_at(start, end - start)
    offset = 0
    for entry in block.split(b"\0"):
        name, sep, _ = entry.partition(b"=")
        if sep and name in names:
            ctypes.memset(start + offset + len(name) + 1, 0, len(entry) - len(name) - 1)
        offset += len(entry) + 1
