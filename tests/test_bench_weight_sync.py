"""`rollart bench weight-sync` end to end at a small size: both modes finish, every inference worker
ends on the last published version, and the report files are written (timings are the bench's job)."""

import json

import pytest

from rollart.cli import main

pytestmark = pytest.mark.timeout(300)


def test_weight_sync_bench_runs_both_modes_to_the_last_version(ray_local, tmp_path, capsys):
    pytest.importorskip("mooncake.store")
    out = tmp_path / "ws"
    assert (
        main(
            [
                "bench",
                "weight-sync",
                "--model-mb",
                "4",
                "--steps",
                "2",
                "--train-s",
                "0.1",
                "--workers",
                "2",
                "--in-flight",
                "4",
                "--out",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["modes"]["blocking"]["final_versions"] == [3, 3]  # a warm-up step, then 2 measured
    assert result["modes"]["mooncake"]["final_versions"] == [6, 6]  # the trainer's versions go on counting
    assert result["mooncake_publish_MBps"] > 0 and result["mooncake_fetch_MBps"] > 0
    assert result["blocking_tokens_per_s"] > 0 and result["mooncake_tokens_per_s"] > 0
    assert (out / "weight_sync.json").exists() and (out / "weight_sync.png").exists()


def test_cpu_per_step_is_each_cores_time_between_the_samples_around_the_window(tmp_path):
    import os

    from rollart.benchmarks.cpu_account import per_step, read_cores

    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 0 0 0\ncpu0 100 0 20 50 0 0 5 0 0 0\ncpu1 10 0 0 200 0 0 0 0 0 0\nintr 1\n")
    first = read_cores(stat)
    assert first == {0: (100, 0, 20, 50, 0, 0, 5), 1: (10, 0, 0, 200, 0, 0, 0)}  # the "cpu" total is not a core
    stat.write_text("cpu0 130 10 40 50 0 0 15 0 0 0\ncpu1 10 0 0 300 0 0 0 0 0 0\n")
    samples = [(0.0, first), (1.0, first), (3.0, read_cores(stat))]
    ms = 1000.0 / os.sysconf("SC_CLK_TCK")
    # the window 1.5-2.5 s lies between the samples at 1.0 and 3.0: 2 steps, their deltas halved
    got = per_step(samples, 1.5, 2.5, steps=2)
    assert got[0] == {"busy": 70 * ms / 2, "system": 20 * ms / 2, "softirq": 10 * ms / 2, "idle": 0.0}
    assert got[1] == {"busy": 0.0, "system": 0.0, "softirq": 0.0, "idle": 100 * ms / 2}
    assert per_step(samples, 1.5, 3.5, steps=2) == {}  # no sample after the window's end
    assert per_step(samples, -1.0, 2.5, steps=2) == {}  # none before its start


def test_pipeline_weight_sync_bench_serves_every_version_and_accounts_cpu(ray_local, tmp_path):
    pytest.importorskip("mooncake.store")
    from rollart.benchmarks.cpu_account import read_cores
    from rollart.benchmarks.weight_sync_pipeline import run_modes

    # the test session's Ray declares H800 and H20 (the bench's default rollout pool asks for an A800)
    sets = {
        "pools.rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 1}],
        "tags": {"reverse-3": ["H800"], "reverse-2": ["H20"]},
        "rollout.group_size": 2,
        "train.ppo_epochs": 1,
    }
    modes = run_modes(["none", "mooncake"], tmp_path, steps=2, warmup=1, hidden=32, layers=1, local=True, sets=sets)
    for mode, m in modes.items():
        # mooncake: every worker ends on the last version (1 warm-up + 2 steps); none: no weights move
        assert m["final_versions"] == ([3, 3] if mode == "mooncake" else [0, 0]), mode
        assert len(m["steps_s"]) == 2 and m["step_s"] > 0
        cpu = m["cpu_ms_per_step"]
        assert set(cpu) == {str(c) for c in read_cores()}, mode
        assert sum(c["busy"] for c in cpu.values()) > 0, cpu
