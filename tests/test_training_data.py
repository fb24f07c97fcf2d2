"""Trajectory groups → training batch: sequence and per-token group-normalised advantages."""

import pytest

from rollart.rollout.types import Trajectory
from rollart.training.data import trajectories_to_batch
from rollart.training.microbatch import plan_microbatches


def traj(tid, reward, token_rewards=None):
    # prompt of 2 tokens, 2 action tokens
    return Trajectory(traj_id=tid, group_id="0:0", tag="t", token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1],
                      logprobs=[0, 0, -1.0, -1.0], versions=[-1, -1, 0, 0], reward=reward,
                      token_rewards=token_rewards)


def test_sequence_grpo_broadcasts_over_the_sequence():
    b = trajectories_to_batch([[traj("a", 1.0), traj("b", 0.0)]])
    assert b["advantages"][0] == pytest.approx([1.0] * 4, abs=1e-4)
    assert b["advantages"][1] == pytest.approx([-1.0] * 4, abs=1e-4)
    assert b["rewards"].tolist() == [1.0, 0.0] and b["loss_mask"][0] == [0, 0, 1, 1]


def test_token_grpo_normalises_each_action_position_within_the_group():
    g = [traj("a", 0.5, [0, 0, 1.0, 0.0]), traj("b", 0.5, [0, 0, 0.0, 0.0])]
    adv = trajectories_to_batch([g], advantage="grpo_token")["advantages"]
    # position 0: credits (1, 0) -> (+1, -1); position 1: (0, 0) -> zero advantage, not NaN
    assert adv[0] == pytest.approx([0, 0, 1.0, 0.0], abs=1e-4)
    assert adv[1] == pytest.approx([0, 0, -1.0, 0.0], abs=1e-4)


def test_token_grpo_falls_back_to_sequence_grpo_for_groups_without_dense_credit():
    dense = [traj("a", 0.5, [0, 0, 1.0, 0.0]), traj("b", 0.5, [0, 0, 0.0, 0.0])]
    plain = [traj("c", 1.0), traj("d", 0.0)]  # e.g. a multi-turn env that reports only a final reward
    adv = trajectories_to_batch([dense, plain], advantage="grpo_token")["advantages"]
    assert adv[0] == pytest.approx([0, 0, 1.0, 0.0], abs=1e-4)
    assert adv[2] == pytest.approx([1.0] * 4, abs=1e-4) and adv[3] == pytest.approx([-1.0] * 4, abs=1e-4)


def test_a_trajectory_without_reward_never_reaches_the_trainer():
    with pytest.raises(ValueError, match="without a reward"):
        trajectories_to_batch([[traj("a", None)]])


def test_microbatches_cover_every_row_once_under_the_budget():
    lengths = [5, 50, 7, 48, 6, 51]
    plans = plan_microbatches(lengths, max_tokens=110)
    assert sorted(i for p in plans for i in p) == list(range(6))
    for p in plans:
        assert max(lengths[i] for i in p) * len(p) <= 110 or len(p) == 1
