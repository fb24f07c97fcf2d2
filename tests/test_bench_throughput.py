"""`rollart bench throughput`: the per-step arithmetic, and the bench end to end in its quick mode
(alpha 1 only, 3 steps: the sync mode runs the same code path with another bound; one pipeline keeps the
test short): every figure present and positive (no timing asserted)."""

import json
import math

import pytest

from rollart.benchmarks.throughput import throughput
from rollart.cli import main

pytestmark = pytest.mark.timeout(600)


def step(rows, tokens, wait, train, total, sync=0.125):
    return {
        "train": {"rows": rows, "tokens": tokens},
        "tokens": tokens,
        "time": {"rollout_wait_s": wait, "train_s": train, "weight_sync_s": sync, "step_s": total},
    }


def test_throughput_leaves_out_the_first_steps_and_divides_by_the_right_times():
    history = [step(256, 768, 100.0, 100.0, 300.0), step(256, 768, 0.5, 0.25, 1.0), step(256, 512, 0.5, 0.25, 1.0)]
    t = throughput(history, skip=1)
    assert t["steps_measured"] == 2
    assert t["generation_samples_per_s"] == 512 and t["generation_tokens_per_s"] == 1280
    assert t["train_samples_per_s"] == 1024 and t["train_tokens_per_s"] == 2560
    assert t["samples_per_s"] == 256 and t["step_s"] == 1.0
    # the step's time by part: the driver's share is what rollout wait, train and weight sync leave
    assert (t["rollout_wait_s_per_step"], t["train_s_per_step"], t["weight_sync_s_per_step"]) == (0.5, 0.25, 0.125)
    assert t["driver_s_per_step"] == 0.125


def test_quick_bench_reports_every_figure(ray_local, tmp_path, capsys):
    out = tmp_path / "thr"
    assert main(["bench", "throughput", "--quick", "--alphas", "1", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "alpha 0" not in result
    for mode in ("alpha 1",):
        row = result[mode]
        assert row["steps"] == 3 and 0.0 <= row["final_reward"] <= 1.0
        for key in ("generation_samples_per_s", "generation_tokens_per_s", "train_samples_per_s", "samples_per_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (mode, key)
    assert json.loads((out / "throughput.json").read_text())["alpha 1"]["steps"] == 3
    assert (out / "alpha1" / "metrics.jsonl").exists() and (out / "throughput.png").exists()


def test_bench_rejects_a_negative_alpha(tmp_path):
    with pytest.raises(SystemExit, match="--alphas"):
        main(["bench", "throughput", "--alphas", "-1", "--out", str(tmp_path)])


def test_the_task_reward_scores_exact_answers_letters_in_place_and_stopping():
    from rollart.benchmarks.reverse_chat_task import make_rows, score

    assert score("cba", "cba") == 1.0 and score(" cba ", "cba") == 1.0
    assert score("cbx", "cba") == pytest.approx(0.8 * 2 / 3 + 0.1)  # two in place, stopped after 3
    assert score("cbaa", "cba") == pytest.approx(0.8 + 0.0)  # three in place, did not stop
    assert score("", "cba") == 0.0
    rows = make_rows(5, seed=1)
    assert rows == make_rows(5, seed=1) and all(r["prompt"] == f"Reverse: {r['answer'][::-1]}" for r in rows)


def test_trl_without_its_interpreter_names_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="python3 -m venv .venv-trl"):
        main(["bench", "throughput", "--trl", str(tmp_path / "no-python"), "--out", str(tmp_path)])


def test_mode_config_seeds_both_sides_and_corrects_stale_samples_in_async_modes(tmp_path):
    import argparse
    from pathlib import Path

    from rollart.benchmarks import throughput as bench
    from rollart.benchmarks.reverse_chat import Setting
    from rollart.config import load_config

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--seed", "3", "--trl", "python3"])
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "Reverse: abc", "answer": "cba"}) + "\n")
    setting = Setting(model=Path("m"), train=tmp_path / "t.jsonl", warmup_loss=[])
    sync, async1 = (bench.mode_config(args, setting, a, tmp_path / f"a{a}") for a in (0, 1))
    assert sync["train.loss"] == "ppo" and async1["train.loss"] == "decoupled_ppo"
    assert sync["seed"] == async1["seed"] == 3 and sync["sampling"]["seed"] == 3
    assert "--seed=3" in bench.trl_command(args, setting, tmp_path / "trl.json")
    # the overrides make a valid pipeline config (the loss and its behaviour log-probs included)
    cfg = load_config("pipelines/quickstart.yaml", {**async1, "model": None})
    assert cfg.train.loss == "decoupled_ppo" and cfg.rollout.alpha == 1
