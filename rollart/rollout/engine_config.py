"""Which inference engine a worker runs, as a config entry (``engine: {kind: torch, model: ...}``)."""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart.engines.base import InferenceEngine

ENGINE_KINDS: dict[str, str] = {
    "torch": "rollart.engines.torch_engine:TorchEngine",
    "vllm": "rollart.engines.vllm_engine:VLLMEngine",
    "sglang": "rollart.engines.sglang_engine:SGLangEngine",
    "simulated": "rollart.engines.simulated:SimulatedEngine",
}


class EngineConfig(BaseModel):
    """``kind`` is one of ``torch`` (default), ``vllm``, ``sglang``, ``simulated`` or ``module:Class``;
    ``model`` a Hugging Face folder (default: the built-in tiny model); ``options`` go to the engine."""

    model_config = ConfigDict(extra="forbid")

    kind: str = "torch"
    model: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)


def build_engine(cfg: EngineConfig | dict[str, Any], device: str | None = None) -> InferenceEngine:
    """The engine of ``cfg``; the torch engine runs on ``device`` (the worker's) unless its options say."""
    cfg = EngineConfig.model_validate(cfg)
    if cfg.kind == "torch" and device is not None and "device" not in cfg.options:
        cfg = cfg.model_copy(update={"options": {**cfg.options, "device": device}})
    target = ENGINE_KINDS.get(cfg.kind, cfg.kind)
    if ":" not in target:
        raise ValueError(f"engine.kind={cfg.kind!r}: use one of {sorted(ENGINE_KINDS)} or 'module:Class'")
    module, cls_name = target.split(":", 1)
    cls = getattr(importlib.import_module(module), cls_name)
    if cfg.kind == "simulated":
        return cls(**cfg.options)
    model = cfg.model
    if model is None:
        from rollart.models import default_tiny_path

        model = str(default_tiny_path())
    return cls(model, **cfg.options)
