"""AsyncController: the rollout–train synchronisation protocol (seed 004 §5.3, Figure 8; seed 000 §4).

Per training step the pipeline calls ``get_batch`` (blocking until ``batch_groups`` groups within the
bound are in), trains, then ``suspend`` → ``model_update`` → ``resume``. Rollout keeps running while
the trainer trains; only the weight swap pauses it. With ``alpha = 0`` generation of the next batch
starts only after the new weights are in (synchronous training); with ``alpha = k`` it may run up to
``k`` versions ahead, and every trajectory trained at version ``v`` began at a version ``>= v - k``.
"""

from __future__ import annotations

import time
from typing import Any

from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.sample_buffer import Group
from rollart.rollout.scheduler import RolloutScheduler
from rollart.weights.base import WeightChannel


class AsyncController:
    def __init__(self, scheduler: RolloutScheduler, proxy: LLMProxy):
        self.scheduler = scheduler
        self.proxy = proxy
        self.timings: dict[str, float] = {"rollout_wait_s": 0.0, "weight_sync_s": 0.0}

    @property
    def version(self) -> int:
        return self.scheduler.version

    @property
    def alpha(self) -> int:
        return self.scheduler.config.alpha

    def start(self) -> None:
        self.scheduler.start()

    async def get_batch(self, version: int | None = None) -> list[Group]:
        """A batch for the policy ``version`` the trainer is at (default: the served version)."""
        t0 = time.monotonic()
        groups = await self.scheduler.get_batch(version)
        self.timings["rollout_wait_s"] = time.monotonic() - t0
        return groups

    async def suspend(self) -> None:
        await self.proxy.suspend()

    async def resume(self) -> None:
        await self.proxy.resume()

    async def model_update(self, weights: Any, version: int) -> None:
        """Push ``weights`` (a state dict or its ObjectRef) as ``version`` to every inference worker."""
        await self.proxy.model_update(weights, version)
        await self.scheduler.set_version(version)

    async def model_update_from(self, channel: WeightChannel, version: int) -> None:
        """Every inference worker fetches ``version`` from a weight channel (e.g. Mooncake)."""
        await self.proxy.model_update_from(channel, version)
        await self.scheduler.set_version(version)

    async def sync_weights(
        self, weights: Any, version: int, channel: WeightChannel | None = None, *, pause: bool = True
    ) -> None:
        """Make ``version`` the serving policy, timed.

        From weights in hand (a state dict or its ObjectRef) with ``pause``: ``suspend → model_update →
        resume`` — every worker switches at the same moment. Without ``pause``, and always from a weight
        channel (Mooncake, torch.distributed), there is no global pause: every worker gets the snapshot
        while it keeps generating and swaps it in between two of its engine steps (its in-flight requests
        are preempted and continue under the new version, prefix recomputed; each token records the
        version that produced it). The scheduler's version (and the α bound) moves once all have it."""
        t0 = time.monotonic()
        if channel is not None:
            await self.model_update_from(channel, version)
        elif pause:
            await self.suspend()
            await self.model_update(weights, version)
            await self.resume()
        else:
            await self.model_update(weights, version)
        self.timings["weight_sync_s"] = time.monotonic() - t0

    async def stop(self) -> None:
        await self.scheduler.stop()
