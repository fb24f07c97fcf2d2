"""A multi-task job end to end on a local Ray with the tiny model (issue #14, RollArt paper §7.1): batch
ratio 1:1 while one task is over ten times slower than the other, a reward service for one task only,
generation settings per task, and the per-task metrics in metrics.jsonl. One run for the module."""

import json
from collections import defaultdict

import pytest

from rollart.config import validate_config
from rollart.pipelines.agentic import AgenticPipeline

pytestmark = pytest.mark.timeout(600)

DELAY_S = 1.0  # before every step of the slow task (a fast reverse-3 episode takes well under 0.1 s here)
STEPS = 5
FAST, SLOW = "reverse-3", "slow-reverse-3"


@pytest.fixture(scope="module")
def run(ray_local, tmp_path_factory):
    from reward_fixtures import ThreadServer

    from rollart.reward.server import build_app

    seen: list[str] = []

    def const(traj):  # the slow task's reward service: a score no reverse-3 answer can get from the env
        seen.append(traj["tag"])
        return 0.25

    tmp = tmp_path_factory.mktemp("multitask")
    with ThreadServer(build_app({"const": const})) as srv:
        cfg = validate_config(
            {
                "name": "mt",
                "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
                "envs": [
                    {"name": "reverse", "groups": 2, "kwargs": {"length": 3}},
                    {
                        "name": "multitask_envs:SlowReverse",
                        "groups": 2,
                        "kwargs": {"length": 3, "step_delay_s": DELAY_S},
                    },
                ],
                "rollout": {"num_env_groups": 4, "group_size": 2, "batch_groups": 2, "alpha": 1},
                "tasks": {
                    FAST: {"ratio": 1, "sampling": {"temperature": 0.0}},
                    SLOW: {
                        "ratio": 1,
                        "reward": {"url": srv.url("/rewards/const"), "retries": 1},
                        "sampling": {"max_new_tokens": 2},
                    },
                },
                "sampling": {"temperature": 1.0, "max_new_tokens": 3},
                "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
                "train": {"lr": 0.001},
                "steps": STEPS,
                "export": {"hf": False},
                "output_dir": str(tmp / "run"),
                "cluster": {"metadata_store": str(tmp / "meta.sqlite")},
            }
        )
        pipe = AgenticPipeline(cfg, progress=False)
        try:
            history = pipe.run()
        finally:
            pipe.shutdown()
    return pipe, history, seen


def test_the_batch_ratio_holds_at_every_step_while_one_task_is_ten_times_slower(run):
    pipe, history, _ = run
    assert [h["groups_by_tag"] for h in history] == [{FAST: 1, SLOW: 1}] * STEPS
    slow = [h["by_tag"][SLOW]["trajectory_s_mean"] for h in history]
    fast = [h["by_tag"][FAST]["trajectory_s_mean"] for h in history]
    assert min(slow) >= DELAY_S  # the slow task really is slow (its env step alone takes DELAY_S)
    print(f"mean trajectory time: fast {sum(fast) / len(fast):.3f} s, slow {sum(slow) / len(slow):.3f} s")
    # the fast task's extra finished groups waited in the buffer for later batches, within the α bound
    assert max(h["by_tag"][FAST]["held_back_groups"] for h in history) >= 1
    assert all(h["max_staleness"] <= 1 and h["by_tag"][t]["max_staleness"] <= 1 for h in history for t in (FAST, SLOW))
    trained = [g for h in history for g in h["groups"]]
    assert len(trained) == len(set(trained)) == 2 * STEPS
    assert pipe.scheduler.counts.get("rounds_trained_twice", 0) == 0


def test_each_task_has_its_reward_and_generation_settings(run):
    pipe, history, seen = run
    # the slow task is scored by its reward service, the fast one by its env (k/3 for k right letters)
    assert set(seen) == {SLOW} and len(seen) >= 2 * STEPS
    for h in history:
        assert h["by_tag"][SLOW]["reward_min"] == h["by_tag"][SLOW]["reward_max"] == 0.25
        assert h["by_tag"][FAST]["reward_mean"] != 0.25
        assert h["by_tag"][SLOW]["response_length_mean"] <= 2  # tasks.SLOW.sampling.max_new_tokens
    # the fast task samples greedily (temperature 0): the members of a group answer the same
    answers = defaultdict(set)
    for t in pipe.scheduler.completed_trajectories:
        if t.tag == FAST and t.status == "ok":
            answers[t.group_id].add(tuple(t.token_ids))
    assert answers and all(len(a) == 1 for a in answers.values())


def test_metrics_jsonl_has_every_metric_per_task(run):
    pipe, history, _ = run
    lines = [json.loads(x) for x in pipe.metrics_path.read_text().splitlines()]
    assert len(lines) == STEPS
    for line in lines:
        for tag in (FAST, SLOW):
            m = line["by_tag"][tag]
            assert m["groups"] == 1 and m["trajectories"] == 2 and m["quota"] == 1 and m["tokens"] > 0
            assert {"reward_mean", "response_length_mean", "staleness", "held_back_groups", "aborted"} <= set(m)
            assert sum(m["staleness"].values()) == 1
        assert set(line["reward_by_tag"]) == {FAST, SLOW}
