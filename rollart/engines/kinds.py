"""The inference engines a config can name (``engine.kind``), each with what it can do.

An engine's capabilities are attributes of its class (:class:`rollart.engines.base.InferenceEngine`):
:meth:`~rollart.engines.base.InferenceEngine.sleeps` (it implements ``sleep`` and ``wake_up``: colocated
mode needs that), ``loads_model`` (it loads a Hugging Face model, so the config checks that
``engine.model`` / ``model`` exists) and ``max_colocated_devices`` (the most devices a colocated train
pool may have with it: vLLM's is 1). The built-in engines are listed here with the same capabilities, so
that reading a config imports no engine (vLLM takes seconds to import); ``tests/test_component_kinds.py``
checks the two agree. Your own engine is ``engine.kind: MODULE:CLASS``: one module, its capabilities read
from its class. This module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineKind:
    """An inference engine: its name, its class as ``"module:Class"`` and its capabilities."""

    name: str
    target: str
    sleeps: bool
    """It has a sleep mode (``sleep`` / ``wake_up``), which colocated mode needs."""
    loads_model: bool
    """It loads a Hugging Face model (``engine.model``, else the pipeline's ``model``)."""
    max_colocated_devices: int | None = None
    """The most devices of a colocated train pool it runs on (one engine per rank); None: any number."""


ENGINES: dict[str, EngineKind] = {
    k.name: k
    for k in (
        EngineKind("torch", "rollart.engines.torch_engine:TorchEngine", sleeps=True, loads_model=True),
        # colocated, each rank's in-process vLLM sets up a torch.distributed group of its own beside the trainer's
        EngineKind(
            "vllm", "rollart.engines.vllm_engine:VLLMEngine", sleeps=True, loads_model=True, max_colocated_devices=1
        ),
        EngineKind("sglang", "rollart.engines.sglang_engine:SGLangEngine", sleeps=False, loads_model=True),
        EngineKind("simulated", "rollart.engines.simulated:SimulatedEngine", sleeps=False, loads_model=False),
    )
}
"""The built-in engines by name."""


def engine_kind(kind: object) -> EngineKind | None:
    """The kind of ``engine.kind``: a built-in's, or a ``MODULE:CLASS`` engine's read from its class
    (importing it). None when ``kind`` names neither (or the class does not import: the inference workers report that when they build it)."""
    if not isinstance(kind, str):
        return None
    if kind in ENGINES:
        return ENGINES[kind]
    if ":" not in kind:
        return None
    from rollart.engines.base import InferenceEngine
    from rollart.plugins import import_object

    try:
        cls = import_object(kind, "engine.kind")
    except Exception:  # not checked here: the inference workers report it when they build the engine
        return None
    if not (isinstance(cls, type) and issubclass(cls, InferenceEngine)):
        return None
    return EngineKind(
        kind, kind, sleeps=cls.sleeps(), loads_model=cls.loads_model, max_colocated_devices=cls.max_colocated_devices
    )


def engine_name_problem(kind: str) -> str | None:
    """Why ``engine.kind: kind`` names no engine, or None."""
    if kind in ENGINES or ":" in kind:
        return None
    from rollart.plugins import closest_hint

    hint = closest_hint(kind, ENGINES)
    return f"unknown engine {kind!r}; {hint}use one of {', '.join(ENGINES)}, or your own engine class as MODULE:CLASS"
