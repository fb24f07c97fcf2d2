"""`rollart bench quickstart`: the smoothing and steps-to-threshold arithmetic, and the bench end to end
on a tiny run (2 seeds x 2 steps of a small model): per-seed rows, JSON and PNG (no timing asserted)."""

import json

import pytest

from rollart.benchmarks.quickstart import smoothed, summarise
from rollart.cli import main

pytestmark = pytest.mark.timeout(600)


def test_trailing_mean_and_first_step_reaching_the_threshold():
    rewards = [0.0, 1.0, 1.0, 1.0, 0.0]
    assert smoothed(rewards, 2) == [0.0, 0.5, 1.0, 1.0, 0.5]
    s = summarise(rewards, window=2, threshold=0.9)
    assert s["steps_to_threshold"] == 2 and s["final_reward"] == 0.5 and s["steps"] == 5
    assert summarise([0.1, 0.2], window=20, threshold=0.9)["steps_to_threshold"] is None


def test_bench_runs_each_seed_and_writes_the_report(ray_local, tmp_path, capsys):
    out = tmp_path / "qs"
    small = "{hidden_size: 32, num_layers: 1, intermediate_size: 64}"
    assert (
        main(
            [
                "bench",
                "quickstart",
                "--seeds",
                "2",
                "--first-seed",
                "3",
                "--window",
                "1",
                "--threshold",
                "0",
                "--set",
                "steps=2",
                "--set",
                "rollout.group_size=2",
                "--set",
                f"tiny_model={small}",
                "--out",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["per_seed"]) == {"3", "4"} and result["seeds_reaching_threshold"] == "2/2"
    for seed in ("3", "4"):
        row = result["per_seed"][seed]
        assert row["steps"] == 2 and row["steps_to_threshold"] == 0 and 0.0 <= row["final_reward"] <= 1.0
        assert (out / f"seed{seed}" / "metrics.jsonl").exists()
    saved = json.loads((out / "quickstart.json").read_text())
    assert [len(saved["rewards"][s]) for s in ("3", "4")] == [2, 2]
    assert (out / "quickstart.png").exists()


def test_bench_rejects_zero_seeds(tmp_path):
    with pytest.raises(SystemExit, match="--seeds"):
        main(["bench", "quickstart", "--seeds", "0", "--out", str(tmp_path)])
