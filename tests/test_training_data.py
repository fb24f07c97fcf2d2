"""Trajectory groups → training batch, then advantages as a step over it: sequence and per-token
group-normalised advantages, leave-one-out, and the running-mean baseline (SAO)."""

import pytest
import torch

from rollart.algorithms import RunningMeanBaseline
from rollart.rollout.types import Trajectory
from rollart.training import columns as C
from rollart.training.data import add_advantages, trajectories_to_batch
from rollart.training.microbatch import plan_microbatches


def traj(tid, reward, token_rewards=None):
    # prompt of 2 tokens, 2 action tokens
    return Trajectory(
        traj_id=tid,
        group_id="0:0",
        tag="t",
        token_ids=[5, 6, 7, 8],
        loss_mask=[0, 0, 1, 1],
        logprobs=[0, 0, -1.0, -1.0],
        versions=[-1, -1, 0, 0],
        reward=reward,
        token_rewards=token_rewards,
    )


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


# ---------------------------------------------------------------------------------------------- advantages as a step
def test_the_batch_is_built_once_and_advantages_are_a_step_over_it():
    groups = [[traj("a", 1.0), traj("b", 0.0)], [traj("c", 0.5, [0, 0, 1.0, 0.0]), traj("d", 0.5, [0, 0, 0.0, 0.0])]]
    bare = trajectories_to_batch(groups, advantage=None)
    assert C.ADVANTAGES not in bare
    assert bare[C.BEHAVIOUR_LOGPROBS][0] == [0, 0, -1.0, -1.0] and "old_logprobs" not in bare
    assert bare[C.TRAJ_ID] == ["a", "b", "c", "d"] and bare[C.TOKEN_REWARDS][0] is None
    for method in ("grpo", "grpo_token", "reinforce"):
        one_go = trajectories_to_batch(groups, advantage=method)[C.ADVANTAGES]
        step = add_advantages(trajectories_to_batch(groups, advantage=None), method)[C.ADVANTAGES]
        assert step == one_go, method
    with pytest.raises(ValueError, match="add_advantages"):
        trajectories_to_batch(groups, advantage="gae")
    with pytest.raises(ValueError, match="needs the critic's values"):
        add_advantages(bare, "gae")
    with pytest.raises(ValueError, match="RunningMeanBaseline"):
        add_advantages(bare, "running_mean")
    with pytest.raises(ValueError, match="use one of grpo, grpo_token, reinforce, running_mean, gae"):
        add_advantages(bare, "ppo")


def single(tid, prompt, reward):
    return Trajectory(
        traj_id=tid,
        group_id=tid,
        tag="t",
        token_ids=[*prompt, 9, 9],
        loss_mask=[0] * len(prompt) + [1, 1],
        logprobs=[0.0] * len(prompt) + [-1.0, -1.0],
        versions=[-1] * len(prompt) + [0, 0],
        reward=reward,
    )


def test_running_mean_baseline_by_hand():
    """SAO §4: ``A = r - mean`` of a window of the prompt's most recent rewards (here 2), the window as
    it was before the batch; a prompt seen for the first time has no baseline (b = 0)."""
    base = RunningMeanBaseline(window=2, scope="prompt")
    p, q = [5, 6], [7, 8]
    step1 = trajectories_to_batch([[single("a", p, 1.0)], [single("b", q, 0.0)]], advantage=None)
    assert step1[C.PROMPT_KEY][0] != step1[C.PROMPT_KEY][1]
    assert add_advantages(step1, "running_mean", baseline=base)[C.ADVANTAGES] == [[1.0] * 4, [0.0] * 4]
    # p's window [1]; q's [0]. Two samples of p in one batch share the baseline from before the batch
    step2 = trajectories_to_batch([[single("c", p, 0.0)], [single("d", p, 0.5)], [single("e", q, 1.0)]], advantage=None)
    assert [a[0] for a in add_advantages(step2, "running_mean", baseline=base)[C.ADVANTAGES]] == [-1.0, -0.5, 1.0]
    # p's window keeps the 2 most recent: [0, 0.5] (the 1.0 fell out) -> b = 0.25; q's [0, 1] -> b = 0.5
    assert base.baseline("x") == 0.0
    step3 = trajectories_to_batch([[single("f", p, 1.0)], [single("g", q, 1.0)]], advantage=None)
    assert [a[0] for a in add_advantages(step3, "running_mean", baseline=base)[C.ADVANTAGES]] == [0.75, 0.5]

    # scope global: one window over every prompt (SAO §5's online setting)
    glob = RunningMeanBaseline(window=3, scope="global")
    assert glob.advantages(["p", "q"], [1.0, 0.0]) == [1.0, 0.0]
    assert glob.advantages(["r"], [1.0]) == [0.5]  # mean(1, 0)
    assert glob.advantages(["p"], [0.0]) == pytest.approx([-2 / 3])  # mean(1, 0, 1)
    assert glob.baseline("anything") == pytest.approx(1 / 3)  # mean(0, 1, 0): the first 1.0 fell out


def test_running_mean_state_survives_a_weights_only_checkpoint(tmp_path):
    base = RunningMeanBaseline(window=3)
    base.advantages(["p", "q", "p"], [1.0, 0.0, 0.5])
    torch.save({"running_mean": base.state_dict()}, tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)["running_mean"]
    again = RunningMeanBaseline(window=3)
    again.load_state_dict(state)
    assert again.advantages(["p", "q"], [1.0, 1.0]) == base.advantages(["p", "q"], [1.0, 1.0]) == [0.25, 1.0]
    with pytest.raises(ValueError, match="scope"):
        RunningMeanBaseline(window=3, scope="global").load_state_dict(state)
