"""Colocated (time-shared) mode: ``pools: {rollout: {colocate_with: train}}`` runs the trainer and the engine
in one worker per train rank, taking turns on its devices.

What a user relies on: the config errors name the field and the fix before anything starts; the torch
engine really frees its KV cache (and, at level 2, its weights) while asleep and serves the weights it is
woken with; a one-device config runs where separate pools are refused; every step's recorded intervals
show generation and training never overlap on a rank, with the engine's KV cache at 0 bytes while the
trainer steps; and the shipped colocated quickstart learns reverse-3 (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollart.config import ConfigError, validate_config
from rollart.engines.base import EngineRequest, SamplingParams
from rollart.engines.torch_engine import TorchEngine
from rollart.models import build_tiny
from rollart.resource_manager.specs import ResourceSpecError, parse_pools

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART_STEPS = 300  # at most; the quickstart reaches a 20-step mean of 0.9 at step 209-252 (docs/benchmarks.md)
COLOCATED = {"train": {"hardware": "H800", "devices": 1}, "rollout": {"colocate_with": "train"}}


def raw_config(**over):
    raw = {
        "pools": COLOCATED,
        "envs": [{"name": "reverse", "groups": 2, "kwargs": {"length": 3}}],
        "rollout": {"num_env_groups": 2, "group_size": 2, "batch_groups": 2},
    }
    raw.update(over)
    return raw


def problems(**over) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(raw_config(**over))
    return "\n".join(err.value.problems)


# ---------------------------------------------------------------------- config
def test_a_colocated_pool_shares_the_owners_groups_and_reserves_nothing_of_its_own():
    specs = parse_pools({"train": {"hardware": "H100", "devices": 2}, "rollout": {"colocate_with": "train"}})
    assert specs["rollout"].colocate_with == "train" and specs["rollout"].groups == specs["train"].groups
    assert specs["train"].colocate_with is None and list(specs) == ["train", "rollout"]
    cfg = validate_config(raw_config())
    assert cfg.colocated and cfg.weights.channel == "inprocess" and cfg.engine.sleep_level == 2
    separate = validate_config(raw_config(pools={**COLOCATED, "rollout": {"hardware": "H800", "devices": 1}}))
    assert not separate.colocated and separate.weights.channel == "ray"


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        (
            {"train": {"hardware": "H800", "devices": 1}, "rollout": {"colocate_with": "trian"}},
            "pools.rollout.colocate_with: 'trian' is not a pool; name one of ['train']",
        ),
        (
            {"train": {"hardware": "H800", "devices": 1}, "rollout": {"colocate_with": "rollout"}},
            "pools.rollout.colocate_with: 'rollout' names this pool itself",
        ),
        (
            {"train": {"hardware": "H800", "devices": 1}, "rollout": {"colocate_with": "train", "devices": 1}},
            "pools.rollout: colocate_with shares the devices of pool 'train', so ['devices'] cannot be given with it",
        ),
        (
            {"train": {"hardware": "H800", "devices": 1}, "rollout": {"colocate_with": "train", "hardware": "H800"}},
            "so ['hardware'] cannot be given with it",
        ),
        (
            {"train": {"hardware": "H800", "devices": 1}, "rollout": [{"colocate_with": "train"}]},
            "pools.rollout: colocate_with shares another pool's devices and goes alone, not in a list",
        ),
        (
            {
                "train": {"hardware": "H800", "devices": 1},
                "rollout": {"colocate_with": "x"},
                "x": {"colocate_with": "train"},
            },
            "pools.rollout.colocate_with: pool 'x' has no devices of its own (it colocates with 'train'); name 'train'",
        ),
        (
            {"train": {"hardware": "H800", "devices": 1}, "rollout": {"colocate_with": 3}},
            "pools.rollout.colocate_with: the name of another pool",
        ),
    ],
)
def test_bad_colocate_with_names_the_pool_and_the_fix(pools, message):
    assert message in problems(pools=pools)
    with pytest.raises(ResourceSpecError, match="colocate_with"):
        parse_pools(pools)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"rollout": {"num_env_groups": 2, "group_size": 2, "batch_groups": 2, "alpha": 1}},
            "rollout.alpha: 1 is not supported in colocated mode (pools.rollout: {colocate_with: train}), which "
            "supports alpha 0 only",
        ),
        ({"weights": {"channel": "ray"}}, "weights.channel: 'ray' does not apply in colocated mode"),
        ({"weights": {"channel": "mooncake"}}, "weights.channel: 'mooncake' does not apply in colocated mode"),
        ({"engine": {"kind": "sglang"}}, "engine.kind: 'sglang' has no sleep mode, which colocated mode"),
        ({"engine": {"kind": "simulated"}}, "engine.kind: 'simulated' has no sleep mode"),
        ({"train": {"strategy": "megatron"}}, "train.strategy: 'megatron' is not supported in colocated mode"),
        (
            {"fault": {"inference": {"max_restarts": 1}}},
            "fault.inference: in colocated mode (pools.rollout: {colocate_with: train}) the engines live in",
        ),
        (
            {"engine": {"kind": "vllm"}, "pools": {**COLOCATED, "train": {"hardware": "H800", "devices": 2}}},
            "engine.kind: vllm in colocated mode (pools.rollout: {colocate_with: train}) needs a one-device train "
            "pool (2 here)",
        ),
        (
            {"pools": {**COLOCATED, "env": {"colocate_with": "train"}}},
            "pools.env.colocate_with: only the rollout pool (rollout_pool: 'rollout') can share devices, with the "
            "train pool ('train')",
        ),
        (
            {"pools": {**COLOCATED, "other": {"hardware": "H20", "devices": 1}, "rollout": {"colocate_with": "other"}}},
            "pools.rollout.colocate_with: the rollout colocates with the trainer; name the train pool 'train'",
        ),
        (
            {
                "pools": {"train": {"hardware": "H800", "devices": 1}, "rollout": {"hardware": "H20", "devices": 1}},
                "weights": {"channel": "inprocess"},
            },
            "weights.channel: inprocess moves the weights inside a colocated rank; it needs pools.rollout: "
            "{colocate_with: train}",
        ),
    ],
)
def test_what_colocated_mode_cannot_run_is_refused_by_name_before_anything_starts(over, message):
    assert message in problems(**over)


def test_an_engine_class_without_sleep_is_refused_and_one_with_it_accepted(tmp_path, monkeypatch):
    (tmp_path / "my_engines.py").write_text(
        textwrap.dedent(
            """
            from rollart.engines.torch_engine import TorchEngine
            from rollart.engines.simulated import SimulatedEngine
            class Sleepless(SimulatedEngine):
                pass
            class Sleeper(TorchEngine):
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "engine.kind: my_engines:Sleepless does not implement sleep and wake_up" in problems(
        engine={"kind": "my_engines:Sleepless"}
    )
    assert validate_config(raw_config(engine={"kind": "my_engines:Sleeper"})).colocated


# ---------------------------------------------------------------------- the torch engine's sleep
def _greedy(engine: TorchEngine, prompts: list[list[int]], tag: str, n: int = 6) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_new_tokens=n)))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.output_token_ids for o in engine.step()})
    return done


def test_torch_engine_sleep_frees_the_cache_and_weights_and_wakes_with_the_weights_given(tmp_path):
    path = build_tiny(
        tmp_path / "tiny", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64
    )
    prompts = [[1, 5, 6, 7], [1, 9, 8, 7, 6, 5], [1, 11]]
    engine = TorchEngine(str(path))
    other = {k: v * 1.7 for k, v in engine.model.state_dict().items()}  # different weights, same names
    reference = TorchEngine(str(path))
    reference.update_weights(other, 1)
    expected_other = _greedy(reference, prompts, "x")
    before = _greedy(engine, prompts, "a")

    engine.add_request(EngineRequest("busy", prompts[0], SamplingParams(temperature=0.0, max_new_tokens=20)))
    engine.step()
    engine.step()
    awake = engine.memory()
    assert awake.kv_cache_bytes > 0 and awake.kv_cache_peak_bytes >= awake.kv_cache_bytes and awake.weight_bytes > 0
    with pytest.raises(RuntimeError, match="requests are still in the engine"):
        engine.sleep(2)
    engine.abort("busy")

    engine.sleep(2)
    asleep = engine.memory()
    assert (asleep.sleep_level, asleep.kv_cache_bytes, asleep.weight_bytes) == (2, 0, 0)
    assert all(p.numel() == 0 for p in engine.model.parameters())  # the storage itself is gone
    with pytest.raises(RuntimeError, match="the engine is asleep"):
        engine.add_request(EngineRequest("late", prompts[0], SamplingParams(max_new_tokens=2)))
    with pytest.raises(ValueError, match="the weights were freed by sleep"):
        engine.wake_up()
    bad = dict(other)
    bad.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing"):
        engine.wake_up(bad, 1)
    assert engine.memory().sleep_level == 2  # a refused state dict leaves it asleep

    engine.wake_up(other, 1)
    woken = engine.memory()
    assert (woken.sleep_level, woken.weight_bytes, engine.weight_version) == (0, awake.weight_bytes, 1)
    assert _greedy(engine, prompts, "x") == expected_other != {f"x{i}": t for i, t in enumerate(before.values())}

    engine.sleep(1)  # level 1: the KV cache only, the weights stay
    assert engine.memory().weight_bytes == awake.weight_bytes and engine.memory().kv_cache_bytes == 0
    engine.wake_up()
    assert _greedy(engine, prompts, "x") == expected_other


# ---------------------------------------------------------------------- runs
def assert_turns_taken(records: list[dict], ranks: int, level: int = 2) -> None:
    """From each step's recorded intervals: on every rank the engine generated only while awake, the
    trainer trained only while the engine slept, the two never overlapped; the KV cache was 0 bytes (and at
    level 2 the engine's weights too) while the trainer stepped, after a rollout that held a cache."""
    for rec in records:
        col = rec["colocated"]
        assert len(col["ranks"]) == ranks, rec["step"]
        for r in col["ranks"]:
            slept, woke = r["asleep"]
            assert r["train"] and all(slept <= t0 < t1 <= woke for t0, t1 in r["train"]), (rec["step"], r)
            assert r["generate"] and all(g1 <= slept for _, g1 in r["generate"]), (rec["step"], r)
            spans = sorted([*r["generate"], *r["train"]])
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (rec["step"], spans)
            training = r["engine_training"]
            assert training["sleep_level"] == level and training["kv_cache_bytes"] == 0, (rec["step"], training)
            assert training["weight_bytes"] == 0 if level == 2 else training["weight_bytes"] > 0
            assert r["engine_generating"]["kv_cache_peak_bytes"] > 0 and r["engine_generating"]["sleep_level"] == 0
    for prev, nxt in zip(records, records[1:]):  # the next rollout starts after the engine woke
        for a, b in zip(prev["colocated"]["ranks"], nxt["colocated"]["ranks"]):
            assert a["asleep"][1] <= b["generate"][0][0], (prev["step"], a["asleep"], b["generate"])


def test_two_colocated_ranks_take_turns_with_their_engines_every_step(ray_local, tmp_path):
    """Two ranks (DDP over gloo), each holding its trainer and its engine on one logical H800."""
    from rollart.config import PipelineConfig
    from rollart.pipelines.agentic import AgenticPipeline

    cfg = PipelineConfig.model_validate(
        {
            "name": "colocated",
            "pools": {"train": {"hardware": "H800", "devices": 2}, "rollout": {"colocate_with": "train"}},
            "envs": [{"name": "reverse", "groups": 4, "kwargs": {"length": 3}}],
            "rollout": {"num_env_groups": 4, "group_size": 4, "batch_groups": 3},
            "sampling": {"temperature": 1.0, "max_new_tokens": 3, "seed": 0},
            "advantage": "grpo_token",
            "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
            "steps": 3,
            "checkpoint_every": 0,
            "output_dir": str(tmp_path / "run"),
            "cluster": {"metadata_store": str(tmp_path / "meta.sqlite")},
        }
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        assert pipe.train is pipe.infer and pipe.train.world_size == 2 and pipe.weights.kind == "inprocess"
        pipe.run()
        served = pipe.proxy.version
    finally:
        pipe.shutdown()
    records = pipe.step_records()
    assert [r["version"] for r in records] == [1, 2, 3] and served == 3
    assert_turns_taken(records, ranks=2)
    # both ranks generated (the proxy routes by tag over the Cluster that also trains)
    assert sum(records[-1]["hardware_by_tag"]["reverse-3"].values()) == 12
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert ledger["lost"] == 0 and ledger["trained"] == 3 * 3 * 4, ledger


def test_colocated_and_separate_pools_learn_the_same_policy_step_for_step(ray_local, tmp_path):
    """Seeded, the colocated run (the engine woken with its trainer's weights in-process) and the run with
    a rollout pool of its own (weights through the ``ray`` channel) log the same rewards, gradient norms and
    entropies at every step: the engine serves exactly the trainer's weights of each version."""
    from rollart.config import PipelineConfig
    from rollart.pipelines.agentic import AgenticPipeline

    runs = {}
    for name, rollout in (("colocated", {"colocate_with": "train"}), ("separate", {"hardware": "H800", "devices": 1})):
        cfg = PipelineConfig.model_validate(
            {
                "name": name,
                "pools": {"train": {"hardware": "H800", "devices": 1}, "rollout": rollout},
                "envs": [{"name": "reverse", "groups": 4, "kwargs": {"length": 3}}],
                "rollout": {"num_env_groups": 4, "group_size": 4, "batch_groups": 4, "alpha": 0},
                "sampling": {"temperature": 1.0, "max_new_tokens": 3, "seed": 0},
                "advantage": "grpo_token",
                "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
                "train": {"lr": 0.01},
                "steps": 4,
                "checkpoint_every": 0,
                "output_dir": str(tmp_path / name),
                "cluster": {"metadata_store": str(tmp_path / "meta.sqlite")},
            }
        )
        assert cfg.colocated == (name == "colocated")
        pipe = AgenticPipeline(cfg, progress=False)
        try:
            pipe.run()
        finally:
            pipe.shutdown()
        runs[name] = pipe.step_records()
    colocated, separate = runs["colocated"], runs["separate"]
    assert "colocated" not in separate[0] and len(colocated) == len(separate) == 4
    assert [r["reward_mean"] for r in colocated] == [r["reward_mean"] for r in separate]
    for key in ("grad_norm", "entropy"):
        assert [r["train"][key] for r in colocated] == [r["train"][key] for r in separate], key
    assert len({r["train"]["entropy"] for r in colocated}) == 4  # the policy moved: each step served new weights


ONE_DEVICE = """
import json, sys
from rollart.config import load_config
from rollart.resource_manager import ResourceManager
from rollart.resource_manager.launcher import ensure_ray
from rollart.resource_manager.specs import ResourceSpecError
from rollart.pipelines.agentic import AgenticPipeline

out = {}
ensure_ray({"H100": 1, "CPU": 2})  # one logical H100, as cluster.local_resources declares it
try:
    ResourceManager({"train": {"hardware": "H100", "devices": 1}, "rollout": {"hardware": "H100", "devices": 1}})
except ResourceSpecError as err:
    out["separate"] = str(err)
cfg = load_config(sys.argv[1])
pipe = AgenticPipeline(cfg, progress=False)
try:
    out["pools"] = {n: s.colocate_with for n, s in pipe.rm.specs.items()}
    out["reserved"] = sorted(pipe.rm.groups)
    pipe.run()
finally:
    pipe.shutdown()
out["records"] = pipe.step_records()
print(json.dumps(out))
"""


def test_one_device_runs_colocated_where_separate_pools_are_refused(tmp_path):
    """``train: {hardware: H100, devices: 1}`` and ``rollout: {colocate_with: train}`` on a Ray that has one
    (logical) H100: the same devices asked for twice are refused, colocated they train."""
    config = tmp_path / "one.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            name: one-device
            cluster: {{local_resources: {{H100: 1, CPU: 2}}, metadata_store: {tmp_path / "meta.sqlite"}}}
            pools:
              train: {{hardware: H100, devices: 1}}
              rollout: {{colocate_with: train}}
            envs: [{{name: reverse, groups: 2, kwargs: {{length: 3}}}}]
            rollout: {{num_env_groups: 2, group_size: 4, batch_groups: 2}}
            sampling: {{max_new_tokens: 3, seed: 0}}
            tiny_model: {{hidden_size: 32, num_layers: 1, intermediate_size: 64}}
            engine: {{sleep_level: 1}}
            steps: 2
            checkpoint_every: 0
            output_dir: {tmp_path / "run"}
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", ONE_DEVICE, str(config)],
        capture_output=True,
        text=True,
        timeout=800,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "ask for 2 H100 devices but the cluster has 1 free of 1" in out["separate"]
    assert out["pools"] == {"train": None, "rollout": "train"} and out["reserved"] == ["train"]
    assert [r["step"] for r in out["records"]] == [1, 2]
    assert_turns_taken(out["records"], ranks=1, level=1)
    assert {r["colocated"]["ranks"][0]["engine_training"]["weight_bytes"] for r in out["records"]} != {0}


def trailing_mean(values: list[float], window: int = 20) -> list[float]:
    return [
        sum(values[max(0, i + 1 - window) : i + 1]) / len(values[max(0, i + 1 - window) : i + 1])
        for i in range(len(values))
    ]


@pytest.mark.slow
def test_the_colocated_quickstart_learns_reverse_3_with_generation_and_training_taking_turns(tmp_path):
    """``rollart run quickstart_colocated`` as ``scripts/gpu_check.sh`` runs it (here its one GPU is a logical
    device, the rank runs on the CPU): the 20-step mean reward reaches 0.9 (``stop_at`` ends the run there),
    and on every step of the run the recorded intervals show the engine and the trainer took turns, the
    cache freed while training."""
    out = tmp_path / "run"
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollart.cli",
            "run",
            str(ROOT / "pipelines" / "quickstart_colocated.yaml"),
            "--json",
            "--set",
            f"steps={QUICKSTART_STEPS}",
            "--set",
            "checkpoint_every=0",
            "--set",
            "stop_at.reward_mean=0.9",
            "--set",
            f"output_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    smooth = trailing_mean([r["reward_mean"] for r in records])
    summary = json.loads(proc.stdout)
    assert summary["stopped_at"] is not None, f"0.9 not reached in {QUICKSTART_STEPS} steps: best {max(smooth)}"
    # the run ended at the first step whose 20-step mean reached 0.9
    assert [r["step"] for r in records] == list(range(1, summary["stopped_at"] + 1))
    assert smooth[-1] >= 0.9 and all(m < 0.9 for m in smooth[19:-1]), smooth[-3:]
    assert {hw for r in records for hw in r["hardware_by_tag"]["reverse-3"]} == {"GPU"}  # the train pool's
    assert_turns_taken(records, ranks=1, level=2)
