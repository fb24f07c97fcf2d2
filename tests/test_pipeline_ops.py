"""The pipeline's run outputs: checkpoint folders (keep-K, resume), the final Hugging Face export,
trackers, on a real local Ray with the tiny model, LoRA-trained."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollart.config import ConfigError, load_config
from rollart.pipelines.agentic import AgenticPipeline
from rollart.training.export import export_run

pytestmark = pytest.mark.timeout(600)


def config(tmp_path, **over):
    raw = {
        "name": "ops",
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
        "envs": [{"name": "reverse", "groups": 2, "kwargs": {"length": 3}}],
        "rollout": {"num_env_groups": 2, "group_size": 4, "batch_groups": 2, "alpha": 0},
        "sampling": {"temperature": 1.0, "max_new_tokens": 3, "seed": 0},
        "advantage": "grpo_token",
        "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
        # the entropy bonus gives a gradient even when no sample of the random-init model earns credit
        "train": {"lr": 0.05, "entropy_coef": 0.1, "lora": {"r": 4, "alpha": 8}},
        "steps": 3,
        "checkpoint_every": 1,
        "checkpoint_keep": 2,
        "tracking": ["jsonl", "tensorboard"],
        "output_dir": str(tmp_path / "run"),
        "cluster": {"metadata_store": str(tmp_path / "meta.sqlite")},
    }
    raw.update(over)
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(raw))
    return load_config(path)


def logits(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    x = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        return model(input_ids=x, attention_mask=torch.ones_like(x)).logits


def test_lora_run_keeps_k_checkpoints_exports_tracks_and_resumes(ray_local, tmp_path):
    pytest.importorskip("peft", reason="the lora extra is not installed (pip install 'rollart[lora]')")
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    pipe = AgenticPipeline(config(tmp_path), progress=False)
    try:
        history = pipe.run()
    finally:
        pipe.shutdown()
    run = tmp_path / "run"
    assert len(history) == 3
    assert sorted(p.name for p in (run / "checkpoint").glob("step-*")) == ["step-00000002", "step-00000003"]
    assert pipe.checkpoint_path == run / "checkpoint" / "step-00000003"
    assert pipe.export_path == run / "hf" and (run / "hf" / "model.safetensors").exists()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    assert list((run / "tensorboard").glob("events.*"))
    # the final export (merged LoRA weights the trainer synced) equals the last checkpoint exported later
    final = logits(run / "hf")
    assert not torch.allclose(final, logits(pipe.model_path))  # it trained
    torch.testing.assert_close(logits(export_run(run, tmp_path / "from_ckpt")), final, rtol=0, atol=1e-6)

    pipe = AgenticPipeline(config(tmp_path, steps=4), resume=True, progress=False)
    try:
        assert pipe.start_step == 3
        more = pipe.run()
    finally:
        pipe.shutdown()
    assert [h["step"] for h in more] == [4] and more[0]["version"] == 4
    assert sorted(p.name for p in (run / "checkpoint").glob("step-*")) == ["step-00000003", "step-00000004"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4


def test_tracking_and_checkpoint_keep_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="checkpoint_keep"):
        config(tmp_path, checkpoint_keep=0)
    with pytest.raises(ConfigError, match="tracking"):
        config(tmp_path, tracking=["neptune"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    with pytest.raises(
        ConfigError, match=r"tracking: mlflow needs the mlflow package; install it with pip install 'rollart\[mlflow\]'"
    ):
        config(tmp_path, tracking=["mlflow"])


def test_run_list_shows_the_shipped_configs(capsys):
    from rollart.cli import main
    from rollart.config import shipped_configs

    assert main(["run", "--list"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert {r[0]: r[1] for r in rows} == {k: str(v) for k, v in shipped_configs().items()}
    assert "quickstart" in {r[0] for r in rows} and all(len(r) == 3 and r[2] for r in rows)  # with a description
    assert main(["run"]) == 2  # no config: an error naming --list, not a traceback
