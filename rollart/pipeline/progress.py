"""The run's one progress display, on stderr.

On a terminal it is a bar (``quickstart: 42%|████▏     | 252/600 [01:02<01:26, reward=0.612, v=252]``);
anywhere else (a pipe, a file, a CI log) one line per tenth of the run, so that the output of a whole
run fits on a screen:

    quickstart: step 60/600 (10%), reward 0.105, v 60; 14 s so far, about 2 min 6 s to go

The legend is logged once when the steps start (:data:`LEGEND`): ``reward`` is the step's mean reward
(over its batch), ``v`` the policy version the step's weight sync published (one per trained step).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

log = logging.getLogger(__name__)

LEGEND = (
    "reward = the step's mean reward over its batch; v = the policy version after the step (one per trained "
    "step, published to the inference workers by its weight sync)"
)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    minutes, s = divmod(seconds, 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


class StepProgress:
    """Steps ``initial..total`` of run ``name``: :meth:`update` after each step, :meth:`close` at the end.
    ``interactive`` (default: whether ``stream`` is a terminal) picks the bar or the lines."""

    def __init__(
        self, name: str, total: int, initial: int = 0, *, stream: TextIO | None = None, interactive: bool | None = None
    ):
        self.name, self.total, self.initial = name, total, initial
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.every = max(1, (total - initial) // 10)
        self.done = initial
        self.started = time.monotonic()
        log.info("%s: steps %d to %d; %s", name, initial + 1, total, LEGEND)
        self.bar: Any = None
        if self.interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=name, unit="step", file=self.stream)

    def update(self, record: dict[str, Any]) -> None:
        """One more step done, with its record (``reward_mean``, ``version``)."""
        self.done += 1
        reward, version = record.get("reward_mean"), record.get("version")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{reward:.3f}" if reward is not None else "n/a", v=version)
            return
        ran = self.done - self.initial
        if ran % self.every and self.done != self.total:
            return
        elapsed = time.monotonic() - self.started
        left = elapsed / ran * (self.total - self.done)
        reward_text = "n/a" if reward is None else f"{reward:.3f}"
        eta = f"about {_duration(left)} to go" if self.done < self.total else "done"
        self.stream.write(
            f"{self.name}: step {self.done}/{self.total} ({100 * self.done // self.total}%), reward {reward_text}, "
            f"v {version}; {_duration(elapsed)} so far, {eta}\n"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
