"""`rollart plot RUN_DIR` draws metrics.png again from a run's metrics.jsonl (a run without the plot extra
wrote none), and says what is missing when it cannot."""

from __future__ import annotations

import importlib.util
import json

from rollart.cli import main


def records(n: int) -> str:
    return "".join(
        json.dumps(
            {
                "step": step,
                "reward_mean": step / n,
                "reward_by_tag": {"reverse": step / n},
                "time": {"rollout_wait_s": 0.2, "train_s": 0.3, "weight_sync_s": 0.05},
            }
        )
        + "\n"
        for step in range(1, n + 1)
    )


def test_plot_draws_metrics_png_of_an_existing_run(tmp_path, capsys):
    run = tmp_path / "runs" / "quickstart"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(records(12))
    assert main(["plot", str(run)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"plot": str(run / "metrics.png"), "steps": 12}
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_names_what_is_missing(tmp_path, caplog, monkeypatch):
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no metrics.jsonl; give a run's output folder" in caplog.text
    (tmp_path / "metrics.jsonl").write_text(records(3))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["plot", str(tmp_path)]) == 2
    assert "install the plot extra" in caplog.text and not (tmp_path / "metrics.png").exists()
