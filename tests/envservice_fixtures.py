"""Envs for the env-service tests (served by name ``envservice_fixtures:CLASS``) and a TCP proxy that
drops the answer of a call after the server applied it."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

from rollart.envs import TextEnv


class CountingEnv(TextEnv):
    """Two steps; every applied step is counted per instance (``steps``) and in ``APPLIED`` by ``key``."""

    tag = "counting"
    max_steps = 2
    max_new_tokens = 4
    APPLIED: Counter[str] = Counter()

    def __init__(self, key: str = "default"):
        self.key, self.t = key, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.t = 0
        return f"start {seed}:", {"seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.t += 1
        CountingEnv.APPLIED[self.key] += 1
        return f"obs{self.t}:", 1.0, self.t >= 2, False, {"t": self.t}


class SlowEnv(CountingEnv):
    """Its calls block on ``GATE`` (a threading.Event, per key) while ``slow_reset`` / ``slow_step``
    say so: a fail-slow env. ``release`` frees every blocked call."""

    tag = "slow"
    GATES: dict[str, threading.Event] = {}
    SLOW: dict[str, set[str]] = {}

    def _wait(self, op: str) -> None:
        if op in SlowEnv.SLOW.get(self.key, set()):
            SlowEnv.SLOW[self.key].discard(op)  # slow once
            SlowEnv.GATES.setdefault(self.key, threading.Event()).wait(30)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._wait("reset")
        return super().reset(seed)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._wait("step")
        return super().step(action)


class DropProxy:
    """A TCP proxy to ``upstream`` (host, port) on 127.0.0.1. After :meth:`arm`, the next request
    whose first bytes contain ``marker`` reaches the server, and the server's answer is read and thrown
    away: the client's connection is closed with no answer (the call was applied, the answer lost)."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.marker: bytes | None = None
        self.dropped = 0
        self.server: asyncio.AbstractServer | None = None

    def arm(self, marker: bytes) -> None:
        self.marker = marker

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        state = {"drop": False}

        async def to_server() -> None:
            while data := await reader.read(65536):
                if self.marker is not None and self.marker in data:
                    self.marker, state["drop"] = None, True
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if state["drop"]:  # the server answered: the call was applied; the client never hears it
                    self.dropped += 1
                    writer.transport.abort()
                    up_writer.close()
                    return
                writer.write(data)
                await writer.drain()
            writer.close()

        tasks = [asyncio.ensure_future(to_server()), asyncio.ensure_future(to_client())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        writer.transport.abort()
        up_writer.close()


from rollart.envs.reverse import ReverseTask  # noqa: E402


class DyingReverseEnv(ReverseTask):
    """``reverse``, except that the first step (over every server) that finds ``kill_file`` takes it
    and kills its own server process: an env server that dies mid-episode, after a reset."""

    def __init__(self, length: int = 3, kill_file: str = "", format_credit: float = 0.0):
        super().__init__(length=length, format_credit=format_credit)
        self.kill_file = kill_file

    def step(self, action: str) -> Any:
        if self.kill_file:
            import os
            import signal

            try:
                os.rename(self.kill_file, self.kill_file + ".taken")  # atomic: one server takes it
            except FileNotFoundError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


class SlowOpenEnv(CountingEnv):
    """Its constructor blocks until ``GATE`` is set: sessions that take a while to open (``BUILT``
    counts the constructors that started)."""

    tag = "slow_open"
    GATE = threading.Event()
    BUILT: Counter[str] = Counter()

    def __init__(self, key: str = "default"):
        SlowOpenEnv.BUILT[key] += 1
        SlowOpenEnv.GATE.wait(60)
        super().__init__(key)


class GatedResetEnv(CountingEnv):
    """Its resets block until ``GATE`` opens (a runaway env call); ``RUNNING`` counts the resets in a
    thread right now, ``STARTED`` every reset that began."""

    tag = "gated_reset"
    GATE = threading.Event()
    LOCK = threading.Lock()
    RUNNING = 0
    STARTED = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        with GatedResetEnv.LOCK:
            GatedResetEnv.RUNNING += 1
            GatedResetEnv.STARTED += 1
        try:
            GatedResetEnv.GATE.wait(120)
        finally:
            with GatedResetEnv.LOCK:
                GatedResetEnv.RUNNING -= 1
        return super().reset(seed)
