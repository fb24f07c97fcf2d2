"""A slow task for the multi-task tests: reverse, with a delay before every step (async, so slow
episodes overlap instead of queueing for worker threads)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from rollart.envs.base import StepResult
from rollart.envs.reverse import ReverseTask


class SlowReverse(ReverseTask):
    def __init__(self, length: int = 3, step_delay_s: float = 0.5):
        super().__init__(length)  # its tag: tag_for below (ReverseTask's __init__ asks it)
        self.step_delay_s = step_delay_s

    @classmethod
    def tag_for(cls, kwargs: Mapping[str, Any]) -> str:
        return f"slow-reverse-{kwargs['length']}"

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        await asyncio.sleep(self.step_delay_s)
        return super().step(action)
