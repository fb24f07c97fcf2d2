"""One endpoint server process: the OpenAI-compatible app with its sessions, off the driver's event loop.

Started by :class:`rollart.serving.processes.EndpointProcesses` as ``python -m
rollart.serving.server_process`` with its :class:`ProcessSpec` pickled on standard input. It binds its
port, connects to the driver's Unix socket (:class:`rollart.serving.bridge.BackendHost`), says hello
with its port, and serves: HTTP, rendering, tokenising, streaming and the sessions' token-exact
records run here; each generation goes to the LLMProxy in the driver. The driver opens and closes
sessions over the same connection (a closed session comes back whole, its calls and reward). The
process ends when the driver says ``stop`` or its connection closes (the driver went away).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import sys
from dataclasses import dataclass
from typing import Any

from rollart.engines.base import SamplingParams
from rollart.serving.config import ServingConfig

log = logging.getLogger(__name__)


@dataclass
class ProcessSpec:
    """What one endpoint process is given: the service's settings, its share of the limits, where to
    reach the driver."""

    index: int
    socket_path: str
    tokenizer: Any
    config: ServingConfig  # its port, max_sessions, max_concurrency and max_connections are this process's
    model: str
    sampling: SamplingParams | None
    max_context: int | None
    default_tag: str
    token: str
    version: int
    sys_path: list[str]
    log_level: int


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ServerProcess:
    """The app, its sessions and the connection to the driver, in this process's event loop."""

    def __init__(self, spec: ProcessSpec):
        self.spec = spec
        self.stopped = asyncio.Event()
        self.server: Any = None

    async def run(self) -> None:
        from rollart.serving.bridge import FrameProtocol, RemoteBackend

        spec = self.spec
        backend = RemoteBackend(spec.version)
        backend.control = self._control
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_unix_connection(
            lambda: FrameProtocol(backend.on_message, self._lost), spec.socket_path
        )
        backend.connect(protocol)
        self.protocol, self.backend = protocol, backend
        try:
            sock = bind(spec.config.host, spec.config.port)
            self._build(backend, sock.getsockname()[1])
        except Exception as err:  # a port in use, a template that does not load: said to the driver
            protocol.send(("hello", spec.index, None, f"endpoint process {spec.index}: {type(err).__name__}: {err}"))
            return
        serving = loop.create_task(self.server.serve(sockets=[sock]))
        protocol.send(("hello", spec.index, sock.getsockname()[1], None))
        await self.stopped.wait()
        self.server.should_exit = True
        try:
            await asyncio.wait_for(serving, 10)
        except TimeoutError:
            serving.cancel()
        sock.close()

    def _build(self, backend: Any, port: int) -> None:
        import uvicorn

        from rollart.reward.http_server import ConnectionLimits, GuardedConfig
        from rollart.serving.endpoint import PolicyEndpoint, build_service

        spec = self.spec
        service = build_service(
            backend,
            spec.tokenizer,
            spec.config,
            model=spec.model,
            sampling=spec.sampling,
            max_context=spec.max_context,
            version_fn=lambda: backend.clock.served,
            default_tag=spec.default_tag,
            quiet=spec.index > 0,  # one warning of a missing chat template, not one per process
        )
        config = spec.config.model_copy(update={"port": port})
        self.endpoint = PolicyEndpoint(service, config, token=spec.token)
        limits = ConnectionLimits(max_connections=config.max_connections, read_timeout_s=config.read_timeout_s)
        cfg = GuardedConfig(
            self.endpoint.app(), limits=limits, lifespan="off", timeout_keep_alive=30, proxy_headers=False
        )  # clients: the peer, not a header
        self.server = uvicorn.Server(cfg)
        self.server.install_signal_handlers = lambda: None

    def _control(self, message: tuple[Any, ...]) -> None:
        asyncio.get_running_loop().create_task(self._answer(message))

    async def _answer(self, message: tuple[Any, ...]) -> None:
        op, cid, *args = message
        try:
            if op == "open":
                tag, meta = args
                value: Any = self.endpoint.sessions.open(tag, meta=meta).id
            elif op == "close":
                sid, why = args
                session = self.endpoint.sessions.get(sid)
                if session is not None:
                    await self.endpoint.close_session(session, why)
                value = session
            elif op == "stop":
                for session in list(self.endpoint.sessions._sessions.values()):
                    await self.endpoint.close_session(session, "the endpoint stopped")
                value = None
                self.stopped.set()
            else:
                raise ValueError(f"unknown control call {op!r}")
        except Exception as err:
            self.protocol.send(("fail", cid, (type(err).__name__, str(err))))
            return
        self.protocol.send(("ok", cid, value))

    def _lost(self) -> None:
        self.backend.lost()
        self.stopped.set()


def main() -> None:
    from rollart.serving.children import child_runner

    spec: ProcessSpec = pickle.load(sys.stdin.buffer)
    runner = child_runner(spec.sys_path, spec.log_level, f"endpoint[{spec.index}]")
    with runner:
        runner.run(ServerProcess(spec).run())


if __name__ == "__main__":
    main()
