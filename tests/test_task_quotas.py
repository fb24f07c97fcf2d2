"""Per-task shares of a training batch (RollArt paper §7.1): the ratio arithmetic, the SampleBuffer's batch
assembly under quotas (hypothesis), and the RolloutScheduler keeping 1:1 while one task is ten times
slower than the other (no Ray, no model: envs that take 1 or 10 event-loop turns)."""

import asyncio
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart.rollout.config import RolloutConfig
from rollart.rollout.quotas import ratio_problems, ratio_quotas
from rollart.rollout.sample_buffer import Group, SampleBuffer, select_batch
from rollart.rollout.scheduler import RolloutScheduler
from rollart.rollout.types import GroupId, Trajectory

# ---------------------------------------------------------------------------------------------- ratios


def test_ratios_split_the_batch_into_whole_groups_or_say_how_to_fix_it():
    assert ratio_quotas({"math": 1, "code": 1}, 8) == {"math": 4, "code": 4}
    assert ratio_quotas({"math": 0.5, "code": 0.25}, 9) == {"math": 6, "code": 3}
    assert ratio_quotas({"a": 3, "b": 1}, 4) == {"a": 3, "b": 1}
    [msg] = ratio_problems({"math": 1, "code": 2}, 8)
    assert "rollout.batch_groups=8" in msg and "multiple of 3 (e.g. 6 or 9)" in msg and "tasks.*.ratio" in msg
    [msg] = ratio_problems({"a": 1, "b": 1, "c": 1}, 2)
    assert "multiple of 3 (e.g. 3)" in msg
    [msg] = ratio_problems({"math": 0, "code": 1}, 2)
    assert msg.startswith("tasks.math.ratio must be > 0")
    with pytest.raises(ValueError, match="whole groups"):
        ratio_quotas({"math": 1, "code": 2}, 4)


@given(st.dictionaries(st.sampled_from("abcde"), st.integers(1, 6), min_size=1), st.integers(1, 40))
def test_whole_quotas_keep_the_ratio_and_fill_the_batch(ratios, batch):
    problems = ratio_problems(ratios, batch)
    total = sum(ratios.values())
    whole = all(batch * r % total == 0 for r in ratios.values())
    assert (not problems) == whole
    if whole:
        quotas = ratio_quotas(ratios, batch)
        assert sum(quotas.values()) == batch and all(quotas[t] * total == batch * r for t, r in ratios.items())


# ------------------------------------------------------------------------------------- batch assembly


def group(i: int, task: str, start: int) -> Group:
    return Group([Trajectory(traj_id=f"{i}", group_id=f"{i}:0", tag=task, start_version=start)], GroupId(i, 0))


def task_of(g: Group) -> str:
    return g[0].tag


def test_select_batch_takes_the_oldest_of_each_task_and_waits_for_the_short_one():
    groups = [group(0, "fast", 0), group(1, "fast", 0), group(2, "fast", 0), group(3, "slow", 0)]
    assert select_batch(groups, 2) == [0, 1]  # FIFO: the fast task fills the batch
    assert select_batch(groups, 2, {"fast": 1, "slow": 1}, task_of) == [0, 3]
    assert select_batch(groups[:3], 2, {"fast": 1, "slow": 1}, task_of) is None
    with pytest.raises(ValueError, match="task_of"):
        select_batch(groups, 2, {"fast": 1, "slow": 1})


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from("abc"), st.integers(0, 3)),  # task, versions behind
        st.tuples(st.just("take"), st.integers(0, 2)),  # then the version advances by this much
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.dictionaries(st.sampled_from("abc"), st.integers(1, 3), min_size=1), st.integers(0, 2))
def test_quota_batches_are_exact_fresh_oldest_first_and_nothing_is_lost_or_taken_twice(ops, quotas, alpha):
    evicted: list[Group] = []
    buf = SampleBuffer(on_stale=evicted.append)
    version, put, taken, n = 0, [], [], sum(quotas.values())
    for op in ops:
        if op[0] == "put":
            g = group(len(put), op[1], max(0, version - op[2]))
            put.append(g)
            buf._groups.append(g)  # what put() does, without an event loop
            continue
        before = buf.groups()
        fresh = [g for g in before if version - SampleBuffer.start_version(g) <= alpha]
        batch = buf.try_take(n, version, alpha, quotas, task_of)
        # the model: the oldest quotas[t] fresh groups of every task, or nothing while one is short
        want = {t: [g for g in fresh if task_of(g) == t][:q] for t, q in quotas.items()}
        if any(len(w) < quotas[t] for t, w in want.items()):
            assert batch is None
        else:
            assert batch is not None
            assert Counter(task_of(g) for g in batch) == Counter(quotas)
            assert sorted(g.gid for g in batch) == sorted(g.gid for w in want.values() for g in w)
            assert all(version - SampleBuffer.start_version(g) <= alpha for g in batch)
            taken += batch
        # stale groups left the buffer through on_stale; the rest kept their order
        assert [g.gid for g in buf.groups()] == [g.gid for g in fresh if g not in (batch or [])]
        version += op[1]
    ids = [g.gid for g in taken] + [g.gid for g in evicted] + [g.gid for g in buf.groups()]
    assert sorted(ids) == [g.gid for g in put]  # every group exactly once: trained, evicted (replayed) or waiting


# ------------------------------------------------------------------------------------------ scheduler


class TickManager:
    """Plays an episode in ``ticks`` event-loop turns (a deterministic notion of slow), reward by seed."""

    def __init__(self, tag: str, ticks: int):
        self.tag, self.ticks = tag, ticks

    async def run(self, seed, group_id, traj_id):
        for _ in range(self.ticks):
            await asyncio.sleep(0)
        version = int(traj_id.rsplit(":v", 1)[1])  # the scheduler names the version the round began under
        return Trajectory(
            traj_id=traj_id, group_id=group_id, tag=self.tag, reward=float(seed % 3), start_version=version
        )

    async def abort(self):
        return None


async def run_steps(quotas, steps=8, alpha=1):
    cfg = RolloutConfig(num_env_groups=4, group_size=2, batch_groups=2, alpha=alpha)
    groups = [[TickManager("fast", 1) for _ in range(2)] for _ in range(2)]
    groups += [[TickManager("slow", 10) for _ in range(2)] for _ in range(2)]
    sched = RolloutScheduler(groups, cfg, quotas=quotas)
    per_step, held = [], []
    sched.start()
    try:
        for _ in range(steps):
            batch = await asyncio.wait_for(sched.get_batch(), timeout=60)
            per_step.append(Counter(sched.task_of(g) for g in batch))
            held.append(sched.buffered_by_task().get("fast", 0))
            await sched.set_version(sched.version + 1)
    finally:
        await sched.stop()
    return sched, per_step, held


async def test_one_to_one_holds_at_every_step_while_one_task_is_ten_times_slower():
    sched, per_step, held = await run_steps({"fast": 1, "slow": 1})
    assert per_step == [Counter({"fast": 1, "slow": 1})] * 8
    assert max(held) >= 1  # the fast task's extra groups waited for later batches ...
    assert max(held) <= (sched.config.alpha + 1) * 1 + 1  # ... bounded by its own admission share
    assert max(sched.staleness) <= sched.config.alpha and sched.counts["rounds_trained_twice"] == 0
    by_task = sched.counts_by_task
    assert by_task["fast"]["groups_trained"] == by_task["slow"]["groups_trained"] == 8
    assert by_task["slow"]["trajectories_trained"] == 16 and max(sched.staleness_by_task["fast"]) <= 1
    # nothing lost: every accepted group was trained, is waiting, or was evicted (then replayed)
    for t, c in by_task.items():
        assert (
            c["groups_accepted"] == c["groups_trained"] + sched.buffered_by_task().get(t, 0) + c["groups_evicted_stale"]
        )


async def test_without_quotas_the_fast_task_crowds_out_the_slow_one():
    _, per_step, _ = await run_steps(None)
    assert sum(c["fast"] for c in per_step) > sum(c["slow"] for c in per_step)
    assert any(c["slow"] == 0 for c in per_step)


def test_quotas_must_name_every_task_and_fill_the_batch():
    cfg = RolloutConfig(num_env_groups=2, group_size=1, batch_groups=2)
    groups = [[TickManager("a", 1)], [TickManager("b", 1)]]
    with pytest.raises(ValueError, match=r"tasks \['c'\] have no env group and tasks \['b'\] have no quota"):
        RolloutScheduler(groups, cfg, quotas={"a": 1, "c": 1})
    with pytest.raises(ValueError, match="add up to rollout.batch_groups=2"):
        RolloutScheduler(groups, cfg, quotas={"a": 2, "b": 1})


# ---------------------------------------------------------------------------------------------- config


def multi_config(**over):
    raw = {
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
        "envs": [
            {"name": "reverse", "groups": 2, "kwargs": {"length": 3}},
            {"name": "addition", "groups": 2},
        ],
        "rollout": {"num_env_groups": 4, "group_size": 2, "batch_groups": 2},
        "tasks": {"reverse-3": {"ratio": 1}, "addition": {"ratio": 1}},
    }
    raw.update(over)
    return raw


def problems(raw):
    from rollart.config import ConfigError, validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    return err.value.problems


def test_tasks_config_gives_quotas_sampling_and_reward_per_tag():
    from rollart.config import validate_config

    cfg = validate_config(
        multi_config(
            sampling={"temperature": 1.0, "max_new_tokens": 8, "top_p": 0.9},
            reward={"url": "http://127.0.0.1:9/rewards/all"},
            tasks={
                "reverse-3": {"ratio": 1, "sampling": {"temperature": 0.0, "max_new_tokens": 2}},
                "addition": {"ratio": 1, "reward": {"url": "http://127.0.0.1:9/rewards/math"}},
            },
        )
    )
    assert cfg.task_quotas() == {"reverse-3": 1, "addition": 1}
    rev, add = cfg.task_sampling("reverse-3"), cfg.task_sampling("addition")
    assert (rev.temperature, rev.max_new_tokens, rev.top_p) == (0.0, 2, 0.9)
    assert (add.temperature, add.max_new_tokens) == (1.0, 8)
    assert cfg.task_reward("addition").url.endswith("/math") and cfg.task_reward("reverse-3").url.endswith("/all")
    assert validate_config(multi_config(tasks={})).task_quotas() is None


def test_bad_tasks_config_names_the_field_and_the_fix():
    msg, *more = problems(multi_config(tasks={"reverse": {"ratio": 1}, "addition": {"ratio": 1}}))
    assert msg.startswith("tasks.reverse: no env or data task has tag 'reverse'") and "'reverse-3'" in msg
    assert more == [
        "tasks: ratio is set for ['addition'] but not for ['reverse-3']; give every task tag a share of "
        "the batch (e.g. tasks: {reverse-3: {ratio: 1}}) or remove ratio everywhere"
    ]
    [msg] = problems(multi_config(tasks={"reverse-3": {"ratio": 1}, "addition": {"ratio": 2}}))
    assert "rollout.batch_groups=2" in msg and "multiple of 3" in msg
    [msg] = problems(multi_config(tasks={"reverse-3": {"ratio": 1}}))
    assert (
        msg.startswith("tasks: ratio is set for ['reverse-3'] but not for ['addition']")
        and "addition: {ratio: 1}" in msg
    )
    envs = multi_config()["envs"]
    envs[0]["max_new_tokens"] = 3
    [msg] = problems(multi_config(envs=envs, tasks={"reverse-3": {"sampling": {"max_new_tokens": 2}}}))
    assert msg == "envs[0].max_new_tokens and tasks.reverse-3.sampling.max_new_tokens are both set; keep one of them"
    [msg] = problems(
        multi_config(
            reward={"url": "http://127.0.0.1:9/a", "on_failure": "drop"},
            tasks={"addition": {"reward": {"url": "http://127.0.0.1:9/b"}}},
        )
    )
    assert msg.startswith("tasks.*.reward.on_failure") and "same on_failure" in msg
    # with another field's error the ratio check is still reported (all problems at once)
    found = problems(multi_config(steps=0, tasks={"reverse-3": {"ratio": 1}, "addition": {"ratio": 2}}))
    assert any(p.startswith("steps") for p in found) and any("multiple of 3" in p for p in found)
    # a ratio that is not positive, or a misspelt field, is the field's own error
    [msg] = problems(multi_config(tasks={"reverse-3": {"ratio": 0}, "addition": {"ratio": 1}}))
    assert msg.startswith("tasks.reverse-3.ratio")
    [msg] = problems(multi_config(tasks={"addition": {"sampling": {"temprature": 0.5}}}))
    assert msg.startswith("tasks.addition.sampling.temprature: unknown key; did you mean 'temperature'?")


def test_the_documented_multi_task_config_validates_as_written():
    import re
    from pathlib import Path

    import yaml

    from rollart.config import validate_config

    page = (Path(__file__).resolve().parents[1] / "docs" / "pipelines.md").read_text()
    section = page.split("## Multi-task jobs (`tasks:`)", 1)[1]
    raw = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    raw["pools"] = {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}}
    cfg = validate_config(raw)
    assert cfg.task_quotas() == {"reverse-3": 2, "addition": 2}
    assert cfg.task_sampling("addition").temperature == 0.7 and cfg.task_sampling("reverse-3").max_new_tokens == 3
    assert cfg.task_reward("addition").url.endswith("/addition") and cfg.task_reward("reverse-3").url.endswith(
        "/reverse"
    )
    raw["tasks"]["addition"]["ratio"] = 2
    [msg] = problems(raw)
    assert "multiple of 3" in msg
