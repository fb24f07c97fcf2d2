"""Colocated mode (``pools.<rollout>: {colocate_with: <train>}``) against the rest of a raw config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollart.resource_manager.specs import ResourceSpecError, colocation_target
from rollart.weights.kinds import WEIGHT_CHANNELS, channel_kind

DEFAULT_TRAIN_POOL = "train"
"""``train_pool`` when a config does not set it."""
DEFAULT_ROLLOUT_POOL = "rollout"
"""``rollout_pool`` when a config does not set it."""


def colocated_pools(raw: Mapping[str, Any]) -> bool:
    """Whether the config's rollout pool is ``{colocate_with: <its train pool>}`` (colocated mode)."""
    pools = raw.get("pools")
    rollout = raw.get("rollout_pool", DEFAULT_ROLLOUT_POOL)
    train = raw.get("train_pool", DEFAULT_TRAIN_POOL)
    if not isinstance(pools, Mapping) or not isinstance(rollout, str) or rollout not in pools:
        return False
    try:
        return colocation_target(rollout, pools[rollout]) == train
    except ResourceSpecError:  # parse_pools reports it
        return False


def _pool_units(pool: Any) -> int | None:
    """Devices (or CPUs) of a pool spec; None when it is not one the count can be read from."""
    groups = pool if isinstance(pool, list) else [pool]
    units = [g.get("devices", g.get("cpus")) if isinstance(g, Mapping) else None for g in groups]
    return sum(units) if all(isinstance(u, int) for u in units) else None  # type: ignore[arg-type]


def colocation_problems(raw: Mapping[str, Any]) -> list[str]:
    """Colocated mode (``pools.<rollout>: {colocate_with: <train>}``) against the rest of the config: which
    pool may colocate, the supported ``rollout.alpha`` (0), the weight channel (``inprocess``), engines with
    a sleep mode and the train pool size they declare (vLLM: one device), the torch strategy, and no
    inference restart policy of its own."""
    pools = raw.get("pools")
    if not isinstance(pools, Mapping):
        return []
    train = raw.get("train_pool", DEFAULT_TRAIN_POOL)
    rollout_pool = raw.get("rollout_pool", DEFAULT_ROLLOUT_POOL)
    out = []
    for name, spec in pools.items():
        try:
            target = colocation_target(str(name), spec)
        except ResourceSpecError:
            continue  # parse_pools reports it
        if target is None:
            continue
        if name != rollout_pool:
            out.append(
                f"pools.{name}.colocate_with: only the rollout pool (rollout_pool: {rollout_pool!r}) can share "
                f"devices, with the train pool ({train!r}); give {name!r} devices of its own"
            )
        elif target != train and target in pools:
            out.append(
                f"pools.{name}.colocate_with: the rollout colocates with the trainer; name the train pool {train!r} "
                "(train_pool), or give the rollout devices of its own"
            )

    def section(key: str) -> Mapping[str, Any]:
        value = raw.get(key)
        return value if isinstance(value, Mapping) else {}

    channel = section("weights").get("channel")
    channel_caps = channel_kind(channel)
    if not colocated_pools(raw):
        if channel_caps is not None and channel_caps.colocated:
            others = ", ".join(k for k, c in WEIGHT_CHANNELS.items() if not c.colocated and k != "none")
            out.append(
                f"weights.channel: {channel} moves the weights inside a colocated rank; it needs "
                f"pools.{rollout_pool}: {{colocate_with: {train}}}, or use channel {others}"
            )
        return out
    mode = f"colocated mode (pools.{rollout_pool}: {{colocate_with: {train}}})"
    alpha = section("rollout").get("alpha", 0)
    if isinstance(alpha, int) and not isinstance(alpha, bool) and alpha != 0:
        out.append(
            f"rollout.alpha: {alpha} is not supported in {mode}, which supports alpha 0 only: the trainer and the "
            "engine take turns on the same devices, so the rollout cannot run ahead while the trainer steps (what "
            "alpha >= 1 is for); set rollout.alpha: 0, or give the rollout devices of its own to train asynchronously"
        )
    if channel_caps is not None and not channel_caps.colocated:
        out.append(
            f"weights.channel: {channel!r} does not apply in {mode}: each engine takes its trainer's weights inside "
            "its own process (channel inprocess); drop weights.channel"
        )
    out += _colocated_engine_problems(
        section("engine"), section("train").get("strategy", "torch"), pools.get(train), mode
    )
    if "inference" in section("fault"):
        out.append(
            f"fault.inference: in {mode} the engines live in the trainer's ranks and a dead one is a dead trainer "
            "rank (fault.train restarts it); drop fault.inference"
        )
    return out


def _colocated_engine_problems(engine: Mapping[str, Any], strategy: Any, train_pool: Any, mode: str) -> list[str]:
    """The engine and the strategy a colocated rank can hold (their declared capabilities)."""
    from rollart.engines.kinds import ENGINES, engine_kind
    from rollart.training.kinds import STRATEGIES, strategy_kind

    out = []
    kind = engine.get("kind", "torch")
    engine_caps = engine_kind(kind)
    if engine_caps is not None and not engine_caps.sleeps:
        if kind in ENGINES:
            sleeping = " or ".join(k for k, e in ENGINES.items() if e.sleeps)
            out.append(
                f"engine.kind: {kind!r} has no sleep mode, which {mode} needs; use {sleeping} (or your MODULE:CLASS "
                "engine that implements sleep and wake_up), or give the rollout devices of its own"
            )
        else:
            out.append(
                f"engine.kind: {kind} does not implement sleep and wake_up (rollart.engines.base.InferenceEngine), "
                f"which {mode} needs; implement them, or give the rollout devices of its own"
            )
    strategy_caps = strategy_kind(strategy)
    if strategy_caps is not None and not strategy_caps.colocates:
        can = " or ".join(k for k, c in STRATEGIES.items() if c.colocates)
        out.append(
            f"train.strategy: {strategy!r} is not supported in {mode} (it does not declare colocates); use {can}, "
            "or give the rollout devices of its own"
        )
    units = _pool_units(train_pool)
    most = engine_caps.max_colocated_devices if engine_caps is not None else None
    if most is not None and units is not None and units > most:
        pool = "a one-device train pool" if most == 1 else f"a train pool of at most {most} devices"
        others = " or ".join(k for k, e in ENGINES.items() if e.sleeps and e.max_colocated_devices is None)
        out.append(
            f"engine.kind: {kind} in {mode} needs {pool} ({units} here): the engine declares max_colocated_devices "
            f"{most} (each rank's in-process engine would set up a torch.distributed group of its own beside the "
            f"trainer's); use {others}, or devices: {most}"
        )
    return out
