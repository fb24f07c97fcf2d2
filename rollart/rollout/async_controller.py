"""AsyncController: the rollout–train synchronisation protocol (RollArt paper §5.3, Figure 8; ROLL Flash §4).

Per training step the pipeline calls ``get_batch`` (blocking until ``batch_groups`` groups within the
bound are in), trains, then ``suspend`` → ``model_update`` → ``resume``. Rollout keeps running while
the trainer trains; only the weight swap pauses it. With ``alpha = 0`` generation of the next batch
starts only after the new weights are in (synchronous training); with ``alpha = k`` it may run up to
``k`` versions ahead, and every trajectory trained at version ``v`` began at a version ``>= v - k``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.sample_buffer import Group
from rollart.rollout.scheduler import RolloutScheduler
from rollart.weights.base import WeightChannel

log = logging.getLogger(__name__)
T = TypeVar("T")


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

    async def serve_weights(self, weights: Any, version: int) -> None:
        """Before the rollout starts (a resumed or restored run): every worker serves ``weights`` (a state dict
        or its ObjectRef) as ``version``. The scheduler moves with the pipeline's ``resume_at``, not here."""
        await self.proxy.model_update(weights, version)

    async def serve_weights_from(self, channel: WeightChannel, version: int) -> None:
        """Before the rollout starts: every worker fetches ``version`` from ``channel`` itself."""
        await self.proxy.model_update_from(channel, version)

    async def serve_weights_in_process(self, load: Callable[[], Awaitable[T]], version: int) -> T:
        """Before the rollout starts, colocated mode: every worker serves ``version`` from weights in its own
        process, started by ``load()``. Returns what it answers."""
        return await self.proxy.model_update_in_process(load, version)

    async def advance(self, version: int) -> None:
        """No weights move (``weights.channel: none``): the rollout goes on under ``version``."""
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

    async def swap_in_process(self, load: Callable[[], Awaitable[T]], version: int) -> T:
        """Colocated mode: the workers (suspended, their engines asleep) serve ``version`` from weights in their
        own process, started by ``load()``; then the rollout resumes under it. Timed as ``weight_sync_s``."""
        t0 = time.monotonic()
        out = await self.proxy.model_update_in_process(load, version)
        await self.scheduler.set_version(version)
        await self.resume()
        self.timings["weight_sync_s"] = time.monotonic() - t0
        return out

    async def stop(self) -> None:
        await self.scheduler.stop()


class NewestVersionLoader:
    """Serves the newest offered weight version in the background, one load at a time.

    ``offer(v)`` returns at once; a loop runs ``load(v)`` (e.g. every worker fetches ``v`` from a weight
    channel) for the newest version offered, and again for whatever is newest when that load ends, so a
    version offered while another loads is skipped once a newer one is offered (two in flight at most:
    the one loading and the newest waiting). Versions are loaded in increasing order only. A load that
    fails while a newer version waits is logged and the newer one is loaded; a failure of the newest
    ends the loop and is raised by the next ``offer`` or ``wait``.
    """

    def __init__(self, load: Callable[[int], Awaitable[Any]], served: int = 0, keep: int = 1000):
        self._load = load
        self.served = served  # the newest version loaded
        self.wanted = served  # the newest version offered
        # the last ``keep`` versions offered and loaded (bounded: one of each per step of a long run)
        self._offered: deque[int] = deque(maxlen=keep)
        self._loaded: deque[int] = deque(maxlen=keep)
        self.loads = 0  # versions loaded in all
        self._task: asyncio.Task | None = None

    @property
    def offered(self) -> list[int]:
        """The last ``keep`` versions offered, in order."""
        return list(self._offered)

    @property
    def loaded(self) -> list[int]:
        """The last ``keep`` versions loaded, in order; a skipped version is absent."""
        return list(self._loaded)

    @property
    def skipped(self) -> list[int]:
        """Of :attr:`offered`, the versions passed over for a newer one (every loaded version at or
        above the oldest of them is among the last ``keep`` loaded: loaded ones are a subset)."""
        loaded = set(self._loaded)
        return [v for v in self._offered if v <= self.served and v not in loaded]

    def offer(self, version: int) -> None:
        if self._task is not None and self._task.done():
            task, self._task = self._task, None
            task.result()  # a failed loop raises here
        if version <= self.wanted:
            return
        self._offered.append(version)
        self.wanted = version
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.served < self.wanted:
            version = self.wanted
            try:
                await self._load(version)
            except Exception as err:
                if self.wanted <= version:
                    raise
                log.warning("weights version %d not loaded (%r); loading version %d", version, err, self.wanted)
                continue
            self.served = version
            self._loaded.append(version)
            self.loads += 1

    async def wait(self) -> None:
        """Until the newest offered version is loaded; raises the loop's failure."""
        task, self._task = self._task, None
        if task is not None:
            await task

    async def cancel(self) -> None:
        """Stop loading (a failed run); a load in progress is cancelled."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
