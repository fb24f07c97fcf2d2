"""The compact path between the endpoint's server processes and the LLMProxy in the driver.

One Unix socket in the driver (:class:`BackendHost`); each endpoint process
(:mod:`rollart.serving.server_process`) holds one connection to it and sees the LLMProxy as a
:class:`RemoteBackend` (the :class:`~rollart.serving.service.Backend` protocol: ``generate``,
``generate_stream``, ``abort``). Messages are length-prefixed pickles of tuples; the driver does only
what a direct ``LLMProxy.generate`` call does plus one read and one write per call, while HTTP,
rendering, tokenising, session recording and the answer's JSON run in the server processes.

Process → driver: ``("hello", index, port, error)``, ``("gen" | "stream", rid, request, tag,
affinity)``, ``("cancel", rid)``, ``("abort", request_ids)``, ``("ok" | "fail", cid, value)`` (the
answer to a control call). Driver → process: ``("out", rid, output, version)``, ``("delta", rid,
delta)``, ``("err", rid, kind, type_name, message)``, ``("version", version)``, ``(op, cid, *args)``
(a control call: ``open``, ``close``, ``stop``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import pickle
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollart.cluster.errors import ClusterError
from rollart.rollout.policy_clock import PolicyClock
from rollart.rollout.types import GenerateDelta, GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30
VERSION_POLL_S = 0.5  # how often the host looks whether the served version moved without a call


def frame(message: tuple[Any, ...]) -> bytes:
    """``message`` as one frame: its pickle's length, then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


class RemoteError(RuntimeError):
    """An error raised in the driver, seen in an endpoint process: ``type_name`` is the original's class."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


def error_message(rid: int, err: BaseException) -> tuple[Any, ...]:
    """``err`` as a message any process can read (a class the other side may not import is named, not
    pickled): a cluster error stays one (the endpoint answers 503 for it)."""
    cause = getattr(err, "cause", None)
    root = cause if isinstance(cause, BaseException) else err
    kind = "cluster" if isinstance(err, ClusterError) else "other"
    return ("err", rid, kind, type(root).__name__, str(root))


def raised(kind: str, type_name: str, message: str) -> BaseException:
    return ClusterError(message) if kind == "cluster" else RemoteError(type_name, message)


class FrameProtocol(asyncio.Protocol):
    """Frames in and out of one stream connection; ``on_message`` gets each message as it arrives."""

    def __init__(self, on_message: Callable[[tuple[Any, ...]], None], on_lost: Callable[[], None]):
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0
        while len(buf) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buf, start)
            if size > MAX_FRAME:
                log.error("a frame of %d bytes on the endpoint's internal socket: closing it", size)
                assert self.transport is not None
                self.transport.close()
                return
            end = start + _HEADER.size + size
            if len(buf) < end:
                break
            message = pickle.loads(memoryview(buf)[start + _HEADER.size : end])
            start = end
            self.on_message(message)
        del buf[:start]

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue ``message``; what is queued in one turn of the event loop goes out in one write (so the
        driver reads the calls that arrived together at once, and the LLMProxy batches them)."""
        if self.transport is None or self.transport.is_closing():
            return
        self._out.append(frame(message))
        if len(self._out) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.on_lost()


# ---------------------------------------------------------------------- driver side
class _Connection:
    """One endpoint process's connection to the host: its calls in flight and its control calls."""

    def __init__(self, host: BackendHost):
        self.host = host
        self.index: int | None = None
        self.port: int | None = None
        self.protocol = FrameProtocol(self._message, self._lost)
        self.tasks: dict[int, tuple[asyncio.Task[None], str]] = {}  # rid -> (its task, its request id)
        self.calls: dict[int, asyncio.Future[Any]] = {}
        self._cids = itertools.count()
        self.closed = asyncio.get_running_loop().create_future()

    def _message(self, message: tuple[Any, ...]) -> None:
        op = message[0]
        if op == "gen" or op == "stream":
            self.host.dispatch(functools.partial(self._start, message))
        elif op == "cancel":
            entry = self.tasks.get(message[1])
            if entry is not None:
                entry[0].cancel()
                asyncio.get_running_loop().create_task(self.host.backend.abort([entry[1]]))
        elif op == "abort":
            asyncio.get_running_loop().create_task(self.host.backend.abort(list(message[1])))
        elif op == "ok" or op == "fail":
            future = self.calls.pop(message[1], None)
            if future is not None and not future.done():
                if op == "ok":
                    future.set_result(message[2])
                else:  # a full session store is the caller's to handle, as in the driver's own endpoint
                    type_name, text = message[2]
                    future.set_exception(
                        OverflowError(text) if type_name == "OverflowError" else RemoteError(type_name, text)
                    )
        elif op == "hello":
            _, self.index, self.port, error = message
            self.host._hello(self, error)
        else:
            log.error("unknown message %r from an endpoint process", op)

    def _start(self, message: tuple[Any, ...]) -> None:
        op, rid, request, tag, affinity = message
        if self.protocol.transport is None:  # the process went away while the call waited for its turn
            return
        run = self._generate if op == "gen" else self._stream
        task = asyncio.get_running_loop().create_task(run(rid, request, tag, affinity))
        self.tasks[rid] = (task, request.request_id)
        task.add_done_callback(functools.partial(self._done, rid))

    def _done(self, rid: int, _task: asyncio.Task[None]) -> None:
        self.tasks.pop(rid, None)

    async def _generate(self, rid: int, request: GenerateRequest, tag: str, affinity: str | None) -> None:
        try:
            out = await self.host.backend.generate(request, tag, affinity=affinity)
        except asyncio.CancelledError:
            return
        except Exception as err:
            self.protocol.send(error_message(rid, err))
            return
        self.protocol.send(("out", rid, out, self.host.version_fn()))

    async def _stream(self, rid: int, request: GenerateRequest, tag: str, affinity: str | None) -> None:
        try:
            async for item in self.host.backend.generate_stream(request, tag, affinity=affinity):
                if isinstance(item, GenerateOutput):
                    self.protocol.send(("out", rid, item, self.host.version_fn()))
                else:
                    self.protocol.send(("delta", rid, item))
        except asyncio.CancelledError:
            return
        except Exception as err:
            self.protocol.send(error_message(rid, err))

    def _lost(self) -> None:
        """The process went away: its calls in flight are cancelled and their requests aborted."""
        ids = [request_id for _, request_id in self.tasks.values()]
        for task, _ in list(self.tasks.values()):
            task.cancel()
        if ids:
            asyncio.get_running_loop().create_task(self.host.backend.abort(ids))
        for future in self.calls.values():
            if not future.done():
                future.set_exception(ConnectionError(f"endpoint process {self.index} went away"))
        self.calls.clear()
        if not self.closed.done():
            self.closed.set_result(None)
        self.host._gone(self)

    async def call(self, op: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """A control call to the process (``open``, ``close``, ``stop``): its answer."""
        if self.protocol.transport is None:
            raise ConnectionError(f"endpoint process {self.index} is not connected")
        cid = next(self._cids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.calls[cid] = future
        self.protocol.send((op, cid, *args))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self.calls.pop(cid, None)


class BackendHost:
    """The driver's end: a Unix socket the endpoint processes connect to, serving their generations from
    ``backend`` (the LLMProxy's :class:`~rollart.serving.service.ProxyBackend`)."""

    def __init__(self, backend: Any, version_fn: Callable[[], int], window_s: float = 0.02):
        self.backend = backend
        self.version_fn = version_fn
        self.window_s = window_s
        self._ready: list[Callable[[], None]] = []
        self._last_dispatch = 0.0
        self._versions: asyncio.Task[None] | None = None
        self.connections: dict[int, _Connection] = {}
        self._server: asyncio.AbstractServer | None = None
        self._waiting: dict[int, asyncio.Future[_Connection]] = {}

    async def start(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self).protocol, path)
        self._versions = loop.create_task(self._push_versions())

    async def _push_versions(self) -> None:
        """Tell the processes the served version when it moves without a call (``/v1/models``, ``/healthz``;
        every answer to a call carries it too)."""
        last = self.version_fn()
        while True:
            await asyncio.sleep(VERSION_POLL_S)
            version = self.version_fn()
            if version != last:
                last = version
                for conn in list(self.connections.values()):
                    conn.protocol.send(("version", version))

    def dispatch(self, start: Callable[[], None]) -> None:
        """Start a call now when none started in the last ``window_s``, else with the others that arrive
        until then: calls started together reach the LLMProxy in one turn of the loop, which sends them to
        a worker in one Ray call (a few Ray calls carrying many requests cost the driver less than one
        call each). An idle endpoint adds no wait; a busy one at most ``window_s``."""
        self._ready.append(start)
        if len(self._ready) > 1:
            return
        loop = asyncio.get_running_loop()
        wait = self._last_dispatch + self.window_s - loop.time()
        if wait > 0:
            loop.call_later(wait, self._dispatch)
        else:
            loop.call_soon(self._dispatch)

    def _dispatch(self) -> None:
        ready, self._ready = self._ready, []
        self._last_dispatch = asyncio.get_running_loop().time()
        for start in ready:
            start()

    def expect(self, index: int) -> asyncio.Future[_Connection]:
        """The connection of process ``index``, once it has said hello."""
        future: asyncio.Future[_Connection] = asyncio.get_running_loop().create_future()
        self._waiting[index] = future
        return future

    def _hello(self, conn: _Connection, error: str | None) -> None:
        assert conn.index is not None
        future = self._waiting.pop(conn.index, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(RuntimeError(error))
            return
        self.connections[conn.index] = conn
        future.set_result(conn)

    def _gone(self, conn: _Connection) -> None:
        if conn.index is not None and self.connections.get(conn.index) is conn:
            del self.connections[conn.index]

    async def stop(self) -> None:
        if self._versions is not None:
            self._versions.cancel()
            self._versions = None
        if self._server is not None:
            self._server.close()
            self._server = None


# ---------------------------------------------------------------------- process side
class RemoteBackend:
    """The LLMProxy as an endpoint process sees it, over its connection to the driver's
    :class:`BackendHost`. ``clock`` is this process's copy of the run's policy clock: its ``served`` is the
    version the driver last reported (with each answer, and when it moves without a call)."""

    def __init__(self, version: int = 0):
        self.clock = PolicyClock(served=version)
        self.protocol: FrameProtocol | None = None
        self._rids = itertools.count()
        self._pending: dict[int, asyncio.Future[GenerateOutput]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self.control: Callable[[tuple[Any, ...]], None] = lambda message: None

    def connect(self, protocol: FrameProtocol) -> None:
        self.protocol = protocol

    def _send(self, message: tuple[Any, ...]) -> None:
        if self.protocol is None or self.protocol.transport is None:
            raise ClusterError("the endpoint process lost its connection to the driver")
        self.protocol.send(message)

    def on_message(self, message: tuple[Any, ...]) -> None:
        op = message[0]
        if op == "out":
            _, rid, out, version = message
            self.clock.serve(version)
            future = self._pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_result(out)
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(out)
        elif op == "delta":
            queue = self._streams.get(message[1])
            if queue is not None:
                queue.put_nowait(message[2])
        elif op == "version":
            self.clock.serve(message[1])
        elif op == "err":
            _, rid, kind, type_name, text = message
            err = raised(kind, type_name, text)
            future = self._pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_exception(err)
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(err)
        else:
            self.control(message)

    def lost(self) -> None:
        err = ClusterError("the endpoint process lost its connection to the driver")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(err)
        self._pending.clear()
        for queue in self._streams.values():
            queue.put_nowait(err)

    async def generate(self, request: GenerateRequest, tag: str, *, affinity: str | None = None) -> GenerateOutput:
        rid = next(self._rids)
        future: asyncio.Future[GenerateOutput] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            self._send(("gen", rid, request, tag, affinity))
            return await future
        except asyncio.CancelledError:
            if self.protocol is not None:
                self.protocol.send(("cancel", rid))
            raise
        finally:
            self._pending.pop(rid, None)

    async def generate_stream(
        self, request: GenerateRequest, tag: str, *, affinity: str | None = None
    ) -> AsyncIterator[GenerateDelta | GenerateOutput]:
        rid = next(self._rids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[rid] = queue
        finished = False
        try:
            self._send(("stream", rid, request, tag, affinity))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if isinstance(item, GenerateOutput):
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and self.protocol is not None:
                self.protocol.send(("cancel", rid))

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.protocol is not None:
            self.protocol.send(("abort", list(request_ids)))
