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
