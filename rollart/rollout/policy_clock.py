"""The run's policy versions, owned in one place.

``trained`` is the newest version the trainer produced (one per training step; a resumed run or a restored
trainer starts again from its checkpoint's); ``served`` is the newest version every inference worker
serves (the rollout tags its requests with it and bounds how far generation runs ahead by it). The
pipeline advances ``trained``; the LLMProxy advances ``served`` when its workers have a version, and the
rollout scheduler when it moves to one (a weight path without a transfer). Everything else reads them:
neither has a setter, and only the methods below change them."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class PolicyClock:
    """The trained and the served policy version of one run."""

    __slots__ = ("_served", "_trained")

    def __init__(self, trained: int = 0, served: int = 0):
        self._trained = trained
        self._served = served

    @property
    def trained(self) -> int:
        """The newest version the trainer produced."""
        return self._trained

    @property
    def served(self) -> int:
        """The newest version every inference worker serves."""
        return self._served

    def step_trained(self) -> int:
        """The trainer finished a step: its weights are the next version, returned."""
        self._trained += 1
        return self._trained

    def restored(self, version: int) -> None:
        """The trainer's weights were loaded from a checkpoint written at ``version`` (a resumed run)."""
        self._trained = int(version)

    def after_restart(self) -> int:
        """A restored trainer's weights go out as a version newer than any trained or served before (the
        workers only move forward); returned."""
        self._trained = max(self._trained, self._served) + 1
        return self._trained

    def serve(self, version: int) -> None:
        """Every inference worker serves ``version`` now."""
        if version < self._served:
            log.debug("served version %d after %d", version, self._served)
        self._served = int(version)

    def __repr__(self) -> str:
        return f"PolicyClock(trained={self._trained}, served={self._served})"
