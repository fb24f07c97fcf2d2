"""The env session protocol: a :class:`~rollart.envs.TextEnv` behind HTTP (RollArt paper §2.2, §3.1, §8).

An env server (``rollart serve env MODULE:CLASS ...``, a Ray actor of the ``ray`` backend, or a pod of
the ``kubernetes`` backend) serves a fixed set of env names; a client opens *sessions*, each one env
instance, and drives it with numbered calls. JSON only, never pickle. Version ``1``.

Endpoints::

    GET    /healthz                          {"status": "ok", "version": 1, "envs": [...], "sessions": N}
    GET    /metrics                          Prometheus text (calls by op and status, latency, sessions)
    POST   /describe   {env, kwargs, overrides}                 {tag, max_steps, max_new_tokens, instructions}
    POST   /sessions   {session_id, env, kwargs, overrides, seed}  {session_id, tag, max_steps, ...}
    POST   /sessions/{id}/reset  {seq, seed, timeout_s}         {seq, observation, info}
    POST   /sessions/{id}/step   {seq, action, timeout_s}       {seq, observation, reward, terminated, truncated, info}
    DELETE /sessions/{id}                    {"closed": true|false}

* ``env`` is one of the names the server serves (``/healthz`` lists them): a registry name
  (``reverse``) or ``MODULE:CLASS``, or the alias given with ``alias=MODULE:CLASS``; a server never
  imports a module a request names. ``kwargs`` go to the env's constructor, ``overrides`` replace its
  ``tag`` / ``max_steps`` / ``max_new_tokens`` (as a config's ``envs:`` entry does); ``seed`` is the
  default reset seed of the session.
* Opening is idempotent: the *client* picks ``session_id`` (``[A-Za-z0-9_-]{8,64}``, a uuid4 hex); a
  repeated open of an existing id with the same env and kwargs answers the same session.
* **Exactly-once calls.** Reset and step share one sequence per session: the first call has
  ``seq = 1`` and every call carries the next number. The server applies ``seq == last + 1``; a
  repeat of ``seq == last`` is answered from the stored answer (if that call is still running, the
  repeat waits for it) and never applied again; any other ``seq`` is ``409 seq_conflict``. A client
  that got no answer (connection dropped, its own timeout) resends the *same* ``seq`` and so never
  applies a step twice; a client that got an answer (success or an error) moves on to ``seq + 1``.
* ``timeout_s`` bounds the env call on the server (capped by the server's ``max_call_timeout_s``). A
  call past it answers ``504 env_timeout``, and the session is then *gone* (its env may still be
  busy with the call, its state unknown; the code sandboxes it started are killed): later calls
  answer ``410``.
* Access: a server with a token (``--token-env``, or a token per tenant with ``--tenants``) answers
  every endpoint but ``/healthz`` with ``401`` without it (``Authorization: Bearer <token>``), from
  the headers alone; a session belongs to the tenant that opened it, and is ``404`` to the others. A
  body over the server's ``max_body_bytes`` is ``413``, a request not sent within its
  ``read_timeout_s`` ``408``. These are :class:`EnvServiceRequestError` on the client (a 408 is
  retried like a connection error).
* Limits per tenant: sessions open or opening (``tenant_max_sessions``: ``429 too_many_sessions``),
  kwargs (``max_kwargs_bytes`` of JSON, the env's ``kwarg_limits``: ``422``); building an env (an
  open, a ``/describe``) past ``call_timeout_s`` is ``504 env_timeout``.

Errors are ``{"error": KIND, "detail": TEXT}``:

=====  ====================  ================================================  ===========================
code   ``error``             meaning                                           client raises
=====  ====================  ================================================  ===========================
404    ``session_not_found`` the server never had it (e.g. it was restarted)  :class:`EnvSessionLost`
410    ``session_gone``      closed, expired (idle past ``session_ttl_s``),   :class:`EnvSessionLost`
                             or ended by a timeout
409    ``seq_conflict``      a ``seq`` other than ``last`` or ``last + 1``     :class:`EnvProtocolError`
422    ``bad_request``       unknown env, kwargs that do not fit, bad body      :class:`EnvServiceRequestError`
429    ``too_many_sessions`` ``max_sessions`` open (``Retry-After``)           retried, then lost
500    ``env_error``         the env raised (the call counts as applied)       :class:`~rollart.envs.EnvError`
504    ``env_timeout``       the env call took longer than ``timeout_s``       :class:`~rollart.envs.EnvTimeout`
=====  ====================  ================================================  ===========================

Connection errors, client-side timeouts, 429 and any other 5xx (a proxy's 502/503) are retried by
the client with the same ``seq``, with exponential backoff and jitter
(:class:`rollart.cluster.serverless.RetryPolicy`); when the retries run out the session is treated as
lost (:class:`EnvServiceUnavailable`, an :class:`EnvSessionLost`). Every error the client raises is an
:class:`~rollart.envs.EnvError`, so the EnvManager turns it into a ``failed`` trajectory (its round is
played again with the same seed) — never a reward.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart.envs.base import EnvError

PROTOCOL_VERSION = 1
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")

ErrorKind = Literal[
    "session_not_found",
    "session_gone",
    "seq_conflict",
    "bad_request",
    "too_many_sessions",
    "env_error",
    "env_timeout",
]


class EnvServiceError(EnvError):
    """A call of the env session protocol failed; ``url`` names the server, ``session_id`` the session."""

    def __init__(self, message: str, *, url: str = "", session_id: str | None = None, status: int | None = None):
        self.url, self.session_id, self.status = url, session_id, status
        where = f"{url} session {session_id}" if session_id else url
        super().__init__(f"{where}: {message}" if where else message)


class EnvSessionLost(EnvServiceError):
    """The session no longer exists on its server (404/410), or its server cannot be reached any more:
    the episode cannot go on. Open a new session (a reset does) or fail the trajectory."""


class EnvServiceUnavailable(EnvSessionLost):
    """The server did not answer (connection errors, 5xx, 429) after every retry."""


class EnvProtocolError(EnvServiceError):
    """The server and the client disagree on the call sequence (409): a client bug, not retried."""


class EnvServiceRequestError(EnvServiceError):
    """The server refused the request (422): an env it does not serve, kwargs that do not fit."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EnvOverrides(_Body):
    """The config's overrides of the env's own ``tag``, ``max_steps`` and ``max_new_tokens``."""

    tag: str | None = None
    max_steps: int | None = Field(default=None, ge=1)
    max_new_tokens: int | None = Field(default=None, ge=1)


class DescribeRequest(_Body):
    env: str = Field(min_length=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    overrides: EnvOverrides = Field(default_factory=EnvOverrides)


class EnvDescription(BaseModel):
    """What an EnvManager reads from an env before its first reset."""

    tag: str
    max_steps: int
    max_new_tokens: int
    instructions: str = ""


class OpenRequest(_Body):
    session_id: str = Field(pattern=SESSION_ID.pattern)
    env: str = Field(min_length=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    overrides: EnvOverrides = Field(default_factory=EnvOverrides)
    seed: int | None = None


class OpenResponse(EnvDescription):
    session_id: str


class ResetRequest(_Body):
    seq: int = Field(ge=1)
    seed: int | None = None
    timeout_s: float | None = Field(default=None, gt=0)


class ResetResponse(BaseModel):
    seq: int
    observation: str
    info: dict[str, Any] = Field(default_factory=dict)


class StepRequest(_Body):
    seq: int = Field(ge=1)
    action: str
    timeout_s: float | None = Field(default=None, gt=0)


class StepResponse(BaseModel):
    seq: int
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    error: ErrorKind
    detail: str
