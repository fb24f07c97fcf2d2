"""Bring your own data (rollart.data): datasets from JSONL, Parquet and save_to_disk folders, verifiers
from the user's module or built in, errors at config load that name the field, the epoch sampler (every
prompt once per epoch, a resumed run continues at the same positions) and the pass@k estimator."""

from __future__ import annotations

import asyncio
import itertools
import json
import textwrap
from pathlib import Path

import pytest

from rollart.config import ConfigError, PipelineConfig, load_config
from rollart.data import DataTask, EpochSampler, EvalConfig, RoundSeeds, load_rows, pass_at_k, summarise
from rollart.data.prompts import load_prompts
from rollart.pipelines.data_tasks import DataTasks, eval_sets
from rollart.rollout.config import RolloutConfig
from rollart.rollout.scheduler import RolloutScheduler
from rollart.rollout.types import Trajectory

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 3} for a in range(4) for b in range(3)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def base_yaml(**extra: str) -> str:
    lines = [
        "pools: {train: {hardware: CPU, cpus: 1}, rollout: {hardware: CPU, cpus: 1}}",
        "rollout: {num_env_groups: 2, group_size: 2, batch_groups: 2}",
    ]
    return "\n".join(lines + [f"{k}: {v}" for k, v in extra.items()]) + "\n"


# ---------------------------------------------------------------- formats


def test_jsonl_parquet_and_save_to_disk_folders_give_the_same_rows(tmp_path):
    import datasets

    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS)
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(3))}).save_to_disk(str(tmp_path / "dict"))
    for path in (jsonl, tmp_path / "a.parquet", tmp_path / "saved", tmp_path / "dict"):
        rows = load_rows(path, field="data[0].train")
        assert [dict(rows[i]) for i in range(len(rows))] == ROWS, path
    val = load_rows(tmp_path / "dict", field="data[0].val", splits=("validation", "test"))
    assert [dict(r) for r in val] == ROWS[:3]
    with pytest.raises(ValueError, match=r"data\[0\].val: .* splits \['train', 'validation'\], none of \['test'\]"):
        load_rows(tmp_path / "dict", field="data[0].val", splits=("test",))


def test_a_task_plays_prompts_with_the_system_prompt_and_scores_with_its_verifier(tmp_path):
    write_jsonl(tmp_path / "arith.jsonl", ROWS)
    task = DataTask(train=str(tmp_path / "arith.jsonl"), system_prompt="add:", verifier="number")
    prompts = load_prompts(task, "data[0]")
    assert prompts.tag == "arith" and len(prompts) == len(ROWS)
    row = prompts.row(5)
    assert prompts.prompt(row) == f"add:\n{row['prompt']}"
    assert prompts.score(f"it is {row['answer']}", row) == 1.0 and prompts.score("nope", row) == 0.0


# ---------------------------------------------------------------- config errors


def test_missing_file_and_column_are_config_errors_naming_the_field(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(base_yaml(data="{train: nowhere.jsonl, groups: 2}"))
    with pytest.raises(ConfigError, match=r"data\[0\].train: .*nowhere.jsonl does not exist"):
        load_config(cfg)
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    cfg.write_text(base_yaml(data="{train: a.jsonl, groups: 2, prompt_key: question}"))
    with pytest.raises(ConfigError, match=r"data\[0\].prompt_key: 'question' is not a column of .*a.jsonl"):
        load_config(cfg)
    cfg.write_text(base_yaml(data="[{train: a.jsonl, answer_key: sol}, {train: a.jsonl, tag: b}]"))
    with pytest.raises(ConfigError, match=r"data\[0\].answer_key: 'sol' is not a column"):
        load_config(cfg)
    cfg.write_text(base_yaml(data="[{train: a.jsonl}, {train: a.jsonl}]"))
    with pytest.raises(ConfigError, match=r"data\[1\].tag: 'a' is the tag of data\[0\] too"):
        load_config(cfg)
    cfg.write_text(base_yaml(data="{train: a.jsonl, groups: 3}"))
    with pytest.raises(ConfigError, match=r"envs\[\*\].groups \+ data\[\*\].groups add up to 3"):
        load_config(cfg)
    cfg.write_text(base_yaml(data="{train: a.jsonl, groups: 2}", eval="{every: 2}"))
    with pytest.raises(ConfigError, match="eval: nothing to evaluate"):
        load_config(cfg)
    cfg.write_text(
        base_yaml(data="{train: a.jsonl, groups: 2}", eval="{data: a.jsonl, samples_per_prompt: 2, pass_k: [4]}")
    )
    with pytest.raises(ConfigError, match=r"eval.pass_k: 4 needs 1 <= k <= samples_per_prompt=2"):
        load_config(cfg)
    cfg.write_text(base_yaml())
    with pytest.raises(ConfigError, match="no task to train on"):
        load_config(cfg)


def test_verifier_errors_name_the_field_and_the_fix(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "scorers_ok.py").write_text("def exact(completion, answer, **row):\n    return completion == answer\n")
    (tmp_path / "scorers_bad.py").write_text("def one_arg(completion):\n    return 1.0\n")
    cfg = tmp_path / "c.yaml"
    cases = {
        "no_such_module:score": r"data\[0\].verifier: no module named 'no_such_module' .*put no_such_module.py next to",
        "scorers_ok:missing": r"data\[0\].verifier: scorers_ok .* has no function 'missing' \(it has \['exact'\]\)",
        "scorers_bad:one_arg": r"data\[0\].verifier: scorers_bad:one_arg must accept \(completion, answer, \*\*row\)",
        "fuzzy": r"data\[0\].verifier: 'fuzzy' is not a built-in verifier .*MODULE:FUNC",
        "nofile.py:f": r"data\[0\].verifier: verifier file .*nofile.py does not exist",
    }
    for spec, message in cases.items():
        cfg.write_text(base_yaml(data=f"{{train: a.jsonl, groups: 2, verifier: '{spec}'}}"))
        with pytest.raises(ConfigError, match=message):
            load_config(cfg)
    # a module next to the config imports (the config's folder is importable), so does a file path
    for spec in ("scorers_ok:exact", "scorers_ok.py:exact", "exact_match", "addition"):
        cfg.write_text(base_yaml(data=f"{{train: a.jsonl, groups: 2, verifier: '{spec}'}}"))
        loaded = load_config(cfg)
        assert Path(loaded.data[0].train).is_absolute() and loaded.data[0].tag == "a"
        prompts = load_prompts(loaded.data[0], "data[0]")
        assert prompts.score("2", {"prompt": "1+1=", "answer": "2", "level": 0}) == 1.0


def test_the_verifier_gets_the_other_columns_it_asks_for(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "by_level.py").write_text(
        textwrap.dedent(
            """
            def named(completion, answer, level):
                return float(level)

            def everything(completion, answer, **row):
                assert set(row) == {"prompt", "level"}, row
                return 0.5
            """
        )
    )
    for func, expected in (("named", 2.0), ("everything", 0.5)):
        task = DataTask(train=str(tmp_path / "a.jsonl"), verifier=f"{tmp_path / 'by_level.py'}:{func}")
        prompts = load_prompts(task, "data[0]")
        assert prompts.score("x", {"prompt": "p", "answer": "1", "level": 2}) == expected


def test_data_is_one_task_or_a_list():
    common = {"pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}}}
    one = PipelineConfig.model_validate(
        {**common, "data": {"train": "x.jsonl", "groups": 2}, "rollout": {"num_env_groups": 2, "batch_groups": 2}}
    )
    assert [t.name for t in one.data] == ["x"]
    two = PipelineConfig.model_validate(
        {
            **common,
            "data": [{"train": "d/x.parquet", "groups": 2}, {"train": "y.jsonl", "tag": "code"}],
            "envs": [{"name": "reverse"}],
            "rollout": {"num_env_groups": 4, "batch_groups": 2},
        }
    )
    assert [t.name for t in two.data] == ["x", "code"]


# ---------------------------------------------------------------- sampler


def test_every_epoch_is_a_fresh_permutation_of_every_prompt():
    n = 7
    s = EpochSampler(n, seed=3)
    epochs = [[s.index(e * n + i) for i in range(n)] for e in range(4)]
    assert all(sorted(ep) == list(range(n)) for ep in epochs)
    assert len({tuple(ep) for ep in epochs}) > 1  # reshuffled per epoch
    assert s.epoch == 4.0 and s.next_position == 4 * n
    again = EpochSampler(n, seed=3)
    assert [again.index(p) for p in reversed(range(4 * n))] == [x for ep in epochs for x in ep][::-1]  # any order
    other = EpochSampler(n, seed=4)
    assert [other.index(p) for p in range(n)] != epochs[0]
    assert [EpochSampler(n, shuffle=False).index(p) for p in range(2 * n)] == list(range(n)) * 2
    with pytest.raises(ValueError, match="6 rows and seed 3, the checkpoint's sampler 7 rows"):
        EpochSampler(6, seed=3).load_state_dict(s.state_dict(), what="data task 'x'")


class RecordingManager:
    """Stands in for an EnvManager: resets its DatasetEnv with the round's seed, records the prompt."""

    def __init__(self, env, played, version_fn):
        self.env, self.played, self.version_fn = env, played, version_fn

    async def run(self, seed, group_id, traj_id):
        prompt, info = self.env.reset(seed)
        if traj_id.split(":")[2] == "0":  # member 0 records the round once
            self.played.append((group_id, info["index"]))
        await asyncio.sleep(0)
        return Trajectory(
            traj_id=traj_id,
            group_id=group_id,
            tag=self.env.tag,
            reward=float(info["index"] % 2),
            start_version=self.version_fn(),
        )

    async def abort(self):
        return None


def _scheduler(tmp_path, played, run_seed=5):
    write_jsonl(tmp_path / "arith.jsonl", ROWS)
    tasks = [DataTask(train=str(tmp_path / "arith.jsonl"), groups=3)]
    seeds = RoundSeeds(run_seed)
    data = DataTasks(tasks, seeds, run_seed=run_seed, max_new_tokens=4)
    holder: list[RolloutScheduler] = []
    groups = data.groups(lambda env: RecordingManager(env, played, lambda: holder[0].version), 2, first_group=0)
    cfg = RolloutConfig(num_env_groups=3, group_size=2, batch_groups=3, alpha=0)
    holder.append(RolloutScheduler(groups, cfg, seed_fn=seeds.seed))
    return holder[0], data


async def test_dataset_groups_play_every_prompt_once_per_epoch_and_a_resumed_run_continues_there(tmp_path):
    n = len(ROWS)  # 12 prompts, 3 groups: an epoch is 4 rounds of every group

    async def run(sched, steps):
        order = {}
        sched.start()
        try:
            for _ in range(steps):
                for grp in await asyncio.wait_for(sched.get_batch(), timeout=60):
                    order[str(grp.gid)] = None
                await sched.set_version(sched.version + 1)
        finally:
            await sched.stop()
        return list(order)

    played: list = []
    sched, data = _scheduler(tmp_path, played)
    trained_gids = await run(sched, 8)  # two epochs
    index_of = dict(played)
    by_round = sorted(trained_gids, key=lambda gid: (int(gid.split(":")[1]), int(gid.split(":")[0])))
    rows = [index_of[gid] for gid in by_round]
    assert sorted(rows[:n]) == list(range(n)) and sorted(rows[n : 2 * n]) == list(range(n))
    assert rows[:n] != rows[n : 2 * n]

    # interrupted after 3 steps and resumed: the same prompts at every round as the uninterrupted run
    played_a: list = []
    sched_a, data_a = _scheduler(tmp_path, played_a)
    first = await run(sched_a, 3)
    state, data_state = json.loads(json.dumps(sched_a.state_dict())), data_a.state_dict()
    played_b: list = []
    sched_b, data_b = _scheduler(tmp_path, played_b)
    sched_b.load_state_dict(state)
    data_b.load_state_dict(data_state)
    assert data_b.samplers["arith"].next_position == data_a.samplers["arith"].next_position > 0
    second = await run(sched_b, 5)
    assert not set(first) & set(second)
    resumed = dict(played_a) | dict(played_b)
    assert {gid: resumed[gid] for gid in first + second} == {gid: index_of[gid] for gid in first + second}
    with pytest.raises(ValueError, match="no sampler of data task 'arith'"):
        data_b.load_state_dict({})


# ---------------------------------------------------------------- eval metrics


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                samples = [1] * c + [0] * (n - c)
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    m = summarise([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 1.0]], [1, 2, 4], 1.0)
    assert m["accuracy"] == pytest.approx(4 / 12) and m["mean_reward"] == pytest.approx(4.5 / 12)
    assert m["pass@1"] == pytest.approx((0.25 + 0 + 0.75) / 3) and m["pass@4"] == pytest.approx(2 / 3)
    assert m["pass@2"] == pytest.approx((0.5 + 0 + 1.0) / 3)


def test_eval_sets_from_val_splits_an_eval_file_or_an_env(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    write_jsonl(tmp_path / "a_val.jsonl", ROWS[:5])
    tasks = [DataTask(train=str(tmp_path / "a.jsonl"), val=str(tmp_path / "a_val.jsonl"))]
    (s,) = eval_sets(tasks, EvalConfig(max_prompts=3), max_new_tokens=4)
    assert s.tag == "a" and s.seeds == [0, 1, 2]
    env = s.make_env()
    assert [env.reset(i)[0] for i in s.seeds] == [r["prompt"] for r in ROWS[:3]]
    (f,) = eval_sets(tasks, EvalConfig(data=str(tmp_path / "a_val.jsonl"), max_prompts=None), max_new_tokens=4)
    assert f.seeds == list(range(5))
    (e,) = eval_sets([], EvalConfig(env={"name": "reverse", "kwargs": {"length": 3}}, max_prompts=4), max_new_tokens=4)
    assert e.tag == "reverse-3" and len(e.seeds) == 4
    with pytest.raises(ValueError, match="eval.env: env name 'nosuch' is not registered"):
        eval_sets([], EvalConfig(env={"name": "nosuch"}), max_new_tokens=4)


def test_a_verifier_that_raises_fails_the_step_and_never_scores(tmp_path):
    from rollart.envs.dataset import DatasetEnv

    write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "boom.py").write_text("def score(completion, answer):\n    raise KeyError('no judge')\n")
    task = DataTask(train=str(tmp_path / "a.jsonl"), verifier=f"{tmp_path / 'boom.py'}:score")
    env = DatasetEnv(load_prompts(task, "data[0]"), EpochSampler(len(ROWS)), max_new_tokens=3)
    prompt, info = env.reset(4)
    assert prompt == ROWS[info["index"]]["prompt"] and info["ground_truth"] == ROWS[info["index"]]["answer"]
    for _ in range(2):  # the EnvManager retries a failed step: the same error, not "episode ended"
        with pytest.raises(KeyError, match="no judge"):
            env.step("7")


async def test_the_evaluator_aggregates_per_tag_and_counts_failures(tmp_path):
    from rollart.data import EvalSet, Evaluator
    from rollart.engines.base import SamplingParams

    class Fake:
        def __init__(self, env, sampling):
            self.env, self.sampling = env, sampling

        async def run(self, seed, group_id, traj_id):
            sample = int(traj_id.rsplit(":", 1)[1])
            if self.env == "b" and seed == 1 and sample == 0:
                return Trajectory(traj_id=traj_id, group_id=group_id, tag="b", status="failed", error="x")
            reward = 1.0 if (self.env == "a" and sample < seed) else 0.25
            assert self.sampling.temperature == 0.5
            return Trajectory(traj_id=traj_id, group_id=group_id, tag=self.env, reward=reward)

    class Env(str):
        def close(self):
            return None

    sets = [EvalSet("a", lambda: Env("a"), [0, 1, 2]), EvalSet("b", lambda: Env("b"), [0, 1])]
    cfg = EvalConfig(samples_per_prompt=2, temperature=0.5, concurrency=3)
    ev = await Evaluator(cfg, sets, Fake, SamplingParams(temperature=1.0)).run(step=4)
    a, b = ev["by_tag"]["a"], ev["by_tag"]["b"]
    assert a["accuracy"] == pytest.approx(3 / 6) and a["pass@1"] == pytest.approx((0 + 0.5 + 1) / 3)
    assert a["pass@2"] == pytest.approx(2 / 3) and a["samples"] == 6
    assert b["accuracy"] == 0.0 and b["mean_reward"] == 0.25 and b["samples"] == 3 and ev["failed"] == 1
    # prompt 1 of b kept one sample: it counts for pass@1, not for pass@2
    assert b["pass@2"] == 0.0 and ev["samples"] == 9 and ev["prompts"] == 5


async def test_with_a_reward_service_a_dataset_trajectory_is_sent_with_its_answer(tmp_path):
    """The ``reward:`` section scores dataset tasks too: the service gets the prompt, the response and the
    row's answer as ``ground_truth``."""
    from rollart.envs.dataset import DatasetEnv
    from rollart.pipeline.rewards import service_reward
    from rollart.rollout.types import RewardInputs

    class Codec:
        eos_token_id = None

        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    sent = []

    class Client:
        async def score(self, payload):
            sent.append(payload)
            return 0.75

    write_jsonl(tmp_path / "a.jsonl", ROWS)
    env = DatasetEnv(load_prompts(DataTask(train=str(tmp_path / "a.jsonl")), "data[0]"), EpochSampler(len(ROWS)))
    prompt, info = env.reset(2)
    codec = Codec()
    ids = codec.encode(prompt)
    step_info = env.step("5")[4]
    traj = Trajectory(  # what the env manager records of the episode (tests/test_reward_inputs.py)
        traj_id="t",
        group_id="0:0",
        tag=env.tag,
        token_ids=[*ids, *codec.encode("5")],
        prompt_length=len(ids),
        turns=[(len(ids), len(ids) + 1)],
        scored_on=RewardInputs(
            prompt=prompt, ground_truth=info.get("ground_truth"), response=step_info.get("response")
        ),
    )
    reward = await service_reward(Client(), codec)(traj)
    row = ROWS[info["index"]]
    assert reward == 0.75
    assert sent == [{"prompt": row["prompt"], "response": "5", "ground_truth": row["answer"], "tag": "a"}]
