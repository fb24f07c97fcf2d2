"""The autopilot on a real local Ray (logical H20 devices): a job whose trainer waits for rollout, started
at one rollout device of an elastic pool of at most three, grows its pool to three by itself; each decision
is in ``elastic.jsonl`` and the step records with the measurements that made it, ``rollart jobs`` shows whose
target the pool follows, each step's record has its device-seconds, and the trajectory ledger is clean; a
seeded synchronous run's reward curve is the fixed pool's step for step while the autopilot resizes. Bad autopilot settings are refused before
anything starts. (Joins take seconds to tens of seconds of Ray start-up, so the test does not wait for
the new workers to serve.)"""

from __future__ import annotations

import json
import time

import pytest

from rollart.cli.jobs import pool_sizes
from rollart.cli.scale import scale_problem
from rollart.config import ConfigError, PipelineConfig, validate_config

pytestmark = pytest.mark.timeout(300)

STEPS = 5


def config(tmp_path, **elastic) -> dict:
    return {
        "name": "autopilot",
        "pools": {
            "train": {"hardware": "H800", "devices": 1},
            "rollout": {"hardware": "H20", "devices": 1, "max_devices": 3},
        },
        "envs": [{"name": "reverse", "groups": 4, "kwargs": {"length": 3}}],
        "rollout": {"num_env_groups": 4, "group_size": 4, "batch_groups": 4, "alpha": 0},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 0},
        # one worker decodes 4 sequences at a time, 30 ms a token: 16 trajectories take four rounds of it,
        # while the tiny model trains in a fraction of that: the trainer waits for rollout
        "engine": {"kind": "simulated", "options": {"decode_base_s": 0.03, "max_batch_size": 4}},
        "elastic": {"poll_s": 0.2, "place_timeout_s": 5.0, **elastic},
        "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
        "steps": STEPS,
        "checkpoint_every": 0,
        "output_dir": str(tmp_path / "run"),
        "cluster": {"metadata_store": str(tmp_path / "meta.sqlite")},
    }


def test_a_rollout_bound_job_grows_its_pool_by_itself(ray_local, tmp_path):
    from rollart.pipelines.agentic import AgenticPipeline

    cfg = PipelineConfig.model_validate(config(tmp_path, autoscale={"window": 2, "cooldown_steps": 1}))
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
        shown = pool_sizes({"pools": {"rollout": pipe.elastic.summary()}})
    finally:
        pipe.shutdown()
    decisions = [h["elastic"]["autopilot"] for h in history if h["elastic"]["autopilot"] is not None]
    assert decisions, [h["elastic"] for h in history]
    first = decisions[0]
    # two steps of evidence (window 2), every one of them mostly waiting for rollout
    assert (first["reason"], first["previous"], first["step"]) == ("grow", 1, 2) and first["target"] > 1, first
    assert len(first["measurements"]["wait_share"]) == 2 and min(first["measurements"]["wait_share"]) > 0.2
    assert all(d["reason"] == "grow" for d in decisions)  # it never shrank: the trainer kept waiting
    size = decisions[-1]["target"]
    assert history[-1]["elastic"]["devices"] == size and history[-1]["elastic"]["target"] == size
    # the two new workers were started at once (whether they serve yet depends on how fast Ray starts them:
    # joining itself is the elastic pool's, tests/test_elastic.py)
    assert shown.startswith(f"rollout {size}/3") and shown.endswith(f"(autopilot {size})"), shown
    events = [json.loads(line) for line in (tmp_path / "run" / "elastic.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "autopilot_on" and events[0]["target"] == 1 and events[0]["max_devices"] == 3
    assert events[0]["start_from"] == "start"  # no advise.json given: the size the job started with
    (logged,) = [e for e in events if e["event"] == "autopilot"][:1]
    assert logged["target"] == first["target"] and logged["measurements"] == first["measurements"]
    # each step's cost: the train pool's one device and the rollout pool's devices over the step's time
    first_cost, last_cost = history[0]["cost"], history[-1]["cost"]
    assert first_cost["device_s"]["train"] == pytest.approx(history[0]["time"]["step_s"], rel=1e-3)
    assert first_cost["device_s"]["rollout"] == pytest.approx(history[0]["time"]["step_s"], rel=1e-3)
    assert last_cost["device_s"]["rollout"] == pytest.approx(size * history[-1]["time"]["step_s"], rel=1e-3)
    assert last_cost["device_s_per_sample"] == pytest.approx(last_cost["device_s_total"] / 16)
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and ledger["rewards_invented"] == 0, ledger


def test_autopilot_settings_are_checked_before_anything_starts(tmp_path):
    raw = config(tmp_path, autoscale=True)
    raw["pools"]["rollout"] = {"hardware": "H20", "devices": 1}  # not elastic: nothing to size
    with pytest.raises(ConfigError, match=r"elastic\.autoscale: the rollout pool .* give pools\.rollout max_devices"):
        validate_config(raw)
    raw = config(tmp_path, autoscale={"grow_above": 0.1, "shrink_below": 0.1})
    with pytest.raises(ConfigError, match=r"elastic\.autoscale.*shrink_below \(0\.1\) must be below grow_above"):
        validate_config(raw)
    assert validate_config(config(tmp_path, autoscale=True)).elastic.autoscale.window == 3
    assert validate_config(config(tmp_path, autoscale=False)).elastic.autoscale is None


def test_rollart_scale_auto_needs_an_autopilot():
    row = {"state": "running", "elastic": {"rollout": {"devices": 2, "max_devices": 4}}}
    assert "has no autopilot; set elastic.autoscale" in scale_problem(row, "j", "rollout", None)
    row["elastic"]["rollout"]["autopilot"] = {"target": 2, "manual": 3, "yielding": False}
    assert scale_problem(row, "j", "rollout", None) is None
    assert scale_problem(row, "j", "rollout", 3) is None
    shown = pool_sizes({"pools": row["elastic"]})
    assert shown == "rollout 2/4 (manual 3; --auto hands back)"


def test_the_first_target_comes_from_rollart_advise_when_given(tmp_path):
    from rollart.rollout.config import AutoscaleConfig
    from rollart.rollout.elastic import first_target

    advice = tmp_path / "advise.json"  # as `rollart advise CONFIG --out DIR` writes it (its advice part)
    advice.write_text(
        json.dumps({"config": "autopilot", "advice": {"mode": "async", "train_devices": 1, "rollout_devices": 3}})
    )
    cfg = AutoscaleConfig(advise=str(advice))
    assert first_target(cfg, low=1, high=4, current=1, unit=1) == (3, "advise")
    assert first_target(cfg, low=1, high=2, current=1, unit=1) == (2, "advise")  # within the pool's range
    assert first_target(cfg, low=2, high=8, current=2, unit=2) == (4, "advise")  # whole workers of 2 devices
    assert first_target(AutoscaleConfig(), low=1, high=4, current=2, unit=1) == (2, "start")
    # a missing or foreign file is refused by name before anything starts
    raw = config(tmp_path, autoscale={"advise": str(tmp_path / "missing.json")})
    with pytest.raises(ConfigError, match=r"elastic\.autoscale\.advise: .*missing\.json is not an advise\.json"):
        validate_config(raw)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"run `rollart advise CONFIG --out DIR`"):
        validate_config(config(tmp_path, autoscale={"advise": str(tmp_path / "other.json")}))
    assert validate_config(config(tmp_path, autoscale={"advise": str(advice)})).elastic.autoscale.advise == str(advice)


def test_a_seeded_synchronous_run_learns_step_for_step_as_on_a_fixed_pool_while_the_autopilot_resizes(
    ray_local, tmp_path
):
    import asyncio

    from rollart.pipelines.agentic import AgenticPipeline

    class WaitsForTheNewWorkers(AgenticPipeline):
        """After its first step the run waits until the pool serves the autopilot's target, so the
        following steps are generated on more workers than the fixed run's one."""

        async def on_step_end(self, step, record, trajs):
            if self.elastic is not None and step == 0:
                deadline = time.monotonic() + 180
                while self.elastic.summary()["serving_devices"] < self.elastic.target:
                    assert time.monotonic() < deadline, "the autopilot's new workers did not serve within 180 s"
                    await asyncio.sleep(0.1)  # the elastic thread starts them meanwhile

    curves, records = {}, {}
    for name, autoscale in (("fixed", None), ("autopilot", {"grow_above": 0.01, "shrink_below": 0.0, "window": 1})):
        raw = config(tmp_path / name, **({"autoscale": {**autoscale, "cooldown_steps": 0}} if autoscale else {}))
        raw["output_dir"] = str(tmp_path / name / "run")
        raw["engine"] = {"kind": "torch"}  # seeded sampling: the same tokens on whichever worker serves
        raw["sampling"]["max_new_tokens"] = 3
        raw["train"] = {"lr": 0.02}
        raw["steps"] = 6
        if autoscale is None:
            raw["pools"]["rollout"] = {"hardware": "H20", "devices": 1}
        pipe = WaitsForTheNewWorkers(PipelineConfig.model_validate(raw), progress=False)
        try:
            history = pipe.run()
        finally:
            pipe.shutdown()
        curves[name] = [h["reward_mean"] for h in history]
        records[name] = history
    assert max(h["elastic"]["serving_devices"] for h in records["autopilot"]) > 1  # it did resize
    assert curves["autopilot"] == curves["fixed"], curves
    assert len(set(curves["fixed"])) > 1, curves  # a curve that moves: the equality is not of constants
    for name in curves:
        ledger = json.loads((tmp_path / name / "run" / "ledger.json").read_text())
        assert ledger["lost"] == 0 and ledger["trained_twice"] == 0, (name, ledger)


def test_rollart_status_shows_whose_target_an_elastic_pool_follows(capsys):
    from rollart.cli.status import _print_tables

    state = {
        "jobs": [
            {
                "job_id": "j1",
                "name": "a",
                "state": "running",
                "started_at": 0.0,
                "output_dir": "/r/a",
                "ended_at": None,
            },
            {
                "job_id": "j2",
                "name": "b",
                "state": "running",
                "started_at": 0.0,
                "output_dir": "/r/b",
                "ended_at": None,
            },
        ],
        "pools": [
            {"job_id": "j1", "pool": "rollout", "hardware": "H20", "devices": 2, "max_devices": 8, "state": "reserved"},
            {"job_id": "j2", "pool": "rollout", "hardware": "H20", "devices": 1, "max_devices": 4, "state": "reserved"},
        ],
        "bindings": [],
        "endpoints": [],
    }
    state["jobs"][0]["elastic"] = {
        "rollout": {"devices": 2, "max_devices": 8, "autopilot": {"target": 4, "manual": None}}
    }
    state["jobs"][1]["elastic"] = {"rollout": {"devices": 1, "max_devices": 4, "autopilot": {"target": 1, "manual": 3}}}
    _print_tables(state, "cluster: test")
    out = capsys.readouterr().out
    assert "2/8 (autopilot 4)" in out and "1/4 (manual 3)" in out, out
