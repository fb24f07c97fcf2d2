"""The serving package's child processes (endpoint server processes, agent harness processes).

The parent side: :func:`spawn` starts ``python -m MODULE`` with its spec pickled on standard input and
waits until the child says hello (or exits, or takes too long); :func:`reap` waits for a child to end and
kills it past a timeout; :class:`Starts` counts the starts of each child (restarts included) and lets a
caller wait for one. The child side: :func:`child_runner` puts the parent's import paths and log level in
place and gives the event loop to run on (uvloop when installed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import sys
from typing import Any

START_TIMEOUT_S = 120.0


def child_environment(drop: str | None = None) -> dict[str, str]:
    """A child's environment: the parent's (one torch thread unless set), without the variable ``drop``."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if drop:
        env.pop(drop, None)
    return env


async def spawn(
    module: str, spec: Any, hello: asyncio.Future[Any], what: str, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    """``python -m module`` given ``spec`` on standard input, once ``hello`` (set by whoever hears the
    child's hello) is done; a child that exits first, takes longer than :data:`START_TIMEOUT_S` or whose
    hello is an error is killed and raises, naming ``what``."""
    popen = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, stdin=asyncio.subprocess.PIPE, env=env or child_environment()
    )
    assert popen.stdin is not None
    popen.stdin.write(pickle.dumps(spec))
    await popen.stdin.drain()
    popen.stdin.close()
    exited: asyncio.Future[Any] = asyncio.ensure_future(popen.wait())
    waits: set[asyncio.Future[Any]] = {hello, exited}
    done, _ = await asyncio.wait(waits, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    exited.cancel()
    failed = hello.exception() if hello in done else None
    if hello not in done or failed is not None:
        hello.cancel()
        if popen.returncode is None:
            popen.kill()
            await popen.wait()
        if failed is not None:
            raise failed
        why = "did not start in time" if not done else f"exited with code {popen.returncode}"
        raise RuntimeError(f"{what} {why}; its log lines above say why")
    return popen


async def reap(popen: asyncio.subprocess.Process, timeout_s: float = 15.0) -> None:
    """Wait for ``popen`` to end; kill it past ``timeout_s``."""
    try:
        await asyncio.wait_for(popen.wait(), timeout_s)
    except TimeoutError:
        popen.kill()
        await popen.wait()


class Starts:
    """How many times each child has started (a restart after it went away counts), awaitable."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._changed: asyncio.Condition | None = None

    def __getitem__(self, index: int) -> int:
        return self.counts.get(index, 0)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made in the event loop it is used in
            self._changed = asyncio.Condition()
        return self._changed

    async def record(self, index: int) -> None:
        self.counts[index] = self[index] + 1
        async with self._condition():
            self._condition().notify_all()

    async def wait(self, index: int | None, times: int, timeout_s: float = 120.0) -> None:
        """Until child ``index`` (None: all of them together) has started ``times`` times."""

        def reached() -> bool:
            return (self.total if index is None else self[index]) >= times

        async with self._condition():
            await asyncio.wait_for(self._condition().wait_for(reached), timeout_s)


def child_runner(sys_path: list[str], log_level: int, label: str) -> asyncio.Runner:
    """In a child: the parent's import paths first, its log level (lines marked ``label``), and the runner
    of the child's event loop (uvloop when installed)."""
    for path in reversed(sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    logging.basicConfig(level=log_level, format=f"%(asctime)s {label} %(name)s: %(message)s")
    try:
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        return asyncio.Runner()
