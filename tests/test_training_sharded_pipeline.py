"""A seeded run of the reverse task trains with ``train.sharding: fsdp`` on 2 CPU ranks as it does with DDP
on 2 ranks: the same rewards step for step (the samples are seeded per request; the two layouts' weights
differ only by the order of float reductions), with the KL term's reference model sharded like the trainer
and a critic (GAE) training data parallel beside it, the sharded run's weights reaching the engine through the
``dist`` channel (a broadcast the engine receives while the trainer's ranks gather) and the DDP run's through
Ray's object store; and its checkpoint is sharded (no ``model.safetensors``), exported as a Hugging Face folder at the end."""

from __future__ import annotations

import json

import pytest
from test_pipeline import small_config

from rollart.pipelines.agentic import AgenticPipeline

pytestmark = pytest.mark.timeout(600)


def run(tmp_path, name: str, sharding: str, channel: str) -> list[dict]:
    cfg = small_config(
        tmp_path,
        output_dir=str(tmp_path / name),
        seed=0,
        steps=4,
        checkpoint_every=4,
        pools={"train": {"hardware": "CPU", "cpus": 2}, "rollout": {"hardware": "CPU", "cpus": 1}},
        rollout={"num_env_groups": 4, "group_size": 4, "batch_groups": 4, "alpha": 0},
        sampling={"temperature": 1.0, "max_new_tokens": 3, "seed": 0},
        train={"lr": 0.001, "sharding": sharding, "kl_coef": 0.01, "max_tokens_per_microbatch": 48},
        advantage="gae",
        critic={"epochs": 1},
        weights={"channel": channel},
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        return pipe.run()
    finally:
        pipe.shutdown()


def test_fsdp_on_two_ranks_trains_as_ddp_does(ray_local, tmp_path):
    ddp, fsdp = run(tmp_path, "ddp", "ddp", "ray"), run(tmp_path, "fsdp", "fsdp", "dist")
    assert [h["reward_mean"] for h in fsdp] == [h["reward_mean"] for h in ddp]
    for a, b in zip(ddp, fsdp):
        assert b["train"]["loss"] == pytest.approx(a["train"]["loss"], abs=1e-5)
        assert b["train"]["kl_ref"] == pytest.approx(a["train"]["kl_ref"], abs=1e-5)
        assert b["train"]["critic_value_loss"] == pytest.approx(a["train"]["critic_value_loss"], abs=1e-5)
    ckpt = tmp_path / "fsdp" / "checkpoint" / "step-00000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["layout"] == {"sharding": "fsdp", "tensor_parallel": 1, "ranks": 2}
    assert (ckpt / "shards" / ".metadata").exists() and not (ckpt / "model.safetensors").exists()
    assert (tmp_path / "fsdp" / "hf" / "config.json").exists()
