"""The critic (SAO §3): K value updates per actor step, frozen attention, skip-observation GAE batches,
and two gloo ranks training like one rank on the whole batch."""

import pytest
import torch

import rollart as ra
from rollart.models import build_tiny
from rollart.resource_manager.net import free_port
from rollart.rollout.types import Trajectory
from rollart.training import columns as C
from rollart.training.config import CriticConfig
from rollart.training.critic import CriticWorker, gae_batch

pytestmark = pytest.mark.timeout(300)


def traj(i: int, token_ids, loss_mask, reward: float, group: str = "g0") -> Trajectory:
    return Trajectory(
        traj_id=f"t{i}",
        group_id=group,
        tag="test",
        token_ids=list(token_ids),
        loss_mask=list(loss_mask),
        logprobs=[-0.5 * m for m in loss_mask],
        versions=[0 if m else -1 for m in loss_mask],
        reward=reward,
    )


def agentic_groups(n: int) -> list[list[Trajectory]]:
    """``n`` two-turn trajectories (prompt, action, observation, action) of uneven lengths in groups of 2."""
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(n):
        prompt, act, obs = 2 + i % 3, 2 + i % 2, 2
        mask = [0] * prompt + [1] * act + [0] * obs + [1] * act
        ids = torch.randint(3, 60, (len(mask),), generator=g).tolist()
        trajs.append(traj(i, ids, mask, reward=float(i % 2), group=f"g{i // 2}"))
    return [trajs[i : i + 2] for i in range(0, n, 2)]


def critic_batch(critic: ra.Cluster, groups) -> ra.Batch:
    """Score the trajectories with the critic, then build the GAE batch its ``train_step`` takes."""
    values = critic.compute_values(ra.Batch({C.INPUT_IDS: [t.token_ids for g in groups for t in g]}))
    return gae_batch(groups, values, gamma=1.0, lam=1.0)


def mse_on_actions(values, batch: ra.Batch) -> float:
    num = den = 0.0
    for v, r, m in zip(values, batch[C.RETURNS], batch[C.LOSS_MASK]):
        for vt, rt, mt in zip(v, r, m):
            if mt:
                num += 0.5 * (vt - rt) ** 2
                den += 1
    return num / den


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("critic") / "tiny"
    return str(build_tiny(path, hidden_size=32, num_layers=1, intermediate_size=64, seed=1))


# ---------------------------------------------------------------------------------------------- gae_batch
def test_gae_batch_skips_the_observation_tokens_by_hand():
    values = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    t = traj(0, [5, 6, 7, 8, 9, 10], [1, 1, 0, 0, 1, 1], reward=1.0)
    b = gae_batch([[t]], [values], gamma=1.0, lam=1.0, whiten=False)
    # gamma = lam = 1: A_t = reward - V_t on the action tokens, 0 on the observation tokens
    assert b[C.ADVANTAGES][0] == pytest.approx([0.9, 0.8, 0.0, 0.0, 0.5, 0.4], abs=1e-6)
    assert b[C.RETURNS][0] == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0, 1.0], abs=1e-6)
    assert b[C.VALUES][0] == pytest.approx([0.1, 0.2, 0.0, 0.0, 0.5, 0.6], abs=1e-6)
    assert b[C.INPUT_IDS] == [[5, 6, 7, 8, 9, 10]] and b[C.LOSS_MASK] == [[1, 1, 0, 0, 1, 1]]
    assert b[C.BEHAVIOUR_LOGPROBS][0] == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5] and float(b[C.REWARDS][0]) == 1.0

    # gamma = 0.9, lam = 0.5; the successor of token 1 is token 4 (V = 0.5), not the observation token 2:
    # A5 = 1 - .6 = .4;  A4 = (.9*.6 - .5) + .45*.4 = .22;  A1 = (.9*.5 - .2) + .45*.22 = .349
    # A0 = (.9*.2 - .1) + .45*.349 = .23705
    expected_adv = [0.23705, 0.349, 0.0, 0.0, 0.22, 0.4]
    expected_ret = [0.33705, 0.549, 0.0, 0.0, 0.72, 1.0]
    b = gae_batch([[t]], [values], gamma=0.9, lam=0.5, whiten=False)
    assert b[C.ADVANTAGES][0] == pytest.approx(expected_adv, abs=1e-6)
    assert b[C.RETURNS][0] == pytest.approx(expected_ret, abs=1e-6)
    # length-adaptive lambda = 1 - 1/(alpha * 4 action tokens) = 0.5 with alpha = 0.5, whatever lam says
    b = gae_batch([[t]], [values], gamma=0.9, lam=0.99, length_adaptive=True, alpha=0.5, whiten=False)
    assert b[C.ADVANTAGES][0] == pytest.approx(expected_adv, abs=1e-6)

    # whitening: mean 0 and std 1 over the action tokens, observations stay 0, returns are pre-whitening
    b = gae_batch([[t]], [values], gamma=0.9, lam=0.5)
    adv = torch.tensor(expected_adv)[[0, 1, 4, 5]]
    white = (adv - adv.mean()) / adv.std(unbiased=False)
    got = b[C.ADVANTAGES][0]
    assert [got[i] for i in (0, 1, 4, 5)] == pytest.approx(white.tolist(), abs=1e-4)
    assert got[2] == got[3] == 0.0
    assert b[C.RETURNS][0] == pytest.approx(expected_ret, abs=1e-6)


def test_gae_batch_rejects_misaligned_values():
    t = traj(0, [5, 6, 7], [0, 1, 1], reward=1.0)
    with pytest.raises(ValueError, match="3 tokens"):
        gae_batch([[t]], [[0.0, 0.0]])
    with pytest.raises(ValueError, match="1 value rows for 2 trajectories"):
        gae_batch([[t, t]], [[0.0] * 3])
    assert CriticConfig(lam=0.9, length_adaptive_lambda=True).gae_kwargs() == {
        "gamma": 1.0,
        "lam": 0.9,
        "critic_lam": None,
        "length_adaptive": True,
        "alpha": 0.05,
    }
    with pytest.raises(ValueError):
        CriticConfig(epoch=3)  # extra fields are refused


# ---------------------------------------------------------------------------------------------- workers
def test_k_value_updates_per_actor_step_fit_better_than_one(make_rm, tiny):
    base = {"model": tiny, "lr": 3e-3, "max_tokens_per_microbatch": 24, "seed": 0}
    rm = make_rm({"k1": {"hardware": "CPU", "cpus": 1}, "k3": {"hardware": "CPU", "cpus": 1}})
    k1 = ra.Cluster("critic_k1", CriticWorker, rm, pool="k1", worker_kwargs={"config": {**base, "epochs": 1}})
    k3 = ra.Cluster("critic_k3", CriticWorker, rm, pool="k3", worker_kwargs={"config": {**base, "epochs": 3}})
    groups = agentic_groups(8)
    batch = critic_batch(k1, groups)
    assert critic_batch(k3, groups)[C.VALUES] == batch[C.VALUES]  # same seed: the same critic to start with
    before = mse_on_actions(k1.compute_values(batch), batch)
    m1 = k1.train_step(batch)
    m3 = k3.train_step(batch)
    assert m1["epochs"] == [1.0] and m3["epochs"] == [3.0] and m3["frozen_params"] == [0.0]
    assert m1["value_loss"][0] == pytest.approx(before, rel=1e-4)  # the first pass sees the starting critic
    assert m3["value_loss_last"][0] < m3["value_loss_first"][0]
    for key in ("explained_variance", "value_clipfrac", "grad_norm"):
        assert key in m3
    after1 = mse_on_actions(k1.compute_values(batch), batch)
    after3 = mse_on_actions(k3.compute_values(batch), batch)
    print(f"value loss before {before:.4f}, after K=1 {after1:.4f}, after K=3 {after3:.4f}")
    assert after1 < before
    assert after3 < after1  # K = 3 updates per actor step fit the returns better than one


def test_frozen_attention_keeps_every_attention_parameter_bit_identical(make_rm, tiny):
    rm = make_rm({"critic": {"hardware": "CPU", "cpus": 1}})
    critic = ra.Cluster(
        "critic_frozen",
        CriticWorker,
        rm,
        pool="critic",
        worker_kwargs={"config": {"model": tiny, "lr": 1e-2, "epochs": 2, "freeze_attention": True}},
    )
    groups = agentic_groups(4)
    batch = critic_batch(critic, groups)
    before = critic.state_summary()
    attn_before = critic.param_checksum("attention")[0]
    metrics = critic.train_step(batch)
    after = critic.state_summary()
    attn = [n for n in before if "self_attn" in n]
    assert attn and all(after[n] == before[n] for n in attn)  # bit-identical
    assert critic.param_checksum("attention")[0] == attn_before
    assert metrics["frozen_params"] == [float(sum(len(before[n]) for n in attn))]
    assert metrics["frozen_tensors"] == [float(len(attn))]
    for kind in ("head.weight", ".mlp."):
        changed = [n for n in before if kind in n and after[n] != before[n]]
        assert changed, f"no {kind} parameter was trained"
    assert mse_on_actions(critic.compute_values(batch), batch) < mse_on_actions(batch[C.VALUES], batch)


def test_two_ranks_train_the_critic_like_one_rank_on_the_whole_batch(make_rm, tiny):
    cfg = {"model": tiny, "lr": 1e-2, "epochs": 2, "max_tokens_per_microbatch": 20}
    rm = make_rm({"dp": {"hardware": "CPU", "cpus": 2}, "single": {"hardware": "CPU", "cpus": 1}})
    dp = ra.Cluster("critic_dp", CriticWorker, rm, pool="dp", worker_kwargs={"config": cfg})
    one = ra.Cluster("critic_one", CriticWorker, rm, pool="single", worker_kwargs={"config": cfg})
    assert dp.setup_distributed("127.0.0.1", free_port()) == ["gloo", "gloo"]
    groups = agentic_groups(6)
    batch = critic_batch(one, groups)
    for a, b in zip(critic_batch(dp, groups)[C.VALUES], batch[C.VALUES]):
        assert a == pytest.approx(b, abs=1e-6)
    m_dp = dp.train_step(batch)
    m_one = one.train_step(batch)
    assert m_dp["rows"] == [3.0, 3.0]
    # loss and explained variance are all-reduced: every rank reports the whole batch's numbers
    assert m_dp["value_loss"][0] == pytest.approx(m_dp["value_loss"][1], rel=1e-6)
    assert m_dp["value_loss"][0] == pytest.approx(m_one["value_loss"][0], rel=1e-5)
    sums, ref = dp.param_checksum(), one.param_checksum()[0]
    assert sums[0] == pytest.approx(sums[1], rel=1e-9)
    assert sums[0] == pytest.approx(ref, rel=1e-5)
    probe = ra.Batch({C.INPUT_IDS: [t.token_ids for g in groups for t in g]})
    for a, b in zip(dp.compute_values(probe), one.compute_values(probe)):
        assert a == pytest.approx(b, abs=1e-5)
    one_row = batch.rows(0, 1)  # rank 1's share is empty: it still joins the step's collectives
    assert dp.train_step(one_row)["rows"] == [1.0]
    one.train_step(one_row)
    sums, ref = dp.param_checksum(), one.param_checksum()[0]
    assert sums[0] == pytest.approx(sums[1], rel=1e-9) and sums[0] == pytest.approx(ref, rel=1e-5)


# ---------------------------------------------------------------------------------------------- SAO fidelity
def test_sao_preset_sets_the_papers_lambdas_and_explicit_fields_win():
    sao = CriticConfig(preset="sao")
    # SAO §4: lambda_policy = 1 - 1/(alpha l) with alpha = 1.5, lambda_critic = 1, K = 2, frozen attention
    assert (sao.lambda_alpha, sao.critic_lambda, sao.length_adaptive_lambda) == (1.5, 1.0, True)
    assert (sao.epochs, sao.freeze_attention, sao.gamma, sao.warmup_steps) == (2, True, 1.0, 10)
    assert sao.gae_kwargs() == {"gamma": 1.0, "lam": 0.95, "critic_lam": 1.0, "length_adaptive": True, "alpha": 1.5}
    assert CriticConfig(preset="sao", lambda_alpha=2.0, epochs=3).gae_kwargs()["alpha"] == 2.0
    assert CriticConfig.model_validate(sao.model_dump()) == sao  # what the pipeline ships to the workers
    plain = CriticConfig()
    assert (plain.lambda_alpha, plain.critic_lambda, plain.length_adaptive_lambda) == (0.05, None, False)
    with pytest.raises(ValueError, match="the only preset is 'sao'"):
        CriticConfig(preset="vapo")


def test_value_targets_use_the_critic_lambda_and_advantages_the_policy_lambda():
    values = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    t = traj(0, [5, 6, 7, 8, 9, 10], [1, 1, 0, 0, 1, 1], reward=1.0)
    # policy lam = 0.5, gamma = 1:  A5 = 1 - .6 = .4 ; A4 = (.6 - .5) + .5 * .4 = .3
    # A1 = (.5 - .2) + .5 * .3 = .45 ; A0 = (.2 - .1) + .5 * .45 = .325
    adv = [0.325, 0.45, 0.0, 0.0, 0.3, 0.4]
    b = gae_batch([[t]], [values], gamma=1.0, lam=0.5, critic_lam=1.0, whiten=False)
    assert b[C.ADVANTAGES][0] == pytest.approx(adv, abs=1e-6)
    assert b[C.RETURNS][0] == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0, 1.0], abs=1e-6)  # lambda_critic = 1: R = reward
    same = gae_batch([[t]], [values], gamma=1.0, lam=0.5, whiten=False)  # critic_lam None: the policy's lambda
    assert same[C.RETURNS][0] == pytest.approx([a + v * m for a, v, m in zip(adv, values, t.loss_mask)], abs=1e-6)
    # SAO: length-adaptive policy lambda with alpha = 1.5 over l = 4 action tokens: 1 - 1/6 = 5/6
    lam = 5 / 6
    a5 = 0.4
    a4 = 0.1 + lam * a5
    a1 = 0.3 + lam * a4
    a0 = 0.1 + lam * a1
    b = gae_batch([[t]], [values], whiten=False, **CriticConfig(preset="sao").gae_kwargs())
    assert b[C.ADVANTAGES][0] == pytest.approx([a0, a1, 0.0, 0.0, a4, a5], abs=1e-6)
    assert b[C.RETURNS][0] == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0, 1.0], abs=1e-6)


def local_critic(**config) -> CriticWorker:
    from rollart.cluster.worker import WorkerContext, host_class

    ctx = WorkerContext(cluster="local", job_id="test", rank=0, world_size=1, pool=None, hardware="CPU")
    return host_class(CriticWorker)(ctx, (), {"config": config})


def test_critic_checkpoint_round_trips_model_optimizer_and_warmup_weights_only(tiny, tmp_path):
    groups = agentic_groups(4)
    critic = local_critic(model=tiny, lr=1e-2, epochs=2, warmup_steps=3)
    batch = gae_batch(
        groups, critic.compute_values(ra.Batch({C.INPUT_IDS: [t.token_ids for g in groups for t in g]})), lam=1.0
    )
    critic.train_step(batch)
    path = critic.save_checkpoint(str(tmp_path / "ckpt" / "critic.pt"), step=7)
    state = torch.load(path, weights_only=True)  # tensors, dicts, lists and numbers only
    assert state["step"] == 7 and state["steps"] == 1 and state["optimizer"]["state"]
    saved = critic.state_summary()
    lr_saved = critic.scheduler.get_last_lr()[0]
    after_saved = critic.train_step(batch)  # the reference: the next step from the saved state

    fresh = local_critic(model=tiny, lr=1e-2, epochs=2, warmup_steps=3, seed=5)
    assert fresh.state_summary() != saved
    assert fresh.load_checkpoint(path) == {"step": 7, "steps": 1}
    assert fresh.state_summary() == saved and fresh.scheduler.get_last_lr()[0] == lr_saved
    resumed = fresh.train_step(batch)  # same weights, AdamW moments and warm-up position: the same step
    assert resumed["value_loss"] == pytest.approx(after_saved["value_loss"], rel=1e-6)
    assert resumed["lr"] == after_saved["lr"]
    resumed_state = fresh.state_summary()
    for name, values in critic.state_summary().items():
        assert resumed_state[name] == pytest.approx(values, abs=1e-6)


def test_a_resumed_critic_takes_the_runs_learning_rate_not_the_checkpoints(tiny, tmp_path, caplog):
    """``rollart run --resume --set critic.lr=...``: the restored critic trains at the new rate, at the
    warm-up's current point, its AdamW moments kept; the change is logged. The same lr: as saved."""
    import logging

    groups = agentic_groups(4)
    critic = local_critic(model=tiny, lr=1e-2, epochs=1, warmup_steps=6)
    batch = gae_batch(
        groups, critic.compute_values(ra.Batch({C.INPUT_IDS: [t.token_ids for g in groups for t in g]})), lam=1.0
    )
    critic.train_step(batch)
    path = critic.save_checkpoint(str(tmp_path / "critic.pt"), step=1)
    moments = [s["exp_avg"].clone() for s in critic.optimizer.state.values()]
    same, faster = (
        local_critic(model=tiny, lr=1e-2, epochs=1, warmup_steps=6),
        local_critic(model=tiny, lr=3e-2, epochs=1, warmup_steps=6),
    )
    same.load_checkpoint(path)
    with caplog.at_level(logging.INFO):
        faster.load_checkpoint(path)
    assert "critic.lr=0.03 replaces the checkpoint's 0.01" in caplog.text
    assert all(torch.equal(x["exp_avg"], m) for x, m in zip(faster.optimizer.state.values(), moments, strict=True))
    ma, ms, mf = critic.train_step(batch), same.train_step(batch), faster.train_step(batch)
    assert ms["lr"] == ma["lr"] < 1e-2  # still in the warm-up
    assert mf["lr"] == pytest.approx(3 * ma["lr"])  # the new rate at the same point of the warm-up
