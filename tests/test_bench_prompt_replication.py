"""`rollart bench prompt-replication`: n samples of a prompt pinned to one worker vs replicated over
workers, on the simulated engine's H800 profile (ROLL Flash §5.1.2). Asserted: every sample comes back in
both modes, the model runs on the very lengths and assignments of the run, and where lengths differ
only between prompts the model's pinned step is never faster than the replicated one."""

import argparse
import json

import pytest

from rollart.benchmarks import prompt_replication as pr

pytestmark = pytest.mark.timeout(300)


def _args(*argv: str):
    p = argparse.ArgumentParser()
    pr.add_arguments(p)
    return p.parse_args(list(argv))


def test_replication_run_returns_every_sample_and_models_its_own_assignment(ray_local, tmp_path):
    # 4 prompts × 8 samples on 4 workers, samples of one prompt of one length: a pinned worker runs 8
    # copies of its prompt, a replicated one 2 of each, so the pinned worst is at least the replicated
    argv = ["--prompts", "4", "--samples", "8", "--workers", "4", "--steps", "2", "--length-sigma", "0"]
    argv += ["--difficulty-sigma", "1.2", "--token-scale", "128", "--kv-capacity", "none"]
    result = pr.run(_args(*argv, "--time-scale", "0.001", "--out", str(tmp_path)))
    assert len(result["steps"]) == 2
    for step in result["steps"]:
        assert step["samples"] == [32, 32]
        assert step["model_without_s"] > step["model_with_s"] > 0
    assert result["model_speedup"] > 1.0
    # the reported times are the means of the steps' times
    for key in ("without_replication_sim_s", "with_replication_sim_s"):
        assert result[key] == pytest.approx(sum(st[key] for st in result["steps"]) / 2)
    assert result["max_over_median_length"] >= 1.0 and result["mean_length"] > 0
    saved = json.loads((tmp_path / "prompt-replication.json").read_text())
    assert saved["steps"] == result["steps"]


def test_kv_capacity_argument_names_its_choices():
    assert _args("--kv-capacity", "none").kv_capacity is None
    assert _args("--kv-capacity", "4096").kv_capacity == 4096 and _args().kv_capacity == "auto"
    with pytest.raises(SystemExit):
        _args("--kv-capacity", "lots")


def test_model_sweep_covers_the_seed_configurations(tmp_path):
    result = pr.run(_args("--sweep", "--steps", "2", "--out", str(tmp_path)))
    rows = result["rows"]
    assert list(rows) == [f"{p}x{n}" for p, n in pr.SWEEP]
    assert rows["64x16"]["paper_figure"] == pytest.approx(149 / 81)
    for row in rows.values():
        assert row["without_replication_sim_s"] > 0 and row["with_replication_sim_s"] > 0
    # ROLL Flash's shape: little gain with few samples per prompt, more with many prompts or samples
    assert rows["16x4"]["model_speedup"] < rows["64x16"]["model_speedup"]
    assert rows["16x4"]["model_speedup"] < rows["16x64"]["model_speedup"]
    assert (tmp_path / "prompt-replication-sweep.json").exists()
