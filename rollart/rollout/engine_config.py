"""Which inference engine a worker runs, as a config entry (``engine: {kind: torch, model: ...}``)."""

from __future__ import annotations

import importlib
from typing import Any

from rollart.engines.base import InferenceEngine
from rollart.engines.kinds import ENGINES
from rollart.rollout.config import EngineConfig

LATENCY_OPTIONS = ("decode_base_s", "decode_per_seq_s", "prefill_per_token_s")


def simulated_options(options: dict[str, Any], hardware: str | None) -> dict[str, Any]:
    """The simulated engine's options with ``profile: auto`` resolved to ``hardware`` (the worker's)."""
    profile = options.get("profile")
    if profile is None:
        return options
    both = [k for k in LATENCY_OPTIONS if k in options]
    if both:
        raise ValueError(f"engine.options: profile={profile!r} sets the step time; drop {both} or drop profile")
    if profile == "auto":
        if not hardware:
            raise ValueError(
                "engine.options.profile: 'auto' takes the worker's hardware, but this engine has none; "
                "name the hardware (profile: H800) or build it inside a worker of a pool with hardware"
            )
        options = {**options, "profile": hardware}
    return options


def build_engine(
    cfg: EngineConfig | dict[str, Any],
    device: str | None = None,
    hardware: str | None = None,
    *,
    colocated: bool = False,
) -> InferenceEngine:
    """The engine of ``cfg``; the torch engine runs on ``device`` (the worker's) unless its options say;
    the simulated engine's ``profile: auto`` becomes ``hardware`` (the worker's hardware type).
    ``colocated``: the engine will sleep while a trainer in its process steps (vLLM turns its sleep mode on)."""
    cfg = EngineConfig.model_validate(cfg)
    if cfg.kind == "torch" and device is not None and "device" not in cfg.options:
        cfg = cfg.model_copy(update={"options": {**cfg.options, "device": device}})
    if colocated and cfg.kind == "vllm":
        cfg = cfg.model_copy(update={"options": {**cfg.options, "sleep_mode": True}})
    target = ENGINES[cfg.kind].target if cfg.kind in ENGINES else cfg.kind
    if ":" not in target:
        raise ValueError(f"engine.kind={cfg.kind!r}: use one of {sorted(ENGINES)} or 'module:Class'")
    if cfg.plugin_paths:
        from rollart.plugins import add_search_path

        add_search_path(cfg.plugin_paths)  # a MODULE:CLASS engine next to the config
    module, cls_name = target.split(":", 1)
    cls = getattr(importlib.import_module(module), cls_name)
    if cfg.kind == "simulated":
        return cls(**simulated_options(cfg.options, hardware))
    model = cfg.model
    if model is None:
        from rollart.models import default_tiny_path

        model = str(default_tiny_path())
    return cls(model, **cfg.options)
