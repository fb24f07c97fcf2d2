"""The autopilot's decision logic: the size an elastic rollout pool should have, from the job's own steps.

Each training step gives one :class:`Demand`: how long the step took, how much of it the trainer waited
for rollout, whether generation was held back (the sample buffer at its bound, or the staleness bound
stalling generation), the pool's size and whether another job queues for its devices. The
:class:`Autopilot` turns a stream of them into targets (:class:`Decision`), without clocks, so the same
trace always gives the same decisions:

- **Grow** when the trainer waited for rollout more than ``grow_above`` of the step over a whole window
  of ``window`` steps. In an asynchronous job the trainer waits ``G(n) - T`` where ``G(n)`` is the time
  ``n`` devices take to generate a batch and ``T`` the training time; with ``G`` inversely proportional to
  ``n``, ``n · step / (step - wait)`` devices cover the wait (means over the window), rounded up to whole
  workers unless within a tenth of one.
- **Shrink** by one worker when, over a whole window, the trainer waited less than ``shrink_below`` of
  the step and generation was held back at every step (rollout outpaces training).
- **Hysteresis**: ``shrink_below < grow_above``, and a size seen to be rollout-bound is never shrunk back
  to; the size that was enough (held back) is never grown past. Together they bound the target's
  changes over a steady phase to the few steps that find the size.
- **Cool-down**: after a change the next ``cooldown_steps`` steps are not measured (workers join or
  drain, the measurements are of the old size), then a whole window is needed again.
- **Yield**: while a job queues for the pool's devices the target is ``min_devices``, at once (the pool
  asks :meth:`Autopilot.on_queue` at every poll, not only after a step); once the queue is empty the
  target goes back to what it was.
- **Manual**: a target set by a person (``rollart scale``) holds until released, also while a job queues;
  the autopilot decides again from there.

:class:`~rollart.rollout.elastic.ElasticRollout` runs it for a pool with ``elastic.autoscale``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Reason = Literal["grow", "shrink", "yield", "return", "manual", "release"]


class AutopilotSettings(BaseModel):
    """The knobs of the decision logic (see the module doc)."""

    model_config = ConfigDict(extra="forbid")

    min_devices: int = Field(ge=1)
    """The pool never goes below this (and yields down to it when another job queues)."""
    max_devices: int = Field(ge=1)
    """The pool never goes above this."""
    unit: int = Field(default=1, ge=1)
    """Devices of one worker: targets are whole workers."""
    grow_above: float = Field(default=0.2, gt=0, lt=1)
    """Grow when the trainer's rollout wait is above this share of the step over a whole window."""
    shrink_below: float = Field(default=0.05, ge=0, lt=1)
    """Shrink when the wait is below this share and generation was held back over a whole window."""
    window: int = Field(default=3, ge=1)
    """Steps of evidence a decision needs."""
    cooldown_steps: int = Field(default=2, ge=0)
    """Steps not measured after a change (the pool is joining or draining)."""

    @model_validator(mode="after")
    def _consistent(self) -> AutopilotSettings:
        if self.min_devices > self.max_devices:
            raise ValueError(f"min_devices ({self.min_devices}) is above max_devices ({self.max_devices})")
        if self.shrink_below >= self.grow_above:
            raise ValueError(
                f"shrink_below ({self.shrink_below}) must be below grow_above ({self.grow_above}): "
                "the gap between them keeps the pool from oscillating"
            )
        return self


@dataclass(frozen=True)
class Demand:
    """One training step's measurements."""

    step: int
    step_s: float
    rollout_wait_s: float
    held_back: bool
    """Generation was held back during the step: the sample buffer at its bound, or the staleness bound."""
    devices: int
    """The pool's devices during the step."""
    queued: int = 0
    """Jobs queued for devices of this pool's kind."""

    @property
    def wait_share(self) -> float:
        return self.rollout_wait_s / self.step_s if self.step_s > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    """A new target, why, and the measurements that made it."""

    step: int
    target: int
    previous: int
    reason: Reason
    measurements: dict[str, Any] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        """The decision as a line of ``elastic.jsonl`` / a step record's entry."""
        return asdict(self)


class Autopilot:
    """Targets for one elastic pool from a stream of :class:`Demand` (see the module doc)."""

    def __init__(self, settings: AutopilotSettings, target: int | None = None) -> None:
        self.settings = settings
        self.target = self._clamp(target if target is not None else settings.min_devices)
        self._window: deque[Demand] = deque(maxlen=settings.window)
        self._skip = 0  # steps left in the cool-down
        self._short = 0  # the largest size seen rollout-bound: never shrunk back to
        self._enough = settings.max_devices  # the smallest size seen held back: never grown past
        self._manual: int | None = None
        self._before_yield: int | None = None

    # ------------------------------------------------------------------ inputs
    def observe(self, d: Demand) -> Decision | None:
        """Take one step's measurements; a :class:`Decision` when the target changes, else None."""
        s = self.settings
        if self._manual is not None:  # a person's target holds, also against a queued job
            return None
        queue = self.on_queue(d.queued, d.step)
        if queue is not None or d.queued > 0:
            return queue
        if self._skip > 0:
            self._skip -= 1
            return None
        if d.devices != self.target:  # the pool has not reached its target yet: not its measurements
            return None
        self._window.append(d)
        if len(self._window) < s.window:
            return None
        shares = [x.wait_share for x in self._window]
        evidence = {
            "wait_share": [round(x, 4) for x in shares],
            "held_back": [x.held_back for x in self._window],
            "devices": d.devices,
        }
        if min(shares) > s.grow_above:
            self._short = max(self._short, d.devices)
            mean_step = sum(x.step_s for x in self._window) / len(self._window)
            mean_wait = sum(x.rollout_wait_s for x in self._window) / len(self._window)
            want = d.devices * mean_step / max(mean_step - mean_wait, 1e-9)
            # whole workers, rounded up unless within a tenth of one (the measurements' jitter)
            target = min(self._clamp(s.unit * math.ceil(want / s.unit - 0.1)), max(self._enough, d.devices))
            if target > self.target:
                return self._change(d.step, target, "grow", **evidence)
        elif max(shares) < s.shrink_below and all(x.held_back for x in self._window):
            self._enough = min(self._enough, d.devices)
            target = self._clamp(d.devices - s.unit)
            if target < self.target and target > self._short:
                return self._change(d.step, target, "shrink", **evidence)
        return None

    def on_queue(self, queued: int, step: int) -> Decision | None:
        """The jobs queued for the pool's devices now (the elastic pool asks at every poll, so a queued job
        need not wait for a training step): yield while any queue, return once none does."""
        if self._manual is not None:
            return None
        if queued > 0:
            if self._before_yield is None and self.target > self.settings.min_devices:
                self._before_yield = self.target
                return self._change(step, self.settings.min_devices, "yield", queued=queued)
            return None
        if self._before_yield is not None:
            back, self._before_yield = self._before_yield, None
            if back != self.target:
                return self._change(step, back, "return")
        return None

    def manual(self, target: int | None, step: int = 0) -> Decision | None:
        """A person's target (held until ``manual(None)`` releases it); None releases."""
        if target is None:
            if self._manual is None:
                return None
            self._manual = None
            self._window.clear()
            return Decision(step, self.target, self.target, "release")
        self._manual = self._clamp(target)
        previous, self.target = self.target, self._manual
        self._window.clear()
        self._short, self._enough = 0, self.settings.max_devices  # a person's size: learn again from there
        return Decision(step, self.target, previous, "manual")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "window": [asdict(x) for x in self._window],
            "skip": self._skip,
            "short": self._short,
            "enough": self._enough,
            "manual": self._manual,
            "before_yield": self._before_yield,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.target = int(state["target"])
        self._window = deque((Demand(**x) for x in state["window"]), maxlen=self.settings.window)
        self._skip = int(state["skip"])
        self._short = int(state["short"])
        self._enough = int(state["enough"])
        self._manual = state["manual"]
        self._before_yield = state["before_yield"]

    # ------------------------------------------------------------------ helpers
    def _clamp(self, devices: int) -> int:
        return max(self.settings.min_devices, min(self.settings.max_devices, devices))

    def _change(self, step: int, target: int, reason: Reason, **measurements: Any) -> Decision:
        previous, self.target = self.target, target
        self._window.clear()
        self._skip = self.settings.cooldown_steps
        return Decision(step, target, previous, reason, measurements)


__all__ = ["Autopilot", "AutopilotSettings", "Decision", "Demand"]
