"""``@register_serverless``: a stateless method served over HTTP, never run locally (RollArt paper §4.3, §5.1)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

from rollart.decorators.specs import SERVERLESS_ATTR, ServerlessSpec

F = TypeVar("F", bound=Callable[..., Any])


def register_serverless(
    url: str,
    timeout_s: float = 30.0,
    retries: int = 3,
    token_env: str | None = None,
    backoff_base_s: float = 0.2,
    backoff_max_s: float = 10.0,
) -> Callable[[F], F]:
    """Serve a worker method from ``url``: the Cluster POSTs the arguments as a JSON object keyed by
    parameter name and returns the ``result`` of the JSON answer.

    Connection errors, timeouts, 5xx and 429 are retried ``retries`` times with exponential backoff
    and jitter (``Retry-After`` honoured); any other 4xx fails at once with the server's message; when
    the retries run out a typed error is raised — never a default value. ``token_env`` names the
    environment variable whose value is sent as a bearer token.
    """
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"register_serverless(url={url!r}): give an absolute http:// or https:// URL")
    if timeout_s <= 0:
        raise ValueError(f"register_serverless(timeout_s={timeout_s}): must be > 0 seconds")
    if retries < 0:
        raise ValueError(f"register_serverless(retries={retries}): must be >= 0")
    if backoff_base_s < 0 or backoff_max_s < backoff_base_s:
        raise ValueError("register_serverless: need 0 <= backoff_base_s <= backoff_max_s")
    spec = ServerlessSpec(
        url=url,
        timeout_s=float(timeout_s),
        retries=int(retries),
        token_env=token_env,
        backoff_base_s=float(backoff_base_s),
        backoff_max_s=float(backoff_max_s),
    )

    def mark(fn: F) -> F:
        setattr(fn, SERVERLESS_ATTR, spec)
        return fn

    return mark
