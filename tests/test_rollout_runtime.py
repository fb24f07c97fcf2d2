"""LLMProxy, inference workers, EnvManagers and the rollout scheduler on a real local Ray, with the
simulated engine (no model): routing, suspend/resume, aborts, env faults, redundant collection."""

import asyncio
import threading

import pytest
from rollout_fixtures import BrokenStepEnv, CharCodec, CountEnv, FlakyResetEnv, GatedEnv, simulated_cluster

from rollart.engines.base import SamplingParams
from rollart.rollout.config import EnvManagerConfig, RolloutConfig
from rollart.rollout.env_manager import EnvManager
from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.scheduler import RolloutScheduler
from rollart.rollout.types import GenerateRequest

pytestmark = pytest.mark.timeout(300)


def request(rid, n=8, prompt=(5, 6, 7)):
    return GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=SamplingParams(max_new_tokens=n))


async def test_trajectories_are_routed_to_the_hardware_of_their_tag(make_rm):
    rm = make_rm({"rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 2}]})
    proxy = LLMProxy(simulated_cluster(rm, "rollout", {"Count": ["H800", "H20"], "*": ["H20", "H800"]}))
    codec = CharCodec()

    class OtherEnv(CountEnv):
        tag = "Other"

    managers = [EnvManager(CountEnv(), proxy, codec) for _ in range(3)] + [
        EnvManager(OtherEnv(), proxy, codec) for _ in range(3)
    ]
    trajs = await asyncio.gather(*(m.run(seed=i, group_id="g") for i, m in enumerate(managers)))
    for t in trajs:
        assert t.status == "ok" and t.reward == 2.0
        assert set(t.hardware) == ({"H800"} if t.tag == "Count" else {"H20"})
        # loss mask covers exactly the generated tokens; observations are masked out
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        assert sum(t.loss_mask) == sum(e - s for s, e in t.turns) and len(t.turns) == 2
        assert all(t.loss_mask[i] == 1 for s, e in t.turns for i in range(s, e))
        assert t.token_ids[: t.prompt_length] == codec.encode(f"start {t.info['reset']['seed']}:")
    by_hw = proxy.metrics()
    assert by_hw["H800"]["requests"] == 6 and by_hw["H20"]["requests"] == 6


async def test_suspend_keeps_partial_tokens_and_resume_continues_under_new_version(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.01)
    proxy = LLMProxy(cluster)
    reference = await proxy.generate(request("ref", n=40), "x")
    assert len(reference.output_token_ids) == 40 and set(reference.token_versions) == {0}

    task = asyncio.ensure_future(proxy.generate(request("r1", n=40), "x"))
    while (await cluster.metrics())[0]["steps"] < 40 + 3:  # r1 produced a few tokens under version 0
        await asyncio.sleep(0.005)
    await proxy.suspend()
    await proxy.model_update({}, 1)
    await proxy.resume()
    out = await task
    assert out.finish_reason == "length" and len(out.output_token_ids) == 40
    assert out.output_token_ids == reference.output_token_ids  # same continuation, prefix recomputed
    versions = out.token_versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert (await cluster.metrics())[0]["preempted"] >= 1


async def test_abort_returns_partial_tokens_and_the_rest_keep_going(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.005)
    proxy = LLMProxy(cluster)
    victim = asyncio.ensure_future(proxy.generate(request("victim", n=200), "x"))
    other = asyncio.ensure_future(proxy.generate(request("other", n=30), "x"))
    while (await cluster.metrics())[0]["running"] < 2:
        await asyncio.sleep(0.005)
    await proxy.abort(["victim"])
    v, o = await victim, await other
    assert v.finish_reason == "abort" and 0 < len(v.output_token_ids) < 200
    assert o.finish_reason == "length" and len(o.output_token_ids) == 30


async def test_env_faults_fail_one_trajectory_without_stalling_the_rest(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    proxy = LLMProxy(simulated_cluster(rm, "rollout"))
    codec = CharCodec()
    cfg = EnvManagerConfig(reset_retries=2, reset_backoff_s=0.001, step_retries=1)
    good = [EnvManager(CountEnv(), proxy, codec, config=cfg) for _ in range(4)]
    broken = EnvManager(BrokenStepEnv(), proxy, codec, config=cfg)
    flaky = EnvManager(FlakyResetEnv(failures=2), proxy, codec, config=cfg)
    dead = EnvManager(FlakyResetEnv(failures=10), proxy, codec, config=cfg)
    trajs = await asyncio.gather(*(m.run(seed=1) for m in [*good, broken, flaky, dead]))
    assert [t.status for t in trajs] == ["ok"] * 4 + ["failed", "ok", "failed"]
    assert "env server unreachable" in trajs[4].error and trajs[4].reward is None
    assert "reset" in trajs[6].error and trajs[6].reward is None


async def test_reward_failure_is_marked_never_zero(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    proxy = LLMProxy(simulated_cluster(rm, "rollout"))

    async def failing_reward(traj):
        raise ConnectionError("reward service down")

    t = await EnvManager(CountEnv(), proxy, CharCodec(), reward_fn=failing_reward).run(seed=0)
    assert t.status == "reward_failed" and t.reward is None and "reward service down" in t.error


async def test_redundant_collection_stops_early_and_keeps_complete_groups(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2}})
    proxy = LLMProxy(simulated_cluster(rm, "rollout"))
    codec = CharCodec()
    gate = threading.Event()  # the slow env of every group never finishes until the test ends
    groups = [
        [EnvManager(CountEnv(turns=1), proxy, codec) for _ in range(3)] + [EnvManager(GatedEnv(gate), proxy, codec)]
        for _ in range(3)
    ]
    cfg = RolloutConfig(num_env_groups=3, group_size=4, group_keep=3, batch_groups=2, alpha=0)
    sched = RolloutScheduler(groups, cfg)
    sched.start()
    try:
        batch = await asyncio.wait_for(sched.get_batch(), timeout=60)
    finally:
        await sched.stop()
        gate.set()
    assert len(batch) == 2
    for grp in batch:
        assert len(grp) == 3 and all(t.status == "ok" and t.tag == "Count" for t in grp)
        assert len({t.group_id for t in grp}) == 1 and len({t.traj_id for t in grp}) == 3
        assert len({t.info["reset"]["seed"] for t in grp}) == 1  # a group plays one seed
    assert sched.counts["trajectories_aborted"] >= 2  # the gated members were aborted, not waited for


@pytest.mark.parametrize("requeue", [True, False])
async def test_failed_reward_replays_the_round_or_drops_the_trajectory(make_rm, requeue):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    proxy = LLMProxy(simulated_cluster(rm, "rollout"))
    failures = {"left": 1}

    async def flaky_reward(traj):
        if traj.traj_id.endswith(":0:v0") and failures["left"] > 0:  # member 0 of the first round, once
            failures["left"] -= 1
            raise ConnectionError("reward service unavailable")
        return 1.0

    groups = [[EnvManager(CountEnv(turns=1), proxy, CharCodec(), reward_fn=flaky_reward) for _ in range(3)]]
    cfg = RolloutConfig(num_env_groups=1, group_size=3, group_keep=2, batch_groups=1, requeue_reward_failures=requeue)
    sched = RolloutScheduler(groups, cfg)
    sched.start()
    try:
        (group,) = await asyncio.wait_for(sched.get_batch(), timeout=60)
    finally:
        await sched.stop()
    assert sched.counts["trajectories_reward_failed"] == 1
    assert all(t.reward == 1.0 for t in group) and len(group) == 2
    assert sched.counts["rounds_requeued_reward"] == (1 if requeue else 0)
    # requeue replays the same seed (same round); drop completes the first round from the others
    assert group[0].group_id == "0:0"


async def test_a_round_that_failed_then_succeeded_leaves_no_failure_record(make_rm):
    """A round that fails (its members' resets fail) is retried with the same seed; once it succeeds,
    whether it is trained or filtered out (zero variance), the scheduler keeps nothing of its failure:
    the per-round failure record does not grow with a long run's transient faults."""
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    proxy = LLMProxy(simulated_cluster(rm, "rollout"))
    cfg = EnvManagerConfig(reset_retries=0)

    def by_member(i):
        async def reward(traj):
            return float(i)  # members disagree: the group is trained

        return reward

    flaky = [EnvManager(FlakyResetEnv(failures=1), proxy, CharCodec(), config=cfg) for _ in range(2)]  # filtered
    steady = [EnvManager(CountEnv(turns=1), proxy, CharCodec(), reward_fn=by_member(i)) for i in range(2)]
    # the policy version stays 0 here (no trainer): alpha leaves room for every round the test plays
    rc = RolloutConfig(num_env_groups=2, group_size=2, batch_groups=1, alpha=300, filter_zero_variance=True)
    sched = RolloutScheduler([flaky, steady], rc)
    sched.start()
    try:
        for _ in range(200):  # batches until the flaky group's round 0 has failed and then been filtered
            (group,) = await asyncio.wait_for(sched.get_batch(), timeout=60)
            assert group.gid.env_group == 1
            if sched.counts["groups_filtered"] >= 1:
                break
    finally:
        await sched.stop()
    assert sched.counts["rounds_failed"] >= 1 and sched.counts["groups_filtered"] >= 1
    assert (0, 0) in sched.settled  # the flaky group's first round succeeded on its retry and was filtered
    assert not sched._failures  # nothing held for rounds that succeeded


async def test_the_newest_version_loader_keeps_a_bounded_record_over_a_long_run():
    """One version offered and loaded per step: after 3000 steps the loader remembers only its last
    ``keep`` versions (memory does not grow with the steps), counts every load, and a version offered
    while another loads is still reported as skipped."""
    from rollart.rollout.async_controller import NewestVersionLoader

    started, gate = asyncio.Event(), asyncio.Event()

    async def load(version: int) -> None:
        if version == 2999:  # held until 3000 and 3001 are offered
            started.set()
            await gate.wait()

    loader = NewestVersionLoader(load, keep=5)
    for v in range(1, 3000):
        loader.offer(v)
        if v < 2999:
            await loader.wait()
    await started.wait()
    loader.offer(3000)
    loader.offer(3001)  # offered while 2999 loads: 3000 is passed over for 3001
    gate.set()
    await loader.wait()
    assert loader.served == 3001 and loader.loads == 3000
    assert loader.offered == [2997, 2998, 2999, 3000, 3001]
    assert loader.loaded == [2996, 2997, 2998, 2999, 3001]
    assert loader.skipped == [3000]
