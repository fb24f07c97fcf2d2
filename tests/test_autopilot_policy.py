"""The autopilot's decision logic on recorded and scripted demand traces (no clocks, no cluster): it grows
a rollout-bound pool to the size that covers the trainer's wait, shrinks one that outpaces training, holds
in between, yields to a queued job at once and returns after it, obeys a person's target until released,
and over a steady phase changes its target at most once."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollart.rollout.autopilot import Autopilot, AutopilotSettings, Demand

SETTINGS = AutopilotSettings(min_devices=1, max_devices=8, window=3, cooldown_steps=2)


def feed(pilot: Autopilot, demands: list[Demand]) -> list:
    return [d for d in (pilot.observe(x) for x in demands) if d is not None]


def steps(start: int, n: int, devices: int, wait: float, held: bool = False, step_s: float = 10.0, queued: int = 0):
    return [Demand(start + i, step_s, wait, held, devices, queued) for i in range(n)]


def test_a_pool_the_trainer_waits_for_grows_to_the_size_that_covers_the_wait():
    pilot = Autopilot(SETTINGS, target=2)
    # 6 s of a 10 s step waiting: 2 devices generate in 10 s what training uses in 4 s -> 5 devices
    (decision,) = feed(pilot, steps(1, 3, devices=2, wait=6.0))
    assert (decision.reason, decision.previous, decision.target, decision.step) == ("grow", 2, 5, 3)
    assert decision.measurements["wait_share"] == [0.6, 0.6, 0.6] and decision.measurements["devices"] == 2
    # two steps of wait is not a window: nothing; whole workers of 2 devices round up; max_devices caps
    assert feed(Autopilot(SETTINGS, target=2), steps(1, 2, devices=2, wait=6.0)) == []
    wide = Autopilot(SETTINGS.model_copy(update={"unit": 2}), target=2)
    assert feed(wide, steps(1, 3, devices=2, wait=6.0))[0].target == 6
    capped = Autopilot(SETTINGS, target=4)
    assert feed(capped, steps(1, 3, devices=4, wait=9.0))[0].target == 8


def test_a_pool_that_outpaces_training_shrinks_one_worker_at_a_time_and_holds_in_between():
    pilot = Autopilot(SETTINGS, target=4)
    (decision,) = feed(pilot, steps(1, 3, devices=4, wait=0.1, held=True))
    assert (decision.reason, decision.target) == ("shrink", 3)
    # a little wait, or generation not held back at every step: no evidence either way, the size holds
    assert feed(Autopilot(SETTINGS, target=4), steps(1, 6, devices=4, wait=1.0)) == []
    mixed = steps(1, 2, devices=4, wait=0.1, held=True) + steps(3, 1, devices=4, wait=0.1, held=False)
    assert feed(Autopilot(SETTINGS, target=4), mixed) == []
    # never below min_devices
    assert feed(Autopilot(SETTINGS, target=1), steps(1, 6, devices=1, wait=0.0, held=True)) == []


def test_after_a_change_the_cool_down_and_a_pool_not_yet_at_its_target_are_not_measured():
    pilot = Autopilot(SETTINGS, target=2)
    assert feed(pilot, steps(1, 3, devices=2, wait=6.0))[0].target == 5
    # the pool is joining (still 2, then 3 devices): those steps say nothing about 5 devices
    assert feed(pilot, steps(4, 4, devices=2, wait=6.0) + steps(8, 3, devices=3, wait=4.0)) == []
    # at 5 devices: cool-down over, a whole window is needed again
    assert feed(pilot, steps(11, 2, devices=5, wait=0.1, held=True)) == []
    assert feed(pilot, steps(13, 1, devices=5, wait=0.1, held=True))[0].target == 4


def test_a_queued_job_gets_the_devices_at_once_and_the_target_returns_after_it():
    pilot = Autopilot(SETTINGS, target=6)
    (y,) = feed(pilot, steps(1, 1, devices=6, wait=0.0, queued=1))
    assert (y.reason, y.target, y.previous, y.measurements) == ("yield", 1, 6, {"queued": 1})
    assert feed(pilot, steps(2, 5, devices=1, wait=9.0, queued=1)) == []  # held at min while it queues
    (back,) = feed(pilot, steps(7, 1, devices=1, wait=9.0))
    assert (back.reason, back.target) == ("return", 6)


def test_a_persons_target_holds_until_released():
    pilot = Autopilot(SETTINGS, target=2)
    m = pilot.manual(3, step=5)
    assert (m.reason, m.target, m.previous) == ("manual", 3, 2)
    assert feed(pilot, steps(6, 6, devices=3, wait=9.0)) == []  # rollout-bound: still 3
    assert feed(pilot, steps(12, 2, devices=3, wait=0.0, queued=2)) == []  # a queued job: still 3
    assert pilot.manual(None, step=14).reason == "release"
    assert feed(pilot, steps(15, 3, devices=3, wait=6.0))[0].reason == "grow"
    assert pilot.manual(99).target == 8  # clamped to max_devices


def async_job(devices: int, step: int, noise: float) -> Demand:
    """A modelled asynchronous job: training takes 4 s, generating a batch 24 s / devices; the trainer waits
    for the rest, generation is held back when it is ahead (the buffer at its bound)."""
    train_s, gen_s = 4.0, 24.0 / devices
    wait = max(0.0, gen_s - train_s) * (1 + noise)
    return Demand(step, train_s + wait, wait, gen_s < train_s, devices)


@pytest.mark.parametrize("start", [1, 2, 8])
def test_a_modelled_job_finds_its_size_and_then_holds_it(start):
    pilot = Autopilot(SETTINGS, target=start)
    devices, history = start, []
    for step in range(1, 61):
        noise = (-0.1, 0.05, 0.1, -0.05)[step % 4]  # a steady phase's jitter
        decision = pilot.observe(async_job(devices, step, noise))
        if decision is not None:
            history.append((step, decision.target))
        devices = pilot.target  # the pool reaches its target by the next step
    # 24 / n <= 4 first at n = 6: the smallest size that keeps the trainer fed
    assert pilot.target == 6, history
    assert all(s <= 20 for s, _ in history), history  # found within 20 steps
    assert len(history) <= 2, history  # one or two changes, then none over the 40 steady steps


def test_settings_that_would_oscillate_are_refused_and_the_state_round_trips():
    with pytest.raises(ValidationError, match="shrink_below"):
        AutopilotSettings(min_devices=1, max_devices=4, grow_above=0.1, shrink_below=0.1)
    with pytest.raises(ValidationError, match="min_devices"):
        AutopilotSettings(min_devices=5, max_devices=4)
    a = Autopilot(SETTINGS, target=2)
    feed(a, steps(1, 2, devices=2, wait=6.0))
    b = Autopilot(SETTINGS)
    b.load_state_dict(a.state_dict())
    third = steps(3, 1, devices=2, wait=6.0)
    assert feed(a, third) == feed(b, third) and a.target == b.target == 5


def test_a_queued_job_seen_at_a_poll_between_steps_is_yielded_to_at_once():
    pilot = Autopilot(SETTINGS, target=5)
    y = pilot.on_queue(1, step=7)  # the elastic pool's poll, no training step yet
    assert (y.reason, y.target, y.step) == ("yield", 1, 7)
    assert pilot.on_queue(1, step=7) is None  # still queued: nothing new
    assert feed(pilot, steps(8, 3, devices=1, wait=9.0, queued=1)) == []
    back = pilot.on_queue(0, step=10)
    assert (back.reason, back.target) == ("return", 5)
    assert pilot.on_queue(0, step=10) is None
