"""Sharded training's settings are checked before any actor starts: every refused combination is named with
its fix (``train.sharding``, ``tensor_parallel``, ``offload``, ``pipeline_parallel``, LoRA, megatron,
colocated mode, the pool's ranks and the model's heads)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollart.config import ConfigError, validate_config
from rollart.training.config import TrainConfig


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"tensor_parallel": 2}, r"tensor_parallel=2 runs with FSDP.*set train\.sharding: fsdp"),
        ({"offload": "cpu"}, r"train\.offload: cpu offloads the shards.*set train\.sharding: fsdp"),
        ({"pipeline_parallel": 2}, r"pipeline_parallel=2: pipeline parallelism is not built.*pipeline_parallel: 1"),
        ({"sharding": "fsdp", "lora": {"r": 4}}, r"train\.lora with train\.sharding: fsdp is not supported"),
        ({"strategy": "megatron", "sharding": "fsdp"}, r"train\.sharding is implemented for train\.strategy: torch"),
        ({"sharding": "zero3"}, r"sharding"),
    ],
)
def test_refused_train_settings_name_the_field_and_fix(train, message):
    with pytest.raises(ValidationError, match=message):
        TrainConfig.model_validate(train)


def test_sharded_settings_that_fit_are_accepted():
    cfg = TrainConfig.model_validate({"sharding": "fsdp", "tensor_parallel": 2, "offload": "cpu"})
    assert (cfg.sharding, cfg.tensor_parallel, cfg.offload, cfg.reshard_after_forward) == ("fsdp", 2, "cpu", True)


def config(train: dict, train_pool: dict, **extra) -> dict:
    return {
        "pools": {"train": train_pool, "rollout": {"hardware": "CPU", "cpus": 1}},
        "envs": [{"name": "reverse", "groups": 8}],
        "train": train,
        **extra,
    }


def test_tensor_parallel_must_divide_the_pool_and_the_heads_before_ray_starts():
    fsdp_tp = {"sharding": "fsdp", "tensor_parallel": 4}
    with pytest.raises(ConfigError) as err:  # the built-in tiny model: 4 attention heads, 2 KV heads; 6 ranks
        validate_config(config(fsdp_tp, {"hardware": "CPU", "cpus": 6}))
    text = str(err.value)
    assert "train.tensor_parallel: 4 does not divide the 6 ranks of pools.train" in text
    assert "must divide the model's 4 attention heads and 2 KV heads; use a divisor of 2" in text
    shape = {"shape": "qwen2.5-0.5b", "layers": 1}  # 14 heads, 2 KV heads
    with pytest.raises(ConfigError, match="14 attention heads and 2 KV heads"):
        validate_config(config(fsdp_tp, {"hardware": "CPU", "cpus": 4}, model=shape))
    ok = validate_config(config({"sharding": "fsdp", "tensor_parallel": 2}, {"hardware": "CPU", "cpus": 4}))
    assert ok.train.tensor_parallel == 2


def test_colocated_mode_trains_unsharded():
    raw = config({"sharding": "fsdp"}, {"hardware": "CPU", "cpus": 1})
    raw["pools"]["rollout"] = {"colocate_with": "train"}
    with pytest.raises(ConfigError, match="train.sharding: fsdp is not supported in colocated mode"):
        validate_config(raw)


def test_the_memory_arithmetic_counts_real_shapes_and_refuses_what_does_not_fit():
    from rollart.models.shapes import SHAPES, ShapeConfig, hf_config
    from rollart.training.memory import fit_problem, param_counts, state_bytes_per_rank

    for name, arch in SHAPES.items():  # the published parameter counts, from config.json alone
        assert param_counts(hf_config(ShapeConfig(shape=name)).to_dict())[0] == arch.params()
    total, split = param_counts(hf_config(ShapeConfig(shape="qwen2.5-0.5b")).to_dict())
    ddp = state_bytes_per_rank(total, split, sharding="ddp", ranks=4)
    fsdp = state_bytes_per_rank(total, split, sharding="fsdp", ranks=4)
    assert ddp == 16 * total and fsdp == ddp / 4
    tp = state_bytes_per_rank(total, split, sharding="fsdp", ranks=4, tensor_parallel=2)
    assert fsdp < tp < ddp / 2  # the embeddings are split only by FSDP's 2 ranks
    machine = {"sharding": "ddp", "ranks": 4, "tensor_parallel": 1, "offload": False, "where": "this machine"}
    problem = fit_problem(total, split, budget=24 * 2**30, **machine)
    assert problem is not None and "4 ranks x 7.4 GiB" in problem and "use train.sharding: fsdp (1.8 GiB" in problem
    assert fit_problem(total, split, budget=24 * 2**30, **{**machine, "sharding": "fsdp"}) is None
