"""The endpoint in server processes of its own (``serving.processes``), beside the LLMProxy in the driver.

:class:`EndpointProcesses` starts ``serving.processes`` endpoint processes
(:mod:`rollart.serving.server_process`), each with its own port, its share of the sessions and limits,
and one connection to the driver's :class:`~rollart.serving.bridge.BackendHost`, which serves their
generations from the LLMProxy. The driver's event loop then does per agent call what a direct
``LLMProxy.generate`` does plus one message in and one out; the HTTP server, the request's parsing and
rendering, tokenising, streaming and the session's token-exact record cost the endpoint processes.
Capacity grows with the processes given to it.

It has :class:`~rollart.serving.endpoint.PolicyEndpoint`'s driver interface (``start``, ``stop``,
``open_session``, ``close_session``, ``session_url``, ``token``): a session opened here lives in one
process (the one with the fewest open sessions), its URL is that process's, and closing it brings the
whole :class:`~rollart.serving.sessions.Session` back (its calls, reward and the errors its calls met).
A process that dies is started again on the same port; the sessions it held end with it (their
episodes fail and are played again, as for any agent that fails).
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart.engines.base import SamplingParams
from rollart.serving.children import Starts, child_environment, reap, spawn
from rollart.serving.config import ServingConfig
from rollart.serving.endpoint import base_url, job_token, listens_publicly
from rollart.serving.sessions import Session

log = logging.getLogger(__name__)


@dataclass
class SessionHandle:
    """A session opened in an endpoint process: its id, tag and the process holding it."""

    id: str
    tag: str
    process: int
    meta: dict[str, Any] = field(default_factory=dict)
    closing: asyncio.Future[Session | None] | None = None


@dataclass
class _Process:
    index: int
    popen: asyncio.subprocess.Process
    port: int
    connection: Any
    sessions: int = 0


class EndpointProcesses:
    """The endpoint of one job served by ``config.processes`` processes; generations go to ``backend``."""

    def __init__(
        self,
        backend: Any,
        tokenizer: Any,
        config: ServingConfig,
        *,
        model: str,
        sampling: SamplingParams | None = None,
        max_context: int | None = None,
        version_fn: Callable[[], int] = lambda: 0,
        default_tag: str = "agent",
        token: str | None = None,
    ):
        from rollart.serving.bridge import BackendHost

        self.config = config
        self.token = token if token is not None else job_token(config)
        self.host = BackendHost(backend, version_fn, window_s=config.batch_window_s)
        self.version_fn = version_fn
        self._spec = {
            "tokenizer": tokenizer,
            "model": model,
            "sampling": sampling,
            "max_context": max_context,
            "default_tag": default_tag,
        }
        self.processes: dict[int, _Process] = {}
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._socket_path = ""
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None
        self.starts = Starts()  # how many times each process has started

    # ------------------------------------------------------------------ addresses
    @property
    def url(self) -> str:
        """The first process's base URL (sessionless calls; each session has its process's URL)."""
        return base_url(self.config.host, self._port(0))

    @property
    def public_url(self) -> str:
        return base_url(self.config.advertise_host or self.config.host, self._port(0), public=True)

    @property
    def listens_publicly(self) -> bool:
        return listens_publicly(self.config.host)

    def urls(self) -> list[str]:
        """Every process's base URL, in process order."""
        return [base_url(self.config.host, p.port) for _, p in sorted(self.processes.items())]

    def _port(self, index: int) -> int:
        return self.processes[index].port if index in self.processes else self.config.port

    def session_url(self, session: Any, *, public: bool = False) -> str:
        host = (self.config.advertise_host or self.config.host) if public else self.config.host
        return f"{base_url(host, self._port(session.process), public=public)}/sessions/{session.id}/v1"

    # ------------------------------------------------------------------ sessions
    async def open_session(self, tag: str, *, meta: dict[str, Any] | None = None) -> SessionHandle:
        """A session on the process with the fewest open ones (429-like ``OverflowError`` when all are full)."""
        live = [p for p in self.processes.values() if p.connection.protocol.transport is not None]
        if not live:
            raise RuntimeError("no endpoint process is running (serving.processes); see the log for why it ended")
        process = min(live, key=lambda p: (p.sessions, p.index))
        sid = await process.connection.call("open", tag, dict(meta or {}))
        process.sessions += 1
        return SessionHandle(sid, tag, process.index, dict(meta or {}))

    async def close_session(self, session: SessionHandle, why: str) -> Session | None:
        """End ``session`` (its calls in flight are aborted): the session as its process recorded it, or
        None when its process went away with it."""
        if session.closing is None:
            session.closing = asyncio.get_running_loop().create_task(self._close(session, why))
        return await asyncio.shield(session.closing)

    async def _close(self, session: SessionHandle, why: str) -> Session | None:
        process = self.processes.get(session.process)
        if process is None:
            return None
        process.sessions = max(0, process.sessions - 1)
        try:
            closed: Session | None = await process.connection.call("close", session.id, why)
        except (ConnectionError, TimeoutError) as err:
            log.warning("session %s: its endpoint process %d did not answer (%s)", session.id, session.process, err)
            return None
        return closed

    # ------------------------------------------------------------------ processes
    async def start(self) -> str:
        """Start the processes and wait until each serves; returns :attr:`url`."""
        self._folder = tempfile.TemporaryDirectory(prefix="rollart-endpoint-")
        self._socket_path = str(Path(self._folder.name) / "backend.sock")
        await self.host.start(self._socket_path)
        try:
            await asyncio.gather(*(self._start_process(i) for i in range(self.config.processes)))
        except BaseException:
            await self.stop()
            raise
        self._watch = asyncio.get_running_loop().create_task(self._supervise())
        log.info(
            "policy endpoint %r in %d process(es) on %s (sessions under /sessions/{id}/v1)",
            self._spec["model"],
            len(self.processes),
            ", ".join(self.urls()),
        )
        return self.url

    def _process_config(self, index: int) -> ServingConfig:
        n, cfg = self.config.processes, self.config
        old = self.processes.get(index)
        port = old.port if old is not None else (cfg.port + index if cfg.port else 0)
        return cfg.model_copy(
            update={
                "port": port,
                "max_sessions": math.ceil(cfg.max_sessions / n),
                "max_concurrency": math.ceil(cfg.max_concurrency / n),
                "max_connections": math.ceil(cfg.max_connections / n),
            }
        )

    async def _start_process(self, index: int) -> None:
        from rollart.serving.server_process import ProcessSpec

        spec = ProcessSpec(
            index=index,
            socket_path=self._socket_path,
            config=self._process_config(index),
            token=self.token,
            version=self.version_fn(),
            sys_path=list(sys.path),
            log_level=logging.getLogger("rollart").getEffectiveLevel(),
            **self._spec,
        )
        hello = self.host.expect(index)
        env = child_environment(drop=self.config.token_env)  # the token travels in the spec, not the environment
        popen = await spawn("rollart.serving.server_process", spec, hello, f"endpoint process {index}", env)
        connection = hello.result()
        assert connection.port is not None
        self.processes[index] = _Process(index, popen, connection.port, connection)
        await self.starts.record(index)

    async def _supervise(self) -> None:
        """Start again a process that went away (on its port); its sessions ended with it."""
        while not self._stopping:
            gone = [p.connection.closed for p in self.processes.values()]
            await asyncio.wait(gone, return_when=asyncio.FIRST_COMPLETED)
            for index, process in list(self.processes.items()):
                if self._stopping or not process.connection.closed.done():
                    continue
                code = process.popen.returncode
                log.error(
                    "endpoint process %d (pid %d) went away (exit code %s) with %d open session(s); starting it again",
                    index,
                    process.popen.pid,
                    code,
                    process.sessions,
                )
                process.sessions = 0
                try:
                    await self._start_process(index)
                except Exception as err:
                    log.error("endpoint process %d could not start again: %s", index, err)
                    del self.processes[index]
            if not self.processes:
                return

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        for process in list(self.processes.values()):
            try:
                await process.connection.call("stop", timeout_s=15)
            except Exception as err:
                log.debug("endpoint process %d did not stop when asked: %s", process.index, err)
        for process in list(self.processes.values()):
            await reap(process.popen)
        self.processes.clear()
        await self.host.stop()
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def pids(self) -> list[int]:
        """The processes' ids (to measure their CPU)."""
        return [p.popen.pid for p in self.processes.values()]
