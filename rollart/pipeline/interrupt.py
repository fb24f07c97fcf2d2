"""Ctrl-C (and ``rollart stop``, which sends SIGINT) for a running pipeline.

The run handles SIGINT itself, also where SIGINT was ignored when the process started (a shell's
background command; a submitted job whose Ray was started from one): Python and ``asyncio.run`` then
leave it ignored, and ``rollart stop`` could not end the run. The first SIGINT cancels the step in
progress, and the step loop stops at its next step boundary at the latest (:meth:`Interrupt.check`): a
cancellation that lands where a library swallows it (Python 3.11's ``asyncio.wait_for`` does when its
inner future completes at the same moment) cannot keep the run going.
The run's own ``finally`` blocks still run (the ledger, the trackers); :meth:`Interrupt.run` then raises
``KeyboardInterrupt``, as ``asyncio.run`` does. A second SIGINT raises ``KeyboardInterrupt`` at once.

With ``on_first`` (the pipeline's choice, made on the event loop when the first SIGINT comes), the first
SIGINT may instead let the step in progress finish (:attr:`Interrupt.finishing`): the step loop then
writes a checkpoint at the step boundary and stops there (:meth:`Interrupt.check`), so a resumed run
redoes nothing. A SIGINT while it finishes cancels the step as a first one would have; one more raises
``KeyboardInterrupt`` at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["CHEAP_STOP_S", "Interrupt", "StopChoice"]


class Interrupt:
    """Whether SIGINT asked the run to stop; runs the pipeline's coroutine with its own SIGINT handler.
    ``on_first()`` (called on the event loop at the first SIGINT): True lets the step in progress finish
    (:attr:`finishing`) instead of cancelling it."""

    def __init__(self, on_first: Callable[[], bool] | None = None) -> None:
        self.requested = False
        self.finishing = False  # the first SIGINT let the step in progress finish; the loop stops after it
        self.on_first = on_first

    def check(self) -> None:
        """At a step boundary: stop the run (``CancelledError``) once SIGINT asked for it."""
        if self.requested:
            raise asyncio.CancelledError("interrupted (SIGINT)")

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """``main`` to its end on a new event loop. In a program's main thread whose SIGINT handler is
        Python's default, SIGINT stops it as the module says; so it does where SIGINT was ignored when the
        process started (a shell starts background commands so, and Ray's processes pass that on to a
        submitted job): SIGINT is how ``rollart stop`` ends a run. Elsewhere (an embedding program that
        handles SIGINT itself, a thread) it runs as ``asyncio.run`` would."""
        if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, signal.SIG_IGN)
        ):
            return asyncio.run(main)
        with asyncio.Runner() as runner:
            loop = runner.get_loop()
            task = loop.create_task(main)

            def first() -> None:  # on the loop: the pipeline chooses between finishing the step and cancelling it
                try:
                    self.finishing = bool(self.on_first and self.on_first())
                except Exception:  # the choice failed: stop as without one
                    self.finishing = False
                if not self.finishing:
                    task.cancel()

            def on_sigint(signum: int, frame: FrameType | None) -> None:
                if not self.requested:
                    self.requested = True
                    loop.call_soon_threadsafe(first)
                elif self.finishing:  # Ctrl-C again while the step finishes: cancel it now
                    self.finishing = False
                    loop.call_soon_threadsafe(task.cancel)
                else:  # a second (or third) Ctrl-C: now
                    raise KeyboardInterrupt

            previous = signal.signal(signal.SIGINT, on_sigint)
            try:
                return loop.run_until_complete(task)
            except asyncio.CancelledError:
                if self.requested:
                    raise KeyboardInterrupt from None
                raise
            finally:
                signal.signal(signal.SIGINT, previous)


CHEAP_STOP_S = 30.0
"""The first Ctrl-C finishes the step in progress and writes a checkpoint when both together are expected
to take at most this long; else it stops at once."""
SAVE_BYTES_PER_S = 200e6
"""Before a run's first checkpoint its cost is estimated from the model's files: three times their size
(the weights and the optimizer's two moments) at this rate."""


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def model_bytes(path: str | os.PathLike[str]) -> int | None:
    """The size of the weight files of a local model folder; None when ``path`` is not one."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    files = [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    return sum(p.stat().st_size for p in files) or None


class StopChoice:
    """What the first Ctrl-C does: finish the step in progress and write a checkpoint when that is cheap
    (:data:`CHEAP_STOP_S`), so the resumed run redoes nothing, else stop at once and say why. The costs
    come from the run: the last steps' times and the last checkpoint's (before the first one, an
    estimate from the model's size, :data:`SAVE_BYTES_PER_S`)."""

    def __init__(self, model_path: str | os.PathLike[str] | None = None, budget_s: float = CHEAP_STOP_S):
        self.budget_s = budget_s
        self.step_s: deque[float] = deque(maxlen=5)
        self.save_s: float | None = None
        size = model_bytes(model_path) if model_path is not None else None
        self.estimated_save_s = None if size is None else 3 * size / SAVE_BYTES_PER_S

    def step_done(self, seconds: float) -> None:
        self.step_s.append(seconds)

    def saved(self, seconds: float) -> None:
        self.save_s = seconds

    def decide(self, step: int, unsaved: int, last_checkpoint: str | None) -> tuple[bool, str]:
        """(finish the step, the line to tell the user) for a Ctrl-C in step ``step`` (counted from 1),
        with ``unsaved`` steps done since ``last_checkpoint`` (None: since the start)."""
        where = f"from {last_checkpoint}" if last_checkpoint else "from the start (no checkpoint yet)"
        redo = f"the run continues {where}: {unsaved + 1} step(s) done again"
        if not self.step_s:
            return (
                False,
                f"Ctrl-C: stopping now, without a checkpoint (no step has finished yet to tell its cost); {redo}",
            )
        step_s = sum(self.step_s) / len(self.step_s)
        save_s = self.save_s if self.save_s is not None else self.estimated_save_s
        if save_s is None:
            return False, (
                f"Ctrl-C: stopping now, without a checkpoint (its cost is unknown until the run writes one: "
                f"checkpoint_every); {redo}"
            )
        cost = step_s + save_s
        if cost > self.budget_s:
            return False, (
                f"Ctrl-C: stopping now, without a checkpoint: finishing step {step} (about {_duration(step_s)}) and "
                f"writing one (about {_duration(save_s)}) would take longer than {_duration(self.budget_s)}; {redo}"
            )
        return True, (
            f"Ctrl-C: finishing step {step} (about {_duration(step_s)}) and writing a checkpoint (about "
            f"{_duration(save_s)}), so that --resume redoes nothing; press Ctrl-C again to stop at once"
        )
