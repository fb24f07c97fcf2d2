"""Ctrl-C (and ``rollart stop``, which sends SIGINT) for a running pipeline.

The run handles SIGINT itself, also where SIGINT was ignored when the process started (a shell's
background command; a submitted job whose Ray was started from one): Python and ``asyncio.run`` then
leave it ignored, and ``rollart stop`` could not end the run. The first SIGINT cancels the step in
progress, and the step loop stops at its next step boundary at the latest (:meth:`Interrupt.check`): a
cancellation that lands where a library swallows it (Python 3.11's ``asyncio.wait_for`` does when its
inner future completes at the same moment) cannot keep the run going.
The run's own ``finally`` blocks still run (the ledger, the trackers); :meth:`Interrupt.run` then raises
``KeyboardInterrupt``, as ``asyncio.run`` does. A second SIGINT raises ``KeyboardInterrupt`` at once.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Interrupt"]


class Interrupt:
    """Whether SIGINT asked the run to stop; runs the pipeline's coroutine with its own SIGINT handler."""

    def __init__(self) -> None:
        self.requested = False

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

            def on_sigint(signum: int, frame: FrameType | None) -> None:
                if self.requested:  # a second Ctrl-C: now
                    raise KeyboardInterrupt
                self.requested = True
                loop.call_soon_threadsafe(task.cancel)

            previous = signal.signal(signal.SIGINT, on_sigint)
            try:
                return loop.run_until_complete(task)
            except asyncio.CancelledError:
                if self.requested:
                    raise KeyboardInterrupt from None
                raise
            finally:
                signal.signal(signal.SIGINT, previous)
