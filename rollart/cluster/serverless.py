"""HTTP transport of ``@register_serverless`` methods (RollArt paper §4.3, §5.2).

Wire protocol: the call POSTs a JSON object of the method's arguments by parameter name, with
``Authorization: Bearer <token>`` when a token variable is configured, one ``Idempotency-Key`` reused
by every retry of the call, and ``X-Rollart-Tenant: <job id>``. The answer is ``{"result": value, ...}``
and the call returns ``value`` (a JSON object without ``"result"`` is returned whole).

Retries: connection errors, timeouts, 5xx, 408 and 429 are retried with delay
``min(backoff_max_s, backoff_base_s * 2**k) * (1 + U(-jitter, jitter))`` before attempt ``k + 1``;
a ``Retry-After`` header (seconds or an HTTP date) replaces the computed delay, capped at
``retry_after_max_s``. A 429 (the server, or the caller's tenant on a shared service, is over its
quota) is the server asking to come back later: up to ``throttle_retries`` of them are waited out
without using up ``retries``. Any other 4xx fails at once with the server's message. When the retries run out
:class:`ServerlessRetriesExhausted` is raised. No failure ever becomes a default value.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import logging
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {408, 429}


class ServerlessError(RuntimeError):
    """A serverless call failed; ``status`` is the last HTTP status (None for transport errors)."""

    def __init__(self, url: str, message: str, status: int | None = None, attempts: int = 1):
        self.url, self.status, self.attempts, self.message = url, status, attempts, message
        super().__init__(f"{url}: {message} (status {status}, {attempts} attempt(s))")


class ServerlessRequestError(ServerlessError):
    """The server refused the request (4xx other than 408/429): not retried."""


class ServerlessRetriesExhausted(ServerlessError):
    """Connection errors, timeouts, 5xx or 429 kept coming until the retries ran out."""


class RetryPolicy(BaseModel):
    model_config = ConfigDict(frozen=True)

    retries: int = Field(default=3, ge=0)
    backoff_base_s: float = Field(default=0.2, ge=0)
    backoff_max_s: float = Field(default=10.0, ge=0)
    jitter: float = Field(default=0.5, ge=0, le=1)
    retry_after_max_s: float = Field(default=60.0, ge=0)
    throttle_retries: int = Field(default=30, ge=0)  # 429 answers waited out on top of ``retries``

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (``attempt`` counts from 0)."""
        if retry_after:
            parsed = _parse_retry_after(retry_after)
            if parsed is not None:
                return min(parsed, self.retry_after_max_s)
        base = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        return max(0.0, base * (1 + random.uniform(-self.jitter, self.jitter)))


def _parse_retry_after(value: str) -> float | None:
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _headers(token_env: str | None, tenant: str | None, key: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            raise ServerlessRequestError(
                "(not sent)", f"token_env={token_env!r} is not set in the environment; export it or drop token_env"
            )
        headers["Authorization"] = f"Bearer {token}"
    if tenant:
        headers["X-Rollart-Tenant"] = tenant
    return headers


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])
        return str(body)[:500]
    except ValueError:
        return resp.text[:500]


def _decode(url: str, resp: httpx.Response, attempts: int) -> Any:
    try:
        body = resp.json()
    except ValueError:
        raise ServerlessError(url, f"answer is not JSON: {resp.text[:200]!r}", resp.status_code, attempts) from None
    if isinstance(body, dict) and "result" in body:
        return body["result"]
    return body


class _Attempts:
    """What the sync and async loops share: classify each answer, remember the last failure, and say
    how long to wait before the next attempt (``None``: no attempt left). A 429 uses up
    ``throttle_retries`` first, every other failure ``retries``."""

    def __init__(self, url: str, retry: RetryPolicy):
        self.url, self.retry = url, retry
        self.status: int | None = None
        self.error = ""
        self.retry_after: str | None = None
        self.sent = 0  # attempts made
        self.failures = 0  # retries used (429 aside)
        self.throttled = 0  # 429 answers waited out

    def answer(self, resp: httpx.Response) -> tuple[bool, Any]:
        """``(True, result)`` on success; ``(False, None)`` for a retryable status; raises a client error."""
        self.sent += 1
        if resp.status_code < 300:
            return True, _decode(self.url, resp, self.sent)
        if resp.status_code < 500 and resp.status_code not in RETRYABLE_STATUS:
            raise ServerlessRequestError(self.url, _message(resp), resp.status_code, self.sent)
        self.status, self.error, self.retry_after = resp.status_code, _message(resp), resp.headers.get("Retry-After")
        return False, None

    def transport_error(self, err: httpx.TransportError) -> None:  # connection refused/reset, timeouts
        self.sent += 1
        self.status, self.error, self.retry_after = None, f"{type(err).__name__}: {err}", None

    def wait(self) -> float | None:
        if self.status == 429 and self.throttled < self.retry.throttle_retries:
            self.throttled += 1
            delay = self.retry.delay(min(self.throttled - 1, 8), self.retry_after)
        elif self.failures >= self.retry.retries:
            return None
        else:
            delay = self.retry.delay(self.failures, self.retry_after)
            self.failures += 1
        log.warning(
            "serverless %s attempt %d failed (%s %s); retrying in %.2fs",
            self.url,
            self.sent,
            self.status,
            self.error,
            delay,
        )
        return delay

    def exhausted(self) -> ServerlessRetriesExhausted:
        return ServerlessRetriesExhausted(self.url, self.error, self.status, self.sent)


def _retry_loop(
    url: str, retry: RetryPolicy
) -> Generator[float | None, httpx.Response | httpx.TransportError | None, Any]:
    """The retry loop of both call forms, without I/O. It yields ``None`` for an attempt (send back the
    answer, or the transport error: connection refused or reset, a timeout) and a number of seconds to
    wait before the next one (send back ``None``); it returns the decoded result, and raises a client
    error at once and :class:`ServerlessRetriesExhausted` when no attempt is left."""
    state = _Attempts(url, retry)
    while True:
        outcome = yield None
        if isinstance(outcome, httpx.TransportError):
            state.transport_error(outcome)
        elif outcome is not None:
            done, value = state.answer(outcome)
            if done:
                return value
        delay = state.wait()
        if delay is None:
            raise state.exhausted()
        yield delay


def _outcome(post: Callable[[], httpx.Response]) -> httpx.Response | httpx.TransportError:
    try:
        return post()
    except httpx.TransportError as err:
        return err


async def _aoutcome(post: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response | httpx.TransportError:
    try:
        return await post()
    except httpx.TransportError as err:
        return err


def call_serverless(
    url: str,
    payload: dict[str, Any],
    *,
    timeout_s: float,
    retry: RetryPolicy,
    token_env: str | None = None,
    tenant: str | None = None,
    idempotency_key: str | None = None,
    client: httpx.Client | None = None,
    token: str | None = None,
) -> Any:
    """POST ``payload`` and return the decoded result, retrying as the module docstring says. ``token``
    (a bearer token held in memory) is sent in place of ``token_env``'s."""
    headers = _headers(None if token else token_env, tenant, idempotency_key or uuid.uuid4().hex)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    http = client or httpx.Client(timeout=timeout_s)
    loop = _retry_loop(url, retry)
    post = functools.partial(http.post, url, json=payload, headers=headers, timeout=timeout_s)
    try:
        step = next(loop)
        while True:  # the loop yields None for an attempt, else the seconds to wait
            if step is None:
                step = loop.send(_outcome(post))
            else:
                time.sleep(step)
                step = loop.send(None)
    except StopIteration as done:
        return done.value
    finally:
        if client is None:
            http.close()


async def acall_serverless(
    url: str,
    payload: dict[str, Any],
    *,
    timeout_s: float,
    retry: RetryPolicy,
    token_env: str | None = None,
    tenant: str | None = None,
    idempotency_key: str | None = None,
    client: httpx.AsyncClient | None = None,
) -> Any:
    """The asyncio form of :func:`call_serverless`."""
    headers = _headers(token_env, tenant, idempotency_key or uuid.uuid4().hex)
    http = client or httpx.AsyncClient(timeout=timeout_s)
    loop = _retry_loop(url, retry)
    post = functools.partial(http.post, url, json=payload, headers=headers, timeout=timeout_s)
    try:
        step = next(loop)
        while True:  # the loop yields None for an attempt, else the seconds to wait
            if step is None:
                step = loop.send(await _aoutcome(post))
            else:
                await asyncio.sleep(step)
                step = loop.send(None)
    except StopIteration as done:
        return done.value
    finally:
        if client is None:
            await http.aclose()
