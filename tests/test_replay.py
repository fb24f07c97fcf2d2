"""``rollart replay``: an asynchronous (alpha 1), seeded quickstart run records its batches; training them
again from the initial weights, or from the run's checkpoint, reaches the run's checkpoint bit for bit;
another learning rate trains the same data elsewhere; bad input is refused with the fix."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch

from rollart.cli import main
from rollart.cluster.batch import Batch
from rollart.config import load_config
from rollart.pipeline.replay import compare_checkpoints
from rollart.pipelines.agentic import AgenticPipeline
from rollart.training.batch_record import decode_batch, encode_batch, read_step, read_trainer, recorded_steps
from rollart.training.checkpoint_io import load_checkpoint_any, step_dir

pytestmark = pytest.mark.timeout(600)

STEPS = 6
EVERY = 3


@pytest.fixture(scope="module")
def run_dir(ray_local, tmp_path_factory):
    """The quickstart (reverse-3, the tiny model, 256 samples a step), asynchronous (alpha 1), seeded,
    with its batches recorded and a checkpoint every 3 steps."""
    tmp = tmp_path_factory.mktemp("replay")
    cfg = load_config(
        "quickstart",
        {
            "rollout.alpha": 1,
            "steps": STEPS,
            "checkpoint_every": EVERY,
            "checkpoint_keep": 10,
            "record_batches": True,
            "export.hf": False,
            "output_dir": str(tmp / "run"),
            "cluster.metadata_store": str(tmp / "meta.sqlite"),
        },
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
    finally:
        pipe.shutdown()
    # the run was asynchronous: some batches held samples of the previous policy version
    assert max(h["max_staleness"] for h in history) == 1
    return tmp / "run"


def _trainer_state_equal(a, b) -> None:
    """Optimizer moments, LR scheduler, version and the pipeline's side of two checkpoints: equal."""
    sa, sb = load_checkpoint_any(a), load_checkpoint_any(b)
    assert sa["version"] == sb["version"] and sa["scheduler"] == sb["scheduler"]
    assert sa["extra"] == sb["extra"]
    for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(pa[key], pb[key])


def test_the_record_holds_every_trained_batch_in_order(run_dir):
    root = run_dir / "batches"
    assert recorded_steps(root) == list(range(1, STEPS + 1))
    trainer = read_trainer(root)
    assert trainer["ranks"] == 1 and trainer["train"]["lr"] == 0.001 and trainer["threads"] >= 1
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for step, record in zip(range(1, STEPS + 1), metrics, strict=True):
        batch, info = read_step(root, step)
        assert info["version"] == record["version"] == step and info["extra"]["step"] == step - 1
        assert len(batch) == 256 and sum(sum(m) for m in batch["loss_mask"]) == record["train"]["tokens"]
        # groups in the order the trainer trained them (sorted by group id), and the versions that made them
        assert all(max(v) <= step - 1 for v in batch["versions"])


def test_replay_from_the_initial_weights_equals_the_runs_checkpoint(run_dir, tmp_path):
    out = tmp_path / "replayed"
    assert main(["replay", str(run_dir), "--to", str(STEPS), "--out", str(out), "--json"]) == 0
    ckpt = step_dir(run_dir / "checkpoint", STEPS)
    diffs = compare_checkpoints(ckpt, out)
    assert diffs and max(diffs.values()) == 0.0
    _trainer_state_equal(ckpt, out)


def test_replay_from_a_checkpoint_and_from_a_replayed_one(run_dir, tmp_path):
    mid = tmp_path / "mid"
    assert main(["replay", str(run_dir), "--to", str(EVERY), "--out", str(mid)]) == 0
    assert max(compare_checkpoints(step_dir(run_dir / "checkpoint", EVERY), mid).values()) == 0.0
    end = tmp_path / "end"  # from the replayed checkpoint on: what the run trained after it
    assert main(["replay", str(run_dir), "--from", str(mid), "--to", str(STEPS), "--out", str(end)]) == 0
    assert max(compare_checkpoints(step_dir(run_dir / "checkpoint", STEPS), end).values()) == 0.0
    _trainer_state_equal(step_dir(run_dir / "checkpoint", STEPS), end)


def test_replay_with_another_learning_rate_trains_elsewhere(run_dir, tmp_path, capsys):
    out = tmp_path / "lr"
    code = main(
        ["replay", str(run_dir), "--from", str(EVERY), "--to", str(STEPS), "--out", str(out)]
        + ["--set", "train.lr=0.003", "--json"]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["sets"] == {"train.lr": 0.003} and summary["from_step"] == EVERY
    assert summary["max_abs_diff"] > 1e-3 and math.isfinite(summary["loss"])
    written = json.loads((out / "replay.json").read_text())
    assert [m["step"] for m in written["metrics"]] == list(range(EVERY + 1, STEPS + 1))
    assert all(m["lr"] == 0.003 for m in written["metrics"])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--to", "99"], f"--to 99: the run recorded the batches of steps 1..{STEPS}"),
        (["--to", "2", "--set", "train.lrr=0.1"], "train.lrr: unknown key; did you mean 'lr'?"),
        (["--to", "2", "--set", "rollout.alpha=0"], "give train.* keys"),
        (["--to", "2", "--set", "train.kl_coef=0.1"], "hold no reference log-probs"),
        (["--to", "6", "--from", "5"], "is not a complete checkpoint folder; give one of the run's checkpoints"),
    ],
)
def test_bad_input_names_what_and_the_fix(run_dir, tmp_path, caplog, args, says):
    caplog.set_level(logging.ERROR)
    assert main(["replay", str(run_dir), "--out", str(tmp_path / "x"), *args]) == 2
    assert says in caplog.text
    assert not (tmp_path / "x").exists()


def test_missing_batches_name_the_steps_and_the_fix(run_dir, tmp_path, caplog):
    copy = tmp_path / "run"
    shutil.copytree(run_dir / "batches", copy / "batches")
    shutil.copytree(run_dir / "checkpoint", copy / "checkpoint")
    (copy / "batches" / "step-00000002.pt").unlink()
    caplog.set_level(logging.ERROR)
    assert main(["replay", str(copy), "--to", "3"]) == 2
    assert "no recorded batch of step(s) [2]" in caplog.text and "(--from STEP)" in caplog.text
    assert main(["replay", str(copy), "--from", str(EVERY), "--to", str(STEPS), "--out", str(tmp_path / "o")]) == 0
    assert main(["replay", str(tmp_path / "nothing"), "--to", "1"]) == 2
    assert "run it with record_batches: true" in caplog.text


def test_the_record_gives_back_every_column_exactly():
    third = 1 / 3  # not a float32: kept as float64
    batch = Batch(
        {
            "input_ids": [[1, 2, 70000], [5]],
            "loss_mask": [[0, 1, 1], [1]],
            "behaviour_logprobs": [[0.0, -0.5, -1.25], [-2.0]],  # float32 values: stored as float32
            "advantages": [[third, third, -third], [0.1]],
            "token_rewards": [None, [1.0]],
            "rewards": torch.tensor([1.0, 0.0], dtype=torch.float64),
            "tag": ["reverse-3", "reverse-3"],
            "traj_id": ["g0:r0:m0:v0", "g0:r0:m1:v0"],
        },
        meta={"num_groups": 1},
    )
    enc = encode_batch(batch)
    assert enc["columns"]["behaviour_logprobs"]["values"].dtype == torch.float32
    assert enc["columns"]["advantages"]["values"].dtype == torch.float64
    assert enc["columns"]["input_ids"]["values"].dtype == torch.int32
    back = decode_batch(enc)
    assert back.meta == batch.meta and list(back) == list(batch)
    for key in batch:
        if isinstance(batch[key], torch.Tensor):
            assert torch.equal(back[key], batch[key])
        else:
            assert back[key] == batch[key]
            assert [type(v) for r in back[key] if isinstance(r, list) for v in r] == [
                type(v) for r in batch[key] if isinstance(r, list) for v in r
            ]


def test_a_resumed_run_keeps_the_record_through_its_checkpoint_only(tmp_path):
    from rollart.training.batch_record import BatchRecorder

    batch = Batch({"input_ids": [[1, 2]], "advantages": [[0.5, 0.5]]})
    first = BatchRecorder(tmp_path, {"train": {}})
    for step in (1, 2, 3):
        first.record(step, batch, {"version": step, "extra": {"step": step - 1}})
    first.close()
    assert recorded_steps(tmp_path / "batches") == [1, 2, 3]
    # resumed from the checkpoint after step 1: steps 2 and 3 are trained again (or not at all)
    BatchRecorder(tmp_path, {"train": {}}, keep_through=1).close()
    assert recorded_steps(tmp_path / "batches") == [1]
    back, info = read_step(tmp_path / "batches", 1)
    assert back["advantages"] == [[0.5, 0.5]] and info["version"] == 1
    # a fresh run in the folder: nothing of the older run's is left
    BatchRecorder(tmp_path, {"train": {}}).close()
    assert recorded_steps(tmp_path / "batches") == []
