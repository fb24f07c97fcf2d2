"""A model's weights one tensor at a time, and its skeleton without weights.

A sharded trainer (``train.sharding: fsdp``) never holds the whole model in one process: it builds the
module with its parameters on the ``meta`` device (:func:`empty_causal_lm`), shards it, and fills each
rank's shards from :func:`iter_weights`, which yields the full tensors one by one, so the peak extra
memory of loading is one tensor (the largest, the embedding), not the model.

:func:`iter_weights` gives exactly what :func:`rollart.models.shapes.load_causal_lm` loads, bit for bit:
a shape folder's seeded random weights drawn from the same generator in the same order, or a Hugging
Face folder's ``*.safetensors`` files read tensor by tensor (converted to the requested dtype).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rollart.models.shapes import init_parameter, is_shape_folder, read_shape


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside put their parameters on ``meta`` and their buffers where they are made (the
    CPU), so computed buffers such as rotary frequencies stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            assert p is not None
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def empty_causal_lm(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> Any:
    """The causal LM of ``path`` with every parameter on the ``meta`` device (no memory) and its buffers
    real, output embeddings tied as the config says."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def parameter_names(model: torch.nn.Module) -> list[str]:
    """The model's parameters in registration order, a tied matrix once (``named_parameters``)."""
    return [name for name, _ in model.named_parameters()]


def _random_weights(path: str | os.PathLike[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """A shape folder's weights as :func:`rollart.models.shapes.random_model` draws them: one generator,
    the parameters in registration order, norms 1, biases 0, the rest uniform with the init std."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    skeleton = empty_causal_lm(path)
    gen = torch.Generator().manual_seed(read_shape(path).seed)
    with torch.no_grad():
        for name, p in skeleton.named_parameters():
            t = torch.empty(p.shape, dtype=torch.float32)
            init_parameter(name, t, config, gen)
            yield name, t if dtype == torch.float32 else t.to(dtype)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in dict.fromkeys(weight_map.values())]
    single = folder / "model.safetensors"
    return [single] if single.exists() else sorted(folder.glob("*.safetensors"))


def iter_weights(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor on the CPU)`` for every weight of ``path``, one at a time. A folder without
    ``*.safetensors`` files (``pytorch_model.bin`` only) is loaded whole once, then yielded."""
    if is_shape_folder(path):
        yield from _random_weights(path, dtype)
        return
    files = _safetensors_files(Path(path))
    if not files:
        from rollart.models.shapes import load_causal_lm

        state = load_causal_lm(path, dtype=dtype).state_dict()
        for name in list(state):
            yield name, state.pop(name)
        return
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = f.get_tensor(name)
                yield name, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


__all__ = ["empty_causal_lm", "iter_weights", "parameter_names"]
