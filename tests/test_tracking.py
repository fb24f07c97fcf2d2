"""Each tracking backend writes what its own reader reads back: metrics per task as separate keys."""

import glob
import json
import struct
from pathlib import Path

import pytest

from rollart.tracking import JsonlTracker, Tracker, flatten_metrics, make_tracker

RECORDS = [
    {
        "step": s,
        "groups": [1, 2],
        "reward_mean": 0.25 * s,
        "reward_by_tag": {"reverse-3": 0.5 * s, "FrozenLake": -0.1 * s},
        "train": {"entropy": 1.5 - s, "loss": float("nan")},
        "credit_by_position": {"reverse-3": [0.1, 0.2 * s]},
        "note": "text is not a metric",
    }
    for s in range(3)
]


def test_flatten_keeps_each_task_separate_and_drops_non_numbers():
    flat = flatten_metrics(RECORDS[2])
    assert flat == {
        "reward_mean": 0.5,
        "reward_by_tag/reverse-3": 1.0,
        "reward_by_tag/FrozenLake": pytest.approx(-0.2),
        "train/entropy": -0.5,
        "credit_by_position/reverse-3/0": 0.1,
        "credit_by_position/reverse-3/1": pytest.approx(0.4),
    }


def _log_all(names, tmp_path):
    tracker = make_tracker(names, tmp_path, run_name="exp")
    assert all(isinstance(t, Tracker) for t in tracker.trackers)
    for r in RECORDS:
        tracker.log(r, r["step"])
    tracker.close()


def test_jsonl_keeps_the_nested_record_and_a_fresh_run_starts_anew(tmp_path):
    _log_all(["jsonl"], tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["reward_by_tag"]["reverse-3"] for x in lines] == [0.0, 0.5, 1.0]
    JsonlTracker(tmp_path, resume=True).log({"x": 1}, 3)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    JsonlTracker(tmp_path, resume=False)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unknown_or_missing_backend_names_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown tracker 'tb'"):
        make_tracker(["tb"], tmp_path)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ImportError, match=r"rollart\[wandb\]"):
        make_tracker(["wandb"], tmp_path)


def test_tensorboard_event_accumulator_reads_back_every_task(tmp_path):
    pytest.importorskip(
        "tensorboard", reason="the tensorboard extra is not installed (pip install 'rollart[tensorboard]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_all(["tensorboard"], tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward_by_tag/reverse-3", "reward_by_tag/FrozenLake", "train/entropy"} <= tags
    assert "train/loss" not in tags and "groups/0" not in tags
    events = acc.Scalars("reward_by_tag/reverse-3")
    assert [(e.step, e.value) for e in events] == [(0, 0.0), (1, 0.5), (2, 1.0)]


def _wandb_history(run_file):
    """History records of an offline run's ``.wandb`` file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(chunk)
            chunk = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_wandb_offline_run_folder_holds_the_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'rollart[wandb]')")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_all(["wandb"], tmp_path)
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = _wandb_history(run_file)
    assert [(r["_step"], r["reward_by_tag/reverse-3"], r["reward_by_tag/FrozenLake"]) for r in rows] == [
        (0, 0.0, 0.0),
        (1, 0.5, -0.1),
        (2, 1.0, -0.2),
    ]


def test_mlflow_file_store_run_is_read_by_mlflow_client(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'rollart[mlflow]')")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _log_all(["mlflow"], tmp_path)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward_by_tag/reverse-3")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert run.data.metrics["reward_by_tag/FrozenLake"] == pytest.approx(-0.2)


def test_all_backends_together(tmp_path, monkeypatch):
    for mod in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(mod, reason=f"the {mod} extra is not installed (pip install 'rollart[{mod}]')")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _log_all(["jsonl", "tensorboard", "wandb", "mlflow", "jsonl"], tmp_path)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # listed twice, logged once
    assert glob.glob(str(tmp_path / "tensorboard" / "events.*"))
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert (tmp_path / "mlruns").is_dir()
