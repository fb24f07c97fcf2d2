"""Properties of the group-relative advantages (GRPO, leave-one-out, per-token GRPO) over generated
rewards: ties give exact zeros, shift/scale invariance, exact antisymmetry of a pair."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart.algorithms import grpo_advantages, reinforce_baseline_advantages
from rollart.rollout.types import Trajectory
from rollart.training.data import token_group_advantages

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)
group_sizes = st.integers(min_value=1, max_value=32)
# rewards on a 0.05 grid: a group that is not tied has a spread of at least 0.05, so the eps in
# ``std + eps`` moves an advantage by at most ~1e-3 under the scalings below
grid_rewards = st.lists(st.integers(min_value=0, max_value=20), min_size=2, max_size=32).map(
    lambda xs: [x * 0.05 for x in xs]
)
NEAR_TIE = [0.23446236, 0.23033303]
NEAR_TIE_ADV = 0.99951590  # d / (d + 1e-6), d = (r0 - r1) / 2


def one_group(rewards: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(rewards, dtype=torch.float64), torch.zeros(len(rewards), dtype=torch.long)


def traj(i: int, credit: list[float]) -> Trajectory:
    n = len(credit)
    return Trajectory(
        traj_id=str(i),
        group_id="0:0",
        tag="t",
        token_ids=[1] * (2 + n),
        loss_mask=[0, 0] + [1] * n,
        reward=sum(credit),
        token_rewards=[0.0, 0.0] + credit,
    )


def token_adv(credits: list[list[float]]) -> list[list[float]]:
    """Per-token advantages of the action tokens of one group whose member ``i`` has ``credits[i]``."""
    rows = token_group_advantages([[traj(i, c) for i, c in enumerate(credits)]])
    return [row[2:] for row in rows]


@settings(max_examples=200, deadline=None)
@given(value=finite | st.sampled_from([0.7, 0.9, 2 / 3, 0.3, 0.1]), n=group_sizes)
def test_equal_rewards_give_exact_zeros(value: float, n: int) -> None:
    r, g = one_group([value] * n)
    assert grpo_advantages(r, g).tolist() == [0.0] * n
    assert grpo_advantages(r, g, norm_std=False).tolist() == [0.0] * n
    assert reinforce_baseline_advantages(r, g).tolist() == [0.0] * n
    assert token_adv([[value, value]] * n) == [[0.0, 0.0]] * n


@pytest.mark.parametrize("value", [0.7, 0.9, 2 / 3, 0.3])
@pytest.mark.parametrize("n", [8, 16])
def test_equal_non_dyadic_rewards_in_float32_also_give_zeros(value: float, n: int) -> None:
    # the bug this guards: fl32(mean) one ulp off, divided by eps, gave +-0.056 to every member
    r = torch.full((n,), value, dtype=torch.float32)
    assert grpo_advantages(r, torch.zeros(n, dtype=torch.long)).tolist() == [0.0] * n


@settings(max_examples=200, deadline=None)
@given(
    rewards=grid_rewards, shift=st.floats(min_value=-100, max_value=100), scale=st.floats(min_value=0.5, max_value=100)
)
def test_advantages_are_invariant_to_shift_and_positive_scale(rewards: list[float], shift: float, scale: float) -> None:
    r, g = one_group(rewards)
    moved = r * scale + shift
    base = grpo_advantages(r, g)
    assert grpo_advantages(moved, g).tolist() == pytest.approx(base.tolist(), abs=2e-3)
    # without eps the invariance is exact up to rounding
    assert grpo_advantages(moved, g, eps=0.0).tolist() == pytest.approx(
        grpo_advantages(r, g, eps=0.0).tolist(), abs=1e-9
    )
    # leave-one-out is shift invariant and scales with the rewards
    loo = reinforce_baseline_advantages(r, g)
    assert (reinforce_baseline_advantages(moved, g) / scale).tolist() == pytest.approx(loo.tolist(), abs=1e-9)
    credits = [[x, 1.0 - x] for x in rewards]
    moved_credits = [[x * scale + shift for x in c] for c in credits]
    for got, want in zip(token_adv(moved_credits), token_adv(credits)):
        assert got == pytest.approx(want, abs=2e-3)


@settings(max_examples=200, deadline=None)
@given(a=finite, b=finite)
def test_a_pair_gets_plus_and_minus_the_same_magnitude_exactly(a: float, b: float) -> None:
    r, g = one_group([a, b])
    for norm_std in (True, False):
        x, y = grpo_advantages(r, g, norm_std=norm_std).tolist()
        assert x == -y
    x, y = reinforce_baseline_advantages(r, g).tolist()
    assert x == -y
    (p, q), (s, t) = token_adv([[a, b], [b, a]])
    assert p == -s and q == -t and p == -q


def test_a_near_tie_keeps_its_precision() -> None:
    r, g = one_group(NEAR_TIE)
    x, y = grpo_advantages(r, g).tolist()
    assert x == pytest.approx(NEAR_TIE_ADV, abs=1e-7) and y == pytest.approx(-NEAR_TIE_ADV, abs=1e-7)
    (tx,), (ty,) = token_adv([[NEAR_TIE[0]], [NEAR_TIE[1]]])
    assert tx == pytest.approx(NEAR_TIE_ADV, abs=1e-7) and ty == pytest.approx(-NEAR_TIE_ADV, abs=1e-7)


@settings(max_examples=100, deadline=None)
@given(rewards=grid_rewards)
def test_grpo_advantages_are_centred_and_unit_scale(rewards: list[float]) -> None:
    r, g = one_group(rewards)
    adv = grpo_advantages(r, g, eps=0.0)
    if len(set(rewards)) == 1:
        assert adv.tolist() == [0.0] * len(rewards)
    else:
        assert float(adv.sum()) == pytest.approx(0.0, abs=1e-9 * len(rewards))
        assert float(adv.pow(2).mean()) == pytest.approx(1.0, rel=1e-9)


def test_token_positions_missing_from_some_members_use_only_the_present_ones() -> None:
    # member 2 has one action token: position 1 is a pair (exact +-), position 0 a triple
    adv = token_adv([[1.0, 1.0], [0.0, 0.0], [1.0]])
    assert adv[0][1] == -adv[1][1] == pytest.approx(1.0, abs=1e-5)
    assert adv[0][0] == adv[2][0] and adv[0][0] > 0 > adv[1][0]
