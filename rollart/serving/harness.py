"""Agent harnesses in processes of their own (``serving.harness_processes``), off the driver's event loop.

An ``agent`` env's harness runs its episodes with the ``openai`` client, whose request building and
response parsing cost more CPU per call than the endpoint itself (2-4 ms on a 2-core machine). In the
driver's event loop that bounds a job to a few hundred agent calls per second whatever else it is
given. :class:`HarnessPool` runs the episodes in ``n`` processes (:mod:`rollart.serving.harness_process`),
each with its own event loop: the driver sends an episode (the harness's ``MODULE:FUNCTION``, the task,
its session's URL and the job's token) and gets back what the agent returned or how it failed, with the
frames of the user's code (for :class:`~rollart.rollout.failures.FailureLog`). The harness must be
importable by its name (it is, as an ``envs[i].agent`` entry); its module is imported once per process.

A process that dies is started again; the episodes it was playing fail with the reason ("the harness
process went away") and their rounds are played again, as for any agent that fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart.serving.children import Starts, reap, spawn

log = logging.getLogger(__name__)


class RemoteAgentError(Exception):
    """An agent's exception in a harness process: its class's name, its message and the frames of the
    user's code it went through (innermost last)."""

    def __init__(self, type_name: str, message: str, frames: list[traceback.FrameSummary]):
        super().__init__(message)
        self.type_name = type_name
        self.user_frames = frames


@dataclass
class Returned:
    """What an agent returned that is not a number or None, by its ``repr`` (it does not cross processes)."""

    text: str

    def __repr__(self) -> str:
        return self.text


@dataclass
class _Worker:
    index: int
    popen: asyncio.subprocess.Process
    connection: Any
    playing: dict[int, asyncio.Future[Any]] = field(default_factory=dict)


class HarnessPool:
    """``n`` harness processes; :meth:`play` runs one episode on the least busy one."""

    def __init__(self, n: int, search_path: list[str] | tuple[str, ...] = ()):
        self.n = n
        self.search_path = [str(p) for p in search_path]
        self.workers: dict[int, _Worker] = {}
        self._eids = itertools.count()
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._hello: dict[int, asyncio.Future[Any]] = {}
        self._stopping = False
        self.starts = Starts()  # how many times each process has started

    async def start(self) -> None:
        from rollart.serving.bridge import FrameProtocol

        self._folder = tempfile.TemporaryDirectory(prefix="rollart-harness-")
        path = str(Path(self._folder.name) / "harness.sock")

        def connection() -> FrameProtocol:
            holder: dict[str, Any] = {}
            protocol = FrameProtocol(lambda m: self._message(holder, m), lambda: self._lost(holder))
            holder["protocol"] = protocol
            return protocol

        self._server = await asyncio.get_running_loop().create_unix_server(connection, path)
        self._path = path
        await asyncio.gather(*(self._start_worker(i) for i in range(self.n)))
        log.info("agent harnesses in %d process(es) (serving.harness_processes)", self.n)

    async def _start_worker(self, index: int) -> None:
        hello: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._hello[index] = hello
        spec = {"index": index, "socket": self._path, "sys_path": [*self.search_path, *sys.path]}
        spec["log_level"] = logging.getLogger("rollart").getEffectiveLevel()
        popen = await spawn("rollart.serving.harness_process", spec, hello, f"harness process {index}")
        self.workers[index] = _Worker(index, popen, hello.result())
        await self.starts.record(index)

    # ------------------------------------------------------------------ messages
    def _message(self, holder: dict[str, Any], message: tuple[Any, ...]) -> None:
        op = message[0]
        if op == "hello":
            holder["index"] = message[1]
            future = self._hello.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(holder["protocol"])
        elif op == "done":
            _, eid, result = message
            worker = self.workers.get(holder.get("index", -1))
            future = worker.playing.pop(eid, None) if worker is not None else None
            if future is not None and not future.done():
                future.set_result(result)

    def _lost(self, holder: dict[str, Any]) -> None:
        worker = self.workers.get(holder.get("index", -1))
        if worker is None or worker.connection is not holder["protocol"]:
            return
        for future in worker.playing.values():
            if not future.done():
                future.set_exception(ConnectionError("the harness process playing the episode went away"))
        worker.playing.clear()
        if not self._stopping:
            asyncio.get_running_loop().create_task(self._restart(worker))

    async def _restart(self, worker: _Worker) -> None:
        code = await worker.popen.wait()
        log.error(
            "harness process %d (pid %d) went away (exit code %s); starting it again",
            worker.index,
            worker.popen.pid,
            code,
        )
        try:
            await self._start_worker(worker.index)
        except Exception as err:
            log.error("harness process %d could not start again: %s", worker.index, err)
            self.workers.pop(worker.index, None)

    # ------------------------------------------------------------------ episodes
    async def play(
        self, agent: str, task: dict[str, Any], base_url: str, token: str, client: dict[str, Any]
    ) -> tuple[Any, str | None, BaseException | None]:
        """One episode of ``agent`` on ``task`` through the session at ``base_url``: what the agent
        returned, and its error (a message and an exception with the user's frames) when it failed.
        Cancelling it cancels the agent in its process."""
        live = [w for w in self.workers.values() if w.connection.transport is not None]
        if not live:
            raise RuntimeError("no harness process is running (serving.harness_processes); see the log for why")
        worker = min(live, key=lambda w: (len(w.playing), w.index))
        eid = next(self._eids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        worker.playing[eid] = future
        worker.connection.send(("play", eid, agent, task, base_url, token, client))
        try:
            result = await future
        except asyncio.CancelledError:
            worker.playing.pop(eid, None)
            worker.connection.send(("cancel", eid))
            raise
        except ConnectionError as err:
            return None, str(err), None
        kind = result[0]
        if kind == "returned":
            return result[1], None, None
        _, type_name, message, frames = result
        summaries = [traceback.FrameSummary(f, n, name, line=line) for f, n, name, line in frames]
        return None, f"agent: {type_name}: {message}", RemoteAgentError(type_name, message, summaries)

    async def stop(self) -> None:
        self._stopping = True
        for worker in list(self.workers.values()):
            worker.connection.send(("stop",))
        for worker in list(self.workers.values()):
            await reap(worker.popen)
        self.workers.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def pids(self) -> list[int]:
        return [w.popen.pid for w in self.workers.values()]
