"""The endpoint as a server: the service over an LLMProxy, served by uvicorn on the caller's event loop.

:class:`PolicyEndpoint` runs in the pipeline's event loop (the LLMProxy is a coroutine API of that
loop): ``await endpoint.start()`` binds the socket (so the URL is known at once) and serves in a task;
``await endpoint.stop()`` ends it. ``rollart serve policy`` runs the same app under ``uvicorn.run``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any, Protocol

from rollart.engines.base import SamplingParams
from rollart.serving.config import ServingConfig
from rollart.serving.service import Backend, PolicyService
from rollart.serving.sessions import Session, SessionStore

log = logging.getLogger(__name__)


def model_context(model_path: str) -> int | None:
    """The model's context length (``max_position_embeddings``), or None when its config has none."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if value else None


def build_service(
    backend: Backend,
    tokenizer: Any,
    config: ServingConfig,
    *,
    model: str,
    sampling: SamplingParams | None = None,
    max_context: int | None = None,
    version_fn: Callable[[], int] = lambda: 0,
    default_tag: str = "agent",
    quiet: bool = False,
) -> PolicyService:
    """The service of ``config`` over ``backend``; ``quiet``: do not warn of a missing chat template (an
    endpoint process: the driver has warned once)."""
    from rollart.rollout.chat import ChatTemplateError, resolve_template
    from rollart.serving.render import ChatRenderer
    from rollart.serving.tools import tool_parser

    template = resolve_template(tokenizer, config.chat_template)
    try:
        renderer = ChatRenderer(tokenizer, template) if template is not None else None
    except ChatTemplateError as err:
        raise ValueError(f"serving.chat_template: {err}") from None
    if renderer is None and not quiet:
        log.warning(
            "the tokenizer has no chat template: /v1/chat/completions answers 400 (use /v1/completions, or set "
            "serving.chat_template, or tiny_model: {chat: true} for the built-in tiny model)"
        )
    return PolicyService(
        backend,
        tokenizer,
        model=model,
        renderer=renderer,
        tool_parser=tool_parser(config.tool_parser),
        sampling=sampling,
        max_context=max_context,
        max_n=config.max_n,
        max_concurrency=config.max_concurrency,
        default_tag=default_tag,
        version_fn=version_fn,
    )


def job_token(config: ServingConfig) -> str:
    """The bearer token of this job: ``$token_env`` when set, else a fresh random one."""
    if config.token_env:
        value = os.environ.get(config.token_env)
        if not value:
            raise ValueError(f"serving.token_env: ${config.token_env} is not set; export it or drop token_env")
        return value
    return secrets.token_urlsafe(32)


class AgentEndpoint(Protocol):
    """What an agent env manager plays its episodes through: :class:`PolicyEndpoint` (in the driver's
    event loop) or :class:`~rollart.serving.processes.EndpointProcesses` (in server processes)."""

    token: str

    @property
    def listens_publicly(self) -> bool: ...
    def session_url(self, session: Any, *, public: bool = False) -> str: ...
    async def open_session(self, tag: str, *, meta: dict[str, Any] | None = None) -> Any: ...
    async def close_session(self, session: Any, why: str) -> Session | None: ...
    async def start(self) -> str: ...
    async def stop(self) -> None: ...


class PolicyEndpoint:
    """The endpoint of one job, served on the running event loop."""

    def __init__(self, service: PolicyService, config: ServingConfig, *, token: str | None = None):
        self.service = service
        self.config = config
        self.token = token if token is not None else job_token(config)
        self.sessions = SessionStore(config.max_sessions, config.session_ttl_s, config.max_calls)
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._sock: socket.socket | None = None
        self.port = config.port

    @property
    def url(self) -> str:
        """The base of every path, for harnesses that run in the driver."""
        return base_url(self.config.host, self.port)

    @property
    def public_url(self) -> str:
        """The base for harnesses elsewhere (another process, host or pod)."""
        return base_url(self.config.advertise_host or self.config.host, self.port, public=True)

    @property
    def listens_publicly(self) -> bool:
        """Whether it listens on an address other hosts can reach (not only the loopback)."""
        return listens_publicly(self.config.host)

    def session_url(self, session: Session, *, public: bool = False) -> str:
        """The session's base URL: the ``base_url`` of its ``openai`` client."""
        return f"{self.public_url if public else self.url}/sessions/{session.id}/v1"

    async def open_session(self, tag: str, **kwargs: Any) -> Session:
        """A new session (``OverflowError`` when ``max_sessions`` are open)."""
        return self.sessions.open(tag, **kwargs)

    async def close_session(self, session: Session, why: str) -> Session:
        """End ``session`` (its calls in flight are aborted) and forget it; returns it as recorded."""
        self.sessions.close(session.id, why)
        if session.in_flight:
            await self.service.backend.abort(sorted(session.in_flight))
        return session

    def app(self) -> Any:
        from rollart.serving.app import build_app

        return build_app(
            self.service,
            self.sessions,
            token=self.token,
            max_body_bytes=self.config.max_body_bytes,
            read_timeout_s=self.config.read_timeout_s,
            public_url=lambda: self.public_url,
        )

    async def start(self) -> str:
        """Bind and serve in the background of this event loop; returns :attr:`url`."""
        import uvicorn

        from rollart.reward.http_server import ConnectionLimits, GuardedConfig

        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        sock.listen(2048)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        limits = ConnectionLimits(
            max_connections=self.config.max_connections, read_timeout_s=self.config.read_timeout_s
        )
        cfg = GuardedConfig(
            self.app(), limits=limits, lifespan="off", timeout_keep_alive=30, proxy_headers=False
        )  # clients: the peer, not a header
        self._server = uvicorn.Server(cfg)
        self._server.install_signal_handlers = lambda: None  # the driver keeps its own handlers
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        log.info("policy endpoint %r on %s (sessions under /sessions/{id}/v1)", self.service.model, self.url)
        return self.url

    async def stop(self) -> None:
        for session in list(self.sessions._sessions.values()):
            await self.close_session(session, "the endpoint stopped")
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=10)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def listens_publicly(host: str) -> bool:
    """Whether an endpoint on ``host`` is reachable from other hosts (not only on the loopback)."""
    return host not in ("127.0.0.1", "localhost", "::1")


def base_url(host: str, port: int, *, public: bool = False) -> str:
    """``http://host:port``; ``public``: as other hosts reach it (this node's IP for ``0.0.0.0``)."""
    if public and host in ("0.0.0.0", "::"):
        from rollart.resource_manager.net import node_ip

        host = node_ip()
    return f"http://{_url_host(host)}:{port}"


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
