"""Real model shapes with random weights, built offline: ``model: {shape: qwen2.5-0.5b}``.

A shape is a published architecture: its layer count, hidden size, attention and KV heads, MLP size,
vocabulary, RoPE theta and embedding tying, as in the model's released ``config.json``. rollart builds
it with random weights so throughput (engine decode, training steps, weight sync) can be measured at
real sizes with nothing downloaded.

:func:`shape_folder` writes a Hugging Face folder (``config.json``, ``generation_config.json``, the
tokenizer, and ``rollart_shape.json``) under ``$ROLLART_CACHE`` (default ``~/.cache/rollart``); it
holds no weights. Every loader in rollart (:func:`load_pretrained`: the trainers, the reference and
critic models, the torch engine, export) builds a folder with that marker file with seeded random
weights: uniform with the architecture's ``initializer_range`` as standard deviation, norms 1, biases 0,
made on the CPU in float32, so every process of a run starts from the same weights. vLLM and SGLang
load it with their ``dummy`` load format (their own random weights: the first weight update makes them
the trainer's).

The tokenizer is the built-in character-level one (:func:`rollart.models.tiny.build_tokenizer`, with
the ChatML template): usable for throughput, not Qwen's own (the model's vocabulary keeps the shape's
151 936 rows; ids beyond the tokenizer's decode to nothing). ``layers`` cuts the layer count (a quick
smoke test of the full-width shape); ``seed`` picks the weights.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from rollart.config_model import ConfigModel

MARKER = "rollart_shape.json"
"""The file that marks a folder whose weights are built at random when it is loaded."""
_BUILDER_VERSION = 1  # part of the cache key: a change of the folder's contents builds a new one


@dataclass(frozen=True)
class Architecture:
    """The numbers of a published decoder-only architecture (Qwen2 family)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    tied_embeddings: bool
    max_positions: int
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self, layers: int | None = None) -> int:
        """Parameter count from the architecture (Qwen2: biases on q, k and v; RMSNorms)."""
        n = self.layers if layers is None else layers
        kv = self.kv_heads * self.head_dim
        attention = self.hidden * self.hidden + self.hidden + 2 * (self.hidden * kv + kv) + self.hidden * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attention + mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return n * per_layer + self.hidden + embeddings

    def kv_bytes_per_token(self, bytes_per_value: float, layers: int | None = None) -> float:
        """KV-cache bytes of one token: layers · (K, V) · KV heads · head dim · bytes."""
        n = self.layers if layers is None else layers
        return n * 2 * self.kv_heads * self.head_dim * bytes_per_value


SHAPES: dict[str, Architecture] = {
    # Qwen2.5-0.5B(-Instruct) config.json: 494 032 768 parameters
    "qwen2.5-0.5b": Architecture(
        "qwen2.5-0.5b",
        layers=24,
        hidden=896,
        heads=14,
        kv_heads=2,
        intermediate=4864,
        vocab=151936,
        rope_theta=1_000_000.0,
        tied_embeddings=True,
        max_positions=32768,
    ),
    # Qwen2.5-1.5B(-Instruct) config.json: 1 543 714 304 parameters
    "qwen2.5-1.5b": Architecture(
        "qwen2.5-1.5b",
        layers=28,
        hidden=1536,
        heads=12,
        kv_heads=2,
        intermediate=8960,
        vocab=151936,
        rope_theta=1_000_000.0,
        tied_embeddings=True,
        max_positions=32768,
    ),
    # Qwen2.5-3B(-Instruct) config.json: 3 085 938 688 parameters
    "qwen2.5-3b": Architecture(
        "qwen2.5-3b",
        layers=36,
        hidden=2048,
        heads=16,
        kv_heads=2,
        intermediate=11008,
        vocab=151936,
        rope_theta=1_000_000.0,
        tied_embeddings=True,
        max_positions=32768,
    ),
    # Qwen2.5-7B(-Instruct) config.json: 7 615 616 512 parameters
    "qwen2.5-7b": Architecture(
        "qwen2.5-7b",
        layers=28,
        hidden=3584,
        heads=28,
        kv_heads=4,
        intermediate=18944,
        vocab=152064,
        rope_theta=1_000_000.0,
        tied_embeddings=False,
        max_positions=32768,
    ),
}


def unknown_shape(name: str) -> str:
    """The error text for a shape name that is not in :data:`SHAPES`."""
    return f"unknown shape {name!r}; the known shapes are {', '.join(sorted(SHAPES))}"


class ShapeConfig(ConfigModel):
    """``model: {shape: NAME}`` in a pipeline config (``layers`` and ``seed`` optional)."""

    model_config = ConfigDict(frozen=True)

    shape: str
    """A name of :data:`SHAPES`, e.g. `qwen2.5-0.5b`."""
    layers: int | None = Field(default=None, ge=1)
    """Fewer layers than the shape, at its full width (a quick smoke test); null: the shape's own."""
    seed: int = 0
    """The seed of the random weights."""

    @field_validator("shape")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in SHAPES:
            raise ValueError(unknown_shape(name))
        return name

    @property
    def architecture(self) -> Architecture:
        return SHAPES[self.shape]

    @property
    def num_layers(self) -> int:
        return self.layers or self.architecture.layers

    def params(self) -> int:
        return self.architecture.params(self.num_layers)


def hf_config(spec: ShapeConfig, bos: int = 1, eos: int = 2, pad: int = 0) -> Any:
    """The ``Qwen2Config`` of ``spec`` (special token ids from the tokenizer)."""
    from transformers import Qwen2Config

    a = spec.architecture
    return Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.max_positions,
        rope_theta=a.rope_theta,
        rms_norm_eps=a.rms_norm_eps,
        initializer_range=a.initializer_range,
        tie_word_embeddings=a.tied_embeddings,
        use_sliding_window=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def shape_folder(spec: ShapeConfig | dict[str, Any] | str) -> Path:
    """The Hugging Face folder of ``spec`` (config, tokenizer, marker; no weights), written once into
    ``$ROLLART_CACHE``. A file lock keeps concurrent processes from racing. Takes well under a second."""
    from transformers import GenerationConfig

    from rollart.models.tiny import build_tokenizer, default_corpus

    spec = ShapeConfig.model_validate({"shape": spec} if isinstance(spec, str) else spec)
    key_src = json.dumps({**spec.model_dump(), "v": _BUILDER_VERSION}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:10]
    root = Path(os.environ.get("ROLLART_CACHE", Path.home() / ".cache" / "rollart"))
    root.mkdir(parents=True, exist_ok=True)
    name = f"shape-{spec.shape}-{key}"
    target = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / MARKER).exists():
            tmp = root / f"{name}.building"
            tmp.mkdir(exist_ok=True)
            tok: Any = build_tokenizer(default_corpus(seed=spec.seed), tmp, chat=True)
            cfg = hf_config(spec, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
            cfg.save_pretrained(str(tmp))
            GenerationConfig(
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
            ).save_pretrained(str(tmp))
            marker = {
                **spec.model_dump(),
                "architecture": asdict(spec.architecture),
                "params": spec.params(),
                "weights": "random: built when loaded (rollart.models.shapes)",
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=1))
            os.replace(tmp, target)
    return target


def is_shape_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a shape folder (random weights built when loaded)."""
    return (Path(path) / MARKER).is_file()


def read_shape(path: str | os.PathLike[str]) -> ShapeConfig:
    """The shape a folder was built from."""
    raw = json.loads((Path(path) / MARKER).read_text())
    return ShapeConfig(shape=raw["shape"], layers=raw.get("layers"), seed=raw.get("seed", 0))


def init_parameter(name: str, t: Any, config: Any, gen: Any) -> None:
    """A shape's random value of parameter ``name``, written into ``t`` in place: norms 1, biases 0, the rest
    uniform with the architecture's init std, drawn from ``gen`` (the parameters in ``named_parameters`` order
    give the shape's weights)."""
    if name.endswith("norm.weight"):
        t.fill_(1.0)
    elif name.endswith(".bias"):
        t.zero_()
    else:
        bound = config.initializer_range * math.sqrt(3.0)
        t.uniform_(-bound, bound, generator=gen)


def random_model(auto_cls: Any, path: str | os.PathLike[str], dtype: Any = None) -> Any:
    """``auto_cls`` (``AutoModelForCausalLM``, ``AutoModel``) of a shape folder with seeded random
    weights: built on the meta device (no time spent on the library's own initialisation), then every
    parameter filled on the CPU in float32 from one generator, in name order (module docstring)."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    spec = read_shape(path)
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = auto_cls.from_config(config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty gives the tied output layer its own storage
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied matrix once (named_parameters deduplicates)
            init_parameter(name, p, config, gen)
        for module_name, module in list(model.named_modules()):  # the rotary buffers are computed, not loaded
            if isinstance(module, Qwen2RotaryEmbedding):
                parent = model.get_submodule(module_name.rsplit(".", 1)[0]) if "." in module_name else model
                setattr(parent, module_name.rsplit(".", 1)[-1], Qwen2RotaryEmbedding(config=config))
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    return model


def load_pretrained(auto_cls: Any, path: str | os.PathLike[str], dtype: Any = None) -> Any:
    """``auto_cls.from_pretrained(path, dtype=dtype)``, or the seeded random weights of a shape folder."""
    if is_shape_folder(path):
        return random_model(auto_cls, path, dtype)
    return auto_cls.from_pretrained(str(path), dtype=dtype)


def load_causal_lm(path: str | os.PathLike[str], dtype: Any = None) -> Any:
    """The causal LM of ``path`` (``AutoModelForCausalLM``), a shape folder's built at random."""
    from transformers import AutoModelForCausalLM

    return load_pretrained(AutoModelForCausalLM, path, dtype)


def weight_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a shape folder's weights as a checkpoint would hold them (a tied output layer
    left out), computed on the meta device (no memory, no time)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k.startswith("lm_head."))}


def hf_state_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The weights of a shape folder as a Hugging Face state dict (float32, CPU)."""
    return dict(load_causal_lm(path).state_dict())
