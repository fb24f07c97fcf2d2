"""Access control of rollart's HTTP services: the reward service's, shared with the env server.

- **Tokens.** One shared bearer token (``--token-env VAR``) or one token per tenant (``--tenants FILE``:
  ``tenants: {NAME: {token_env: VAR, max_concurrency: N}}``). Tokens have at least
  :data:`MIN_TOKEN_CHARS` characters (``python -c 'import secrets; print(secrets.token_urlsafe(32))'``)
  and are compared in constant time against every configured token (no early exit). :class:`BearerAuth`
  is a FastAPI dependency: it runs before the body is read, so an unauthenticated caller learns nothing
  about the schema, and answers 401 with ``WWW-Authenticate: Bearer``.
- **Body size.** :class:`BodyLimit` refuses a body over the limit with 413, declared
  (``Content-Length``) or streamed (chunked), before the application sees it.
- **Secrets out of the environment.** :func:`forget_env_secrets` removes the token variables from this
  process's environment once they are read -- children started later do not inherit them -- and blanks
  them in the process's initial environment block too, so ``/proc/<pid>/environ`` no longer shows them.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import logging
import os
import re
from collections.abc import Callable
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
    token nor tenants, every caller is accepted and no scheme is advertised in ``/openapi.json``."""

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

    def owner(self, request: Request, credentials: HTTPAuthorizationCredentials | None) -> str | None:
        given = credentials.credentials.encode() if credentials is not None else b""
        if self.token is not None and credentials is not None and hmac.compare_digest(given, self.token):
            return None
        owner = None
        for name, (secret, _) in self.tenants.items():  # compare with every token: no early exit
            if hmac.compare_digest(given, secret) and credentials is not None:
                owner = name
        if owner is not None:
            return owner
        if self.on_reject is not None:
            self.on_reject(request)
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


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
