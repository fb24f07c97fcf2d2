"""Fault injection for benchmarks and tests: latency (:class:`LatencyEnv`) and failures
(:class:`FailingEnv`) wrapped around any env (ROLL Flash §5.2.2: fail-slow and fail-stop environments).

Both wrappers come in two flavours chosen at construction: *sync* (``reset``/``step`` are plain
methods, run by the EnvManager in a worker thread) and *async* (coroutine methods, so thousands of
envs share one event loop). A wrapper is async when the wrapped env is async or, for
:class:`LatencyEnv`, when ``clock.sleep`` is a coroutine function.

Latency goes through a pluggable clock (anything with ``sleep(seconds)``, sync or async), so a
time-scaled simulation (:class:`ScaledClock`) or a virtual clock that only counts
(:class:`VirtualClock`) runs as fast as needed.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from rollart.envs.base import EnvError, EnvTimeout, StepResult

Latency = Callable[[], float]


def _no_latency() -> float:
    return 0.0


def is_async_env(env: Any) -> bool:
    """True when ``env.reset`` and ``env.step`` are coroutine functions."""
    return inspect.iscoroutinefunction(env.reset) and inspect.iscoroutinefunction(env.step)


class RealClock:
    """Blocking wall-clock sleep."""

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class ScaledClock:
    """Async sleep of ``seconds * scale`` real seconds (simulated seconds → real seconds)."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"ScaledClock: scale must be > 0, got {scale!r}")
        self.scale = scale

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds * self.scale)


class VirtualClock:
    """Sleeps nothing: ``now`` advances by each requested duration (thread-safe)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"now": self.now, "calls": self.calls}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.now += max(0.0, seconds)
            self.calls += 1


class _Wrapper:
    """Forwards attributes (``tag``, ``max_steps``, ``max_new_tokens``, ``instructions``, ...) to ``env``."""

    def __init__(self, env: Any):
        self.env = env

    def __getattr__(self, name: str) -> Any:
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    def close(self) -> None:
        self.env.close()


class LatencyEnv(_Wrapper):
    """Wait ``reset_latency()`` (resp. ``step_latency()``) seconds on ``clock`` before each reset (step)
    of ``env``; negative draws count as 0. ``total_latency`` sums what was waited. Async when ``env`` is
    async or ``clock.sleep`` is a coroutine function (then ``LatencyEnv(...)`` is an :class:`AsyncLatencyEnv`)."""

    def __new__(cls, env: Any = None, *args: Any, clock: Any = None, **kwargs: Any) -> LatencyEnv:
        if (
            cls is LatencyEnv
            and env is not None
            and (is_async_env(env) or inspect.iscoroutinefunction(getattr(clock, "sleep", None)))
        ):
            cls = AsyncLatencyEnv
        return super().__new__(cls)

    def __init__(
        self, env: Any, reset_latency: Latency = _no_latency, step_latency: Latency = _no_latency, clock: Any = None
    ):
        super().__init__(env)
        self.reset_latency, self.step_latency = reset_latency, step_latency
        self.clock = clock if clock is not None else RealClock()
        self.total_latency = 0.0
        if is_async_env(env) and not inspect.iscoroutinefunction(self.clock.sleep):
            raise ValueError(
                "LatencyEnv: an async env needs a clock with an async sleep (e.g. ScaledClock); "
                "a blocking sleep would stall the event loop"
            )

    def _draw(self, fn: Latency) -> float:
        seconds = max(0.0, float(fn()))
        self.total_latency += seconds
        return seconds

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.clock.sleep(self._draw(self.reset_latency))
        return self.env.reset(seed)

    def step(self, action: str) -> StepResult:
        self.clock.sleep(self._draw(self.step_latency))
        return self.env.step(action)


class AsyncLatencyEnv(LatencyEnv):
    """:class:`LatencyEnv` with coroutine ``reset``/``step``."""

    async def _sleep(self, seconds: float) -> None:
        if inspect.iscoroutinefunction(self.clock.sleep):
            await self.clock.sleep(seconds)
        else:
            self.clock.sleep(seconds)

    async def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:  # type: ignore[override]
        await self._sleep(self._draw(self.reset_latency))
        out = self.env.reset(seed)
        return await out if inspect.isawaitable(out) else out

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        await self._sleep(self._draw(self.step_latency))
        out = self.env.step(action)
        return await out if inspect.isawaitable(out) else out


class FailingEnv(_Wrapper):
    """Each reset fails with probability ``fail_prob_reset`` and each step with ``fail_prob_step``
    (draws from ``random.Random(seed)``). A failure raises :class:`EnvError` (fail-fast) or, with
    ``hang=True``, blocks (fail-stop) until :meth:`release` or ``close`` is called or ``hang_timeout_s``
    passes, then raises :class:`EnvTimeout`. ``failures`` counts injected faults. Async when ``env`` is
    (then ``FailingEnv(...)`` is an :class:`AsyncFailingEnv`)."""

    def __new__(cls, env: Any = None, *args: Any, **kwargs: Any) -> FailingEnv:
        if cls is FailingEnv and env is not None and is_async_env(env):
            cls = AsyncFailingEnv
        return super().__new__(cls)

    def __init__(
        self,
        env: Any,
        fail_prob_reset: float = 0.0,
        fail_prob_step: float = 0.0,
        hang: bool = False,
        *,
        hang_timeout_s: float | None = None,
        seed: int = 0,
    ):
        super().__init__(env)
        for name, p in (("fail_prob_reset", fail_prob_reset), ("fail_prob_step", fail_prob_step)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"FailingEnv: {name} must be in [0, 1], got {p!r}")
        self.fail_prob_reset, self.fail_prob_step = fail_prob_reset, fail_prob_step
        self.hang, self.hang_timeout_s = hang, hang_timeout_s
        self.rng = random.Random(seed)
        self.failures = 0
        self.hung = 0  # calls hanging right now
        self._released = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (e.g. shipped to a Ray actor) without its hang state: nothing hangs in a copy."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_released", "_waiters", "hung")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _released=threading.Event(), _waiters=[], hung=0)

    def release(self) -> None:
        """End every hanging call (each raises :class:`EnvTimeout`); later faults hang again.
        Safe to call from any thread."""
        self._released.set()
        for loop, event in list(self._waiters):
            loop.call_soon_threadsafe(event.set)

    def close(self) -> None:
        self.release()
        super().close()

    def _should_fail(self, p: float) -> bool:
        if p > 0 and self.rng.random() < p:
            self.failures += 1
            return True
        return False

    def _fail(self, what: str) -> None:
        if not self.hang:
            raise EnvError(f"injected {what} failure")
        self._released.clear()
        self.hung += 1
        try:
            self._released.wait(self.hang_timeout_s)
        finally:
            self.hung -= 1
        raise EnvTimeout(f"injected {what} hang ended")

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if self._should_fail(self.fail_prob_reset):
            self._fail("reset")
        return self.env.reset(seed)

    def step(self, action: str) -> StepResult:
        if self._should_fail(self.fail_prob_step):
            self._fail("step")
        return self.env.step(action)


class AsyncFailingEnv(FailingEnv):
    """:class:`FailingEnv` around an async env; a hang is an await, so cancelling the call ends it too."""

    async def _afail(self, what: str) -> None:
        if not self.hang:
            raise EnvError(f"injected {what} failure")
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        waiter = (loop, event)
        self._waiters.append(waiter)
        self.hung += 1
        try:
            await asyncio.wait_for(event.wait(), self.hang_timeout_s)
        except TimeoutError:
            pass
        finally:
            self.hung -= 1
            self._waiters.remove(waiter)
        raise EnvTimeout(f"injected {what} hang ended")

    async def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:  # type: ignore[override]
        if self._should_fail(self.fail_prob_reset):
            await self._afail("reset")
        return await self.env.reset(seed)

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        if self._should_fail(self.fail_prob_step):
            await self._afail("step")
        return await self.env.step(action)
