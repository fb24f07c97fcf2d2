"""A weight path talks to typed interfaces only: the run's PolicyClock (given at construction) for the served
version, and the rollout as a ``WeightTarget`` (the AsyncController implements it). It never reaches into the
controller's LLMProxy or scheduler. No Ray: a recording target and a stub trainer."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollart.pipeline.weight_sync import ChannelSync, InProcessSync, NoSync, RaySync
from rollart.rollout.async_controller import AsyncController
from rollart.rollout.policy_clock import PolicyClock

ROOT = Path(__file__).resolve().parents[1]


class Target:
    """A WeightTarget that records what a weight path asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def serve_weights(self, weights: Any, version: int) -> None:
        self.calls.append(("serve_weights", weights, version))

    async def serve_weights_from(self, channel: Any, version: int) -> None:
        self.calls.append(("serve_weights_from", channel, version))

    async def serve_weights_in_process(self, load: Any, version: int) -> Any:
        self.calls.append(("serve_weights_in_process", await load(), version))

    async def sync_weights(self, weights: Any, version: int, channel: Any = None, *, pause: bool = True) -> None:
        self.calls.append(("sync_weights", weights, version, channel, pause))

    async def swap_in_process(self, load: Any, version: int) -> Any:
        self.calls.append(("swap_in_process", version))
        return await load()

    async def advance(self, version: int) -> None:
        self.calls.append(("advance", version))

    async def suspend(self) -> None:
        self.calls.append(("suspend",))

    async def resume(self) -> None:
        self.calls.append(("resume",))


class Trainer:
    """The trainer Cluster's calls a weight path makes."""

    async def snapshot_weights(self, bucket_bytes: int, blocking: bool = True) -> str:
        return "ref"

    async def publish_to(self, channel: Any, wait: bool, bucket_bytes: int, blocking: bool = True) -> int:
        return 7

    async def wake_engine(self, version: int, blocking: bool = True) -> list[dict[str, Any]]:
        return [{"woke": version}]

    async def sleep_engine(self) -> None:
        return None


def settings(background: bool | str = False) -> Any:
    weights = SimpleNamespace(bucket_mb=1, background_load=background, pause_rollout=True)
    return SimpleNamespace(weights=weights, rollout=SimpleNamespace(alpha=1))


def test_weight_sync_reaches_no_part_of_the_rollout_but_its_typed_target() -> None:
    source = (ROOT / "rollart/pipeline/weight_sync.py").read_text()
    reached = [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in ("proxy", "scheduler")
    ]
    assert reached == []


def test_the_controller_implements_the_target_a_weight_path_asks_of() -> None:
    from rollart.pipeline.weight_sync import WeightTarget

    members = [n for n, v in vars(WeightTarget).items() if inspect.iscoroutinefunction(v)]
    assert set(members) >= {"serve_weights", "serve_weights_from", "serve_weights_in_process", "advance"}
    for name in members:
        want = inspect.signature(getattr(WeightTarget, name))
        assert list(inspect.signature(getattr(AsyncController, name)).parameters) == list(want.parameters), name
        assert list(inspect.signature(getattr(Target, name)).parameters) == list(want.parameters), name


async def test_each_weight_path_asks_the_target_and_reads_the_served_version_from_the_clock() -> None:
    clock = PolicyClock()
    clock.serve(4)
    trainer = Trainer()
    # none: no weights move, the rollout goes on under the version
    target = Target()
    assert await NoSync(settings(), trainer, None, clock=clock).sync(target, 5) == 5
    assert target.calls == [("advance", 5)]
    # ray: a push serves the snapshot; a sync makes it the serving policy (paused)
    target = Target()
    ray = RaySync(settings(), trainer, None, clock=clock)
    assert await ray.push(target, 5) == 5 and await ray.sync(target, 6) == 6
    assert target.calls == [("serve_weights", "ref", 5), ("sync_weights", "ref", 6, None, True)]
    # ray in the background: the loader starts from the clock's served version
    target = Target()
    background = RaySync(settings(background=True), trainer, None, clock=clock)
    await background.sync(target, 5)
    assert background.loader is not None and background.loader.offered == [5]
    await background.wait()
    assert background.loader.served == 5 and target.calls == [("sync_weights", "ref", 5, None, True)]
    # a channel the workers fetch from themselves
    target = Target()
    channel_sync = ChannelSync(settings(), trainer, None, clock=clock)
    channel_sync.channel = "a channel"  # type: ignore[assignment]
    assert await channel_sync.push(target, 7) == 7
    assert target.calls == [("serve_weights_from", "a channel", 7)]
    # colocated: each engine wakes with its trainer's weights in its own process
    target = Target()
    inprocess = InProcessSync(settings(), trainer, trainer, clock=clock)
    await inprocess.before_train(target)
    assert await inprocess.sync(target, 8) == 8 and inprocess.ranks == [{"woke": 8}]
    assert await inprocess.push(target, 9) == 9
    assert target.calls == [("suspend",), ("swap_in_process", 8), ("serve_weights_in_process", [{"woke": 9}], 9)]
    assert (clock.trained, clock.served) == (0, 4)  # read, never written


def test_a_weight_path_is_given_the_clock_at_construction() -> None:
    with pytest.raises(TypeError, match="clock"):
        RaySync(settings(), Trainer(), None)  # type: ignore[call-arg]
