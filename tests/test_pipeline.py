"""The pipeline end to end on a real local Ray with the tiny model: metrics, staleness bound,
checkpoint and resume without training again on consumed samples, config errors."""

import json

import pytest

from rollart.config import ConfigError, PipelineConfig, load_config
from rollart.pipelines.agentic import AgenticPipeline

pytestmark = pytest.mark.timeout(600)


def small_config(tmp_path, **over):
    raw = {
        "name": "t",
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
        "envs": [{"name": "reverse", "groups": 4, "kwargs": {"length": 3}}],
        "rollout": {"num_env_groups": 4, "group_size": 4, "batch_groups": 2, "alpha": 1},
        "sampling": {"temperature": 1.0, "max_new_tokens": 3},
        "advantage": "grpo_token",
        "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
        "train": {"lr": 0.001},
        "steps": 3,
        "checkpoint_every": 2,
        "output_dir": str(tmp_path / "run"),
        "cluster": {"metadata_store": str(tmp_path / "meta.sqlite")},
    }
    raw.update(over)
    return PipelineConfig.model_validate(raw)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_stop_at_ends_the_run_once_the_trailing_mean_reward_reaches_the_target(ray_local, tmp_path):
    """``stop_at.reward_mean`` with a window of 2: the first step cannot end the run (the window is not
    full), the second does (every reward is >= 0); its checkpoint is written though 2 is not a multiple of
    ``checkpoint_every``, and the run's metrics end there."""
    cfg = small_config(tmp_path, steps=6, checkpoint_every=4, stop_at={"reward_mean": 0.0, "window": 2})
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
    finally:
        pipe.shutdown()
    assert [h["step"] for h in history] == [1, 2] and pipe.stopped_at == 2
    assert [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert pipe.checkpoint_path.name.endswith("2") and pipe.checkpoint_path.exists()
    with pytest.raises(ValueError, match="window"):
        small_config(tmp_path, stop_at={"reward_mean": 0.5, "window": 0})


def test_run_checkpoint_and_resume_without_retraining(ray_local, tmp_path):
    cfg = small_config(tmp_path)
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
    finally:
        pipe.shutdown()
    assert [h["step"] for h in history] == [1, 2, 3] and [h["version"] for h in history] == [1, 2, 3]
    for h in history:
        assert 0.0 <= h["reward_mean"] <= 1.0 and set(h["reward_by_tag"]) == {"reverse-3"}
        assert h["max_staleness"] <= cfg.rollout.alpha and sum(h["staleness"].values()) == 2
        assert h["hardware_by_tag"] == {"reverse-3": {"CPU": 8}} and h["tokens"] > 0
        assert set(h["time"]) == {"step_s", "rollout_wait_s", "train_s", "weight_sync_s", "weight_load_s"}
        # learning diagnostics: advantages, per-position credit (reverse: accuracy of each answer
        # character), policy entropy per action position, gradient norm before clipping
        assert set(h["advantage"]) == {"mean", "std", "frac_zero"} and 0.0 <= h["advantage"]["frac_zero"] <= 1.0
        credit = h["credit_by_position"]["reverse-3"]
        assert 1 <= len(credit) <= 3 and all(0.0 <= c <= 1.0 for c in credit)
        assert all(0.0 <= d <= 1.0 for d in h["dead_by_position"]["reverse-3"])
        assert h["train"]["grad_norm"] >= 0.0 and h["train"]["entropy_pos0"] > 0.0
    assert (tmp_path / "run" / "metrics.png").exists()
    assert pipe.checkpoint_path.exists()
    consumed_before_ckpt = {g for h in history[:2] for g in h["groups"]}

    resumed_cfg = small_config(tmp_path, steps=4, history_keep=1)
    pipe = AgenticPipeline(resumed_cfg, resume=True, progress=False)
    try:
        assert pipe.start_step == 2
        kept = pipe.run()
    finally:
        pipe.shutdown()
    # the driver keeps the last history_keep step records; metrics.jsonl has every step, once
    assert [h["step"] for h in kept] == [4]
    assert [h["step"] for h in pipe.step_records()] == [1, 2, 3, 4]
    more = pipe.step_records()[2:]
    assert [h["step"] for h in more] == [3, 4] and more[0]["version"] == 3
    resumed_groups = {g for h in more for g in h["groups"]}
    assert not resumed_groups & consumed_before_ckpt  # nothing consumed before the checkpoint is trained again
    # the resumed run's ledger accounts for the rounds the first run had started past its checkpoint
    # (generated, running or being completed): played again, so retried, not lost
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and ledger["rewards_invented"] == 0, ledger
    assert ledger["trained"] == 4 * 2 * 4 and ledger["started"] >= ledger["trained"] + ledger["retried"], ledger


def test_a_seeded_synchronous_run_repeats(ray_local, tmp_path):
    """Same config, same seed: the same samples, rewards and advantages at every step (sampling is
    seeded per request, groups enter the batch in a fixed order), whatever the engine's batching."""

    def run(name, seed):
        cfg = small_config(
            tmp_path,
            output_dir=str(tmp_path / name),
            seed=seed,
            checkpoint_every=0,
            rollout={"num_env_groups": 4, "group_size": 4, "batch_groups": 4, "alpha": 0},
            sampling={"temperature": 1.0, "max_new_tokens": 3, "seed": 0},
        )
        pipe = AgenticPipeline(cfg, progress=False)
        try:
            out = [
                (h["reward_mean"], h["credit_by_position"], h["advantage"], h["train"]["entropy"]) for h in pipe.run()
            ]
        finally:
            pipe.shutdown()
        # one clock for the run: the trainer's 3 versions, every one served (synchronous)
        assert pipe.scheduler.clock is pipe.proxy.clock is pipe.clock
        assert (pipe.clock.trained, pipe.clock.served, pipe.train_version) == (3, 3, 3)
        return out

    first = run("a", 0)
    assert run("b", 0) == first
    assert run("c", 1) != first


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "pools: {train: {hardware: CPU, cpus: 1}, rollout: {hardware: CPU, cpus: 1}}\n"
        "envs: [{name: reverse, groups: 3}]\nrollout: {num_env_groups: 4, group_size: 2, batch_groups: 2}\n"
    )
    with pytest.raises(ConfigError, match="groups add up to 3 but rollout.num_env_groups is 4"):
        load_config(bad)
    bad.write_text("pools: {train: {hardware: CPU, cpus: 1}}\nenvs: [{name: reverse, groups: 8}]\n")
    with pytest.raises(ConfigError, match="rollout_pool: 'rollout' is not one of pools"):
        load_config(bad)
    bad.write_text(
        "pools: {train: {hardware: CPU}, rollout: {hardware: CPU, cpus: 1}}\nenvs: [{name: reverse, groups: 8}]\n"
    )
    with pytest.raises(ConfigError, match='a CPU group needs "cpus"'):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_shipped_configs_validate():
    cfg = load_config("pipelines/quickstart.yaml")
    assert cfg.rollout.num_env_groups * cfg.rollout.group_size == 256


def test_rewards_come_from_the_reward_service_and_a_dead_service_never_scores_zero(ray_local, tmp_path):
    from reward_fixtures import ThreadServer

    from rollart.envs.rewards import reverse
    from rollart.reward.server import build_app

    calls = {"n": 0}

    def counted_reverse(traj):
        calls["n"] += 1
        return reverse(traj)

    with ThreadServer(build_app({"reverse": counted_reverse})) as srv:
        cfg = small_config(
            tmp_path, steps=1, checkpoint_every=0, reward={"url": srv.url("/rewards/reverse"), "retries": 1}
        )
        pipe = AgenticPipeline(cfg, progress=False)
        try:
            history = pipe.run()
        finally:
            pipe.shutdown()
    assert calls["n"] >= 8 and history[0]["trajectories_reward_failed"] == 0

    dead = small_config(
        tmp_path, steps=1, checkpoint_every=0, reward={"url": srv.url("/rewards/reverse"), "retries": 0}
    )
    pipe = AgenticPipeline(dead, progress=False)

    async def one_round():
        pipe.controller.start()
        try:
            import asyncio

            await asyncio.wait_for(pipe.controller.get_batch(), timeout=5)
        except TimeoutError:
            pass
        finally:
            await pipe.controller.stop()

    import asyncio

    try:
        asyncio.run(one_round())
        counts = pipe.scheduler.counts
        assert counts["trajectories_reward_failed"] > 0 and counts.get("groups_accepted", 0) == 0
        assert all(t.reward is None for t in pipe.scheduler.completed_trajectories if t.status == "reward_failed")
    finally:
        pipe.shutdown()


def test_kl_term_uses_a_frozen_reference_model(ray_local, tmp_path):
    """With ``train.kl_coef > 0`` a reference cluster (the initial policy, colocated with the trainer)
    feeds ``ref_logprobs``: KL is exactly 0 before the first update and positive once the policy moved
    (the entropy bonus moves it even when every group has equal rewards)."""
    cfg = small_config(
        tmp_path,
        steps=3,
        checkpoint_every=0,
        train={"lr": 0.01, "kl_coef": 0.05, "entropy_coef": 0.05},
        rollout={"num_env_groups": 4, "group_size": 4, "batch_groups": 2, "alpha": 0},
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        assert pipe.ref is not None
        history = pipe.run()
    finally:
        pipe.shutdown()
    kls = [h["train"]["kl_ref"] for h in history]
    assert abs(kls[0]) < 1e-6 and kls[1] > 1e-6 and kls[2] > 1e-6


def test_gae_with_a_critic_trained_k_times_per_actor_step(ray_local, tmp_path):
    """``advantage: gae``: a critic cluster scores each batch (skip-observation GAE) and takes K value
    updates on it beside the actor's update; its loss on the batch falls across the K passes."""
    cfg = small_config(
        tmp_path,
        steps=2,
        checkpoint_every=0,
        advantage="gae",
        critic={"epochs": 3, "lr": 0.003, "freeze_attention": True},
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        assert pipe.critic is not None
        history = pipe.run()
    finally:
        pipe.shutdown()
    for h in history:
        t = h["train"]
        assert t["critic_epochs"] == 3 and t["critic_frozen_params"] > 0
        assert t["critic_value_loss_last"] < t["critic_value_loss_first"]


def test_the_critic_is_checkpointed_with_the_actor_and_restored_on_resume(ray_local, tmp_path):
    """``preset: sao`` critic: its model, optimiser and warm-up are saved next to the actor's checkpoint
    (``torch.load(weights_only=True)`` reads the file) and ``--resume`` restores them."""
    import torch

    cfg = small_config(tmp_path, steps=2, checkpoint_every=2, advantage="gae", critic={"preset": "sao", "lr": 0.003})
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        pipe.run()
        saved = pipe.critic.param_checksum()[0]
        saved_head = pipe.critic.param_checksum("head")[0]
    finally:
        pipe.shutdown()
    state = torch.load(pipe.critic_checkpoint_path, weights_only=True)
    assert state["step"] == 1 and state["steps"] == 2 and state["optimizer"]["state"]
    resumed = AgenticPipeline(
        small_config(tmp_path, steps=3, checkpoint_every=2, advantage="gae", critic={"preset": "sao", "lr": 0.003}),
        resume=True,
        progress=False,
    )
    try:
        assert resumed.start_step == 2
        assert resumed.critic.param_checksum()[0] == saved  # not the freshly initialised critic
        assert resumed.critic.param_checksum("head")[0] == saved_head
        more = resumed.run()
    finally:
        resumed.shutdown()
    assert [h["step"] for h in more] == [3]
    # the warm-up went on: a fresh critic would report 2/10 of lr after its first step, this one 4/10
    assert more[0]["train"]["critic_lr"] == pytest.approx(0.003 * 4 / 10)


def test_make_batch_builds_the_batch_once_then_adds_advantages(tmp_path, monkeypatch):
    """The critic scores the batch the actor trains on (no second build); without a critic the
    running-mean baseline carries its window from one step to the next."""
    import asyncio

    from rollart.algorithms import RunningMeanBaseline
    from rollart.pipelines import agentic
    from rollart.rollout.types import Trajectory
    from rollart.training import columns as C

    builds = []
    real = agentic.trajectories_to_batch
    monkeypatch.setattr(agentic, "trajectories_to_batch", lambda *a, **k: builds.append(k) or real(*a, **k))
    scored = []

    class FakeCritic:
        def compute_values(self, batch, blocking=True):
            async def values():
                scored.append(batch)
                return [[0.25] * len(ids) for ids in batch[C.INPUT_IDS]]

            return values()

        def train_step(self, batch, blocking=True):
            return ("critic step on", batch)

    groups = [
        [
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"{i}:0",
                tag="t",
                token_ids=[5, 6, 7],
                loss_mask=[0, 1, 1],
                logprobs=[0.0, -1.0, -1.0],
                versions=[-1, 0, 0],
                reward=float(i),
            )
        ]
        for i in range(2)
    ]
    pipe = AgenticPipeline.__new__(AgenticPipeline)
    pipe.config = small_config(tmp_path, advantage="gae", critic={"preset": "sao"})
    pipe.critic, pipe.baseline = FakeCritic(), None
    batch, critic_step = asyncio.run(pipe._make_batch(groups))
    assert builds == [{"advantage": None}] and scored == [batch] and critic_step == ("critic step on", batch)
    assert batch[C.VALUES][0] == [0.0, 0.25, 0.25] and batch[C.RETURNS][1] == [0.0, 1.0, 1.0]

    pipe.config = small_config(tmp_path, advantage="running_mean", running_mean={"window": 4, "scope": "global"})
    pipe.critic, pipe.baseline = None, RunningMeanBaseline(4, "global")
    first, none = asyncio.run(pipe._make_batch(groups))
    second, _ = asyncio.run(pipe._make_batch(groups))
    assert none is None
    assert [a[0] for a in first[C.ADVANTAGES]] == [0.0, 1.0] and [a[0] for a in second[C.ADVANTAGES]] == [-0.5, 0.5]


def test_critic_without_gae_is_a_config_error(tmp_path):
    with pytest.raises(Exception, match="critic: is set but advantage='grpo_token' never uses it"):
        small_config(tmp_path, critic={"preset": "sao"})


def test_gae_without_a_critic_is_a_config_error(tmp_path):
    with pytest.raises(Exception, match="advantage: gae needs a critic"):
        small_config(tmp_path, advantage="gae")


def test_batch_statistics_of_advantages_credit_and_dead_positions():
    from rollart.pipelines.agentic import batch_statistics
    from rollart.rollout.types import Trajectory
    from rollart.training.data import trajectories_to_batch

    def traj(group, member, credit):
        return Trajectory(
            traj_id=f"{group}:{member}",
            group_id=group,
            tag="r",
            token_ids=[9] * (1 + len(credit)),
            loss_mask=[0] + [1] * len(credit),
            reward=sum(credit) / 3,
            token_rewards=[0.0] + credit,
        )

    groups = [
        [traj("0:0", 0, [1.0, 0.0, 0.0]), traj("0:0", 1, [0.0, 0.0, 1.0])],
        [traj("1:0", 0, [1.0, 0.0, 1.0]), traj("1:0", 1, [1.0, 0.0, 0.0])],
    ]
    trajs = [t for g in groups for t in g]
    stats = batch_statistics(trajectories_to_batch(groups, advantage="grpo_token"), trajs)
    assert stats["credit_by_position"] == {"r": [0.75, 0.0, 0.5]}
    # position 1: no member of either group got it (dead); position 0 of group 1 is tied at 1 (not dead)
    assert stats["dead_by_position"] == {"r": [0.0, 1.0, 0.0]}
    # 12 action tokens; non-zero only where a pair differs: position 0 of group 0, position 2 of both
    assert stats["advantage"]["frac_zero"] == 0.5 and stats["advantage"]["mean"] == pytest.approx(0.0, abs=1e-12)


def test_routing_auto_sends_the_decode_heavier_task_to_h20_and_the_other_to_h800(ray_local, tmp_path):
    """No hint (every tag prefers H800, then H20): once each task has 4 finished requests, the one whose
    answer is long for its prompt (reverse-8) is reordered to H20 first; reverse-1 keeps H800."""
    cfg = small_config(
        tmp_path,
        pools={
            "train": {"hardware": "CPU", "cpus": 1},
            "rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 1}],
        },
        tags={"*": ["H800", "H20"]},
        routing={"auto": True, "min_requests": 4},
        tasks={"reverse-1": {"ratio": 0.5}, "reverse-8": {"ratio": 0.5}},  # one group of each in every batch
        envs=[
            {"name": "reverse", "groups": 2, "kwargs": {"length": 1}},
            {"name": "reverse", "groups": 2, "kwargs": {"length": 8}},
        ],
        rollout={"num_env_groups": 4, "group_size": 4, "batch_groups": 2, "alpha": 1},
        sampling={"temperature": 1.0, "max_new_tokens": 8},
        steps=5,
        checkpoint_every=0,
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
    finally:
        pipe.shutdown()
    assert history[-1]["routing"] == {"reverse-8": ["H20", "H800"]}
    last = history[-1]["hardware_by_tag"]
    assert {tag: set(hws) for tag, hws in last.items()} == {"reverse-8": {"H20"}, "reverse-1": {"H800"}}, last
    first = history[0]["hardware_by_tag"]  # before any task was profiled: the static order, H800 first
    assert {tag: set(hws) for tag, hws in first.items()} == {"reverse-8": {"H800"}, "reverse-1": {"H800"}}, first
