"""The checks that relate several sections of a config, on its raw mapping (so they run also when fields
have errors of their own): pools, models, sharding, packing, elasticity, tasks against the rollout."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollart.config.colocation import (
    DEFAULT_ROLLOUT_POOL,
    DEFAULT_TRAIN_POOL,
    _pool_units,
    colocated_pools,
    colocation_problems,
)
from rollart.rollout.config import RolloutConfig
from rollart.weights.kinds import WEIGHT_CHANNELS, channel_kind

DEFAULT_POOLS = {"train_pool": DEFAULT_TRAIN_POOL, "rollout_pool": DEFAULT_ROLLOUT_POOL}


def model_problems(raw: Mapping[str, Any]) -> list[str]:
    """``model``, ``train.model``, ``critic.model`` and ``engine.model`` (for the engines that load a
    Hugging Face model): a folder with a ``config.json`` or a model the offline Hugging Face cache holds."""
    from rollart.engines.kinds import engine_kind
    from rollart.models.locate import model_problem

    def section(name: str) -> Mapping[str, Any]:
        value = raw.get(name)
        return value if isinstance(value, Mapping) else {}

    engine = section("engine")
    caps = engine_kind(engine.get("kind", "torch"))
    loads_hf = caps is not None and caps.loads_model
    given = [
        ("model", raw.get("model")),
        ("train.model", section("train").get("model")),
        ("critic.model", section("critic").get("model")),
        ("engine.model", engine.get("model") if loads_hf else None),
    ]
    out = []
    for where, value in given:
        if isinstance(value, str):
            problem = model_problem(value)
            if problem is not None:
                out.append(f"{where}: {problem}")
    return out


def _attention_heads(model: Any) -> tuple[int, int] | None:
    """(attention heads, KV heads) of a config's model (a folder, a cached model name, a ``{shape: ...}`` or
    None for the built-in tiny model); None when they cannot be read without loading anything."""
    import inspect

    if model is None:
        from rollart.models.tiny import build_tiny

        params = inspect.signature(build_tiny).parameters
        return params["num_heads"].default, params["num_kv_heads"].default
    if isinstance(model, Mapping):
        from rollart.models.shapes import SHAPES

        arch = SHAPES.get(str(model.get("shape")))
        return (arch.heads, arch.kv_heads) if arch is not None else None
    cfg = _model_config(model)
    if cfg is None:
        return None
    heads = cfg.get("num_attention_heads")
    return (heads, cfg.get("num_key_value_heads", heads)) if isinstance(heads, int) else None


def _model_config(model: Any) -> dict[str, Any] | None:
    """A config's model folder's (or cached model's) ``config.json``, or None when there is none to read."""
    import json

    if not isinstance(model, str):
        return None
    from rollart.models.locate import cached_model

    path = Path(model) / "config.json"
    found = str(path) if path.is_file() else cached_model(model)
    if found is None:
        return None
    try:
        data = json.loads(Path(found).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def packing_problems(raw: Mapping[str, Any]) -> list[str]:
    """``train.packing: true`` against the model's ``config.json`` (when there is one to read)."""
    train = raw.get("train")
    if not isinstance(train, Mapping) or train.get("packing") is not True:
        return []
    from rollart.training.config import packing_config_problem

    model = train.get("model") or raw.get("model")
    config = _model_config(model)
    reason = packing_config_problem(config) if config is not None else None
    if reason is None:
        return []
    return [f"train.packing: true: the model {model} cannot train packed ({reason}); set train.packing: false"]


def sharding_problems(raw: Mapping[str, Any]) -> list[str]:
    """``train.sharding`` / ``train.tensor_parallel`` against the train pool and the model: the tensor-parallel
    degree divides the pool's ranks and the model's attention and KV heads; colocated mode trains unsharded."""
    train = raw.get("train")
    if not isinstance(train, Mapping):
        return []
    tp, sharding = train.get("tensor_parallel", 1), train.get("sharding", "ddp")
    out = []
    if sharding == "fsdp" and colocated_pools(raw):
        out.append(
            "train.sharding: fsdp is not supported in colocated mode (each rank's engine would need the whole "
            "model the rank holds a shard of); use train.sharding: ddp, or give the rollout devices of its own"
        )
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 1:
        return out
    pools = raw.get("pools")
    pool_name = raw.get("train_pool", DEFAULT_TRAIN_POOL)
    units = _pool_units(pools.get(pool_name)) if isinstance(pools, Mapping) else None
    if units is not None and units % tp:
        out.append(
            f"train.tensor_parallel: {tp} does not divide the {units} ranks of pools.{pool_name}; give the train pool "
            f"a multiple of {tp} devices or change train.tensor_parallel"
        )
    heads = _attention_heads(train.get("model") or raw.get("model"))
    if heads is not None and (heads[0] % tp or heads[1] % tp):
        out.append(
            f"train.tensor_parallel: {tp} must divide the model's {heads[0]} attention heads and {heads[1]} KV "
            f"heads; use a divisor of {math.gcd(heads[0], heads[1])}"
        )
    return out


def cross_field_problems(raw: Mapping[str, Any]) -> list[str]:
    """The checks that relate several sections (pool names, the critic of ``advantage: gae``, the task
    groups against ``rollout.num_env_groups``), on a config mapping — also one whose fields have errors
    of their own, so that :func:`validate_config` reports these with them, not after they are fixed.
    Values of the wrong type are skipped (their own field reports them)."""
    out = model_problems(raw) + colocation_problems(raw) + sharding_problems(raw) + packing_problems(raw)
    pools = raw.get("pools")
    if isinstance(pools, dict):
        for field_name in ("train_pool", "rollout_pool"):
            pool = raw.get(field_name, DEFAULT_POOLS[field_name])
            if isinstance(pool, str) and pool not in pools:
                out.append(f"{field_name}: {pool!r} is not one of pools {sorted(pools)}; name one of them")
        out += elastic_problems(raw, pools)
    advantage, critic = raw.get("advantage", "grpo"), raw.get("critic")
    if advantage == "gae" and critic is None:
        out.append(
            "advantage: gae needs a critic: add `critic: {epochs: 2}` or `critic: {preset: sao}` (see CriticConfig)"
        )
    if critic is not None and isinstance(advantage, str) and advantage != "gae":
        out.append(f"critic: is set but advantage={advantage!r} never uses it; set advantage: gae or remove critic:")
    envs, data = raw.get("envs") or [], raw.get("data") or []
    data = [data] if isinstance(data, dict) else data
    if isinstance(envs, list) and isinstance(data, list) and not envs and not data:
        out.append("envs: no task to train on; add envs: [{name: reverse}] or data: {train: FILE.jsonl}")
    from rollart.envservice.config import env_service_problems

    out += env_service_problems(raw)
    rollout: Mapping[str, Any] = raw["rollout"] if isinstance(raw.get("rollout"), dict) else {}
    wanted = rollout.get("num_env_groups", RolloutConfig.model_fields["num_env_groups"].default)
    tasks = [*envs, *data] if isinstance(envs, list) and isinstance(data, list) else None
    groups = [t.get("groups", 1) if isinstance(t, dict) else None for t in tasks or []]
    if tasks and isinstance(wanted, int) and all(isinstance(g, int) for g in groups):
        total = sum(g for g in groups if g is not None)
        if total != wanted:
            which = "envs[*].groups + data[*].groups" if data else "envs[*].groups"
            out.append(f"{which} add up to {total} but rollout.num_env_groups is {wanted}; make them equal")
    task_cfgs = raw.get("tasks")
    batch = rollout.get("batch_groups", RolloutConfig.model_fields["batch_groups"].default)
    if isinstance(task_cfgs, dict) and isinstance(batch, int) and batch >= 1:
        from rollart.rollout.quotas import ratio_problems

        given = {str(t): c.get("ratio") for t, c in task_cfgs.items() if isinstance(c, dict)}
        ratios: dict[str, float] = {
            t: float(r) for t, r in given.items() if isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0
        }
        if ratios and len(ratios) == sum(r is not None for r in given.values()):  # a bad ratio reports itself
            out += ratio_problems(ratios, batch)
    return out


def elastic_problems(raw: Mapping[str, Any], pools: Mapping[str, Any]) -> list[str]:
    """Only the rollout pool may be elastic (``max_devices``), and its weights must reach workers that
    join later (``weights.channel`` ray or mooncake; a ``dist`` broadcast has a fixed group, ``inprocess``
    weights stay inside the train ranks)."""
    rollout_pool = raw.get("rollout_pool", DEFAULT_ROLLOUT_POOL)
    out = []
    elastic = raw.get("elastic")
    if isinstance(elastic, Mapping) and elastic.get("autoscale") not in (None, False):
        groups = pools.get(rollout_pool)
        items = groups if isinstance(groups, list) else [groups]
        if not any(isinstance(g, Mapping) and g.get("max_devices") is not None for g in items):
            out.append(
                f"elastic.autoscale: the rollout pool (pools.{rollout_pool}) is not elastic, so there is nothing to "
                f"size; give pools.{rollout_pool} max_devices, or drop elastic.autoscale"
            )
    for name, groups in pools.items():
        items = groups if isinstance(groups, list) else [groups]
        for i, g in enumerate(items):
            if not isinstance(g, Mapping) or g.get("max_devices") is None:
                continue
            where = f"pools.{name}[{i}].max_devices" if isinstance(groups, list) else f"pools.{name}.max_devices"
            if name != rollout_pool:
                out.append(
                    f"{where}: only the rollout pool (rollout_pool: {rollout_pool}) can be elastic; "
                    f"drop max_devices from pools.{name}"
                )
                continue
            weights = raw.get("weights")
            channel = weights.get("channel", "ray") if isinstance(weights, Mapping) else "ray"
            caps = channel_kind(channel)
            if caps is not None and not caps.serves_joiners:
                how = {"dist": " broadcasts to a fixed group", "inprocess": " stays inside each train rank (colocated)"}
                can = " or ".join(k for k, c in WEIGHT_CHANNELS.items() if c.serves_joiners and k != "none")
                out.append(
                    f"{where}: an elastic pool needs weights that workers joining later can load; weights.channel "
                    f"{channel}{how.get(channel, ' does not declare serves_joiners')}: use {can}"
                )
    return out


def _check_tracking(names: Sequence[str]) -> None:
    """Every tracker's library is importable (each is a pip extra of the same name)."""
    import importlib.util

    for name in names:
        if name != "jsonl" and importlib.util.find_spec(name) is None:
            raise ValueError(
                f"tracking: {name} needs the {name} package; install it with pip install 'rollart[{name}]' "
                f"or remove {name} from tracking"
            )
