"""The options of the built-in torch engine (``engine: {kind: torch, options: {...}}``), checked when a
config is validated, before any actor starts (no torch import here)."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from rollart.config_model import ConfigModel, type_problem

__all__ = ["STATIC_ONLY", "TorchEngineOptions", "torch_option_problems"]

STATIC_ONLY = ("max_model_len", "max_prefill_tokens", "prefix_cache_tokens", "cuda_graphs", "torch_compile")
"""Options of the static-cache engine that ``kv_cache: dynamic`` does not take."""


class TorchEngineOptions(ConfigModel):
    """``engine.options`` of the torch engine (unknown options refused, strict types like every config section)."""

    device: str | None = None
    """`cpu`, `cuda`, `cuda:1`; null: the inference worker's own device."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """The weights' and the KV cache's dtype."""
    max_batch_size: int = Field(default=256, ge=1)
    """Requests running at once (the KV cache's slots); more wait for a free slot."""
    prefix_sharing: bool = True
    """Identical sequences that join together (the n samples of a prompt) are prefilled once."""
    kv_cache: Literal["auto", "static", "dynamic"] = "auto"
    """`static`: the static-cache engine (Llama, Qwen2, Qwen3, Mistral without sliding window); `dynamic`: the
    Hugging Face forward over a left-padded `DynamicCache` (any causal LM); `auto`: static where it runs."""
    max_model_len: int | None = Field(default=None, ge=2)
    """Positions per sequence (prompt and answer); a longer prompt is refused, an answer that reaches it ends
    with `length`; null: no limit (the cache grows by doubling as sequences need)."""
    max_prefill_tokens: int = Field(default=8192, ge=1)
    """Tokens one step prefills at most (the joining requests are packed up to it; a longer prompt joins alone)."""
    prefix_cache_tokens: int = Field(default=32768, ge=0)
    """The prefix cache's budget in tokens (finished requests' keys and values, reused by requests that start
    with the same tokens, least recently used evicted first); 0: off."""
    cuda_graphs: bool = True
    """On a CUDA device: replay the decode step from CUDA graphs captured at a few batch and context sizes."""
    torch_compile: bool = True
    """With CUDA graphs: fuse the decoder's elementwise steps (norms, rotary embedding, SiLU gate) with
    `torch.compile` (in bf16 they round differently from the unfused steps)."""

    @model_validator(mode="after")
    def _dynamic_takes_fewer(self) -> TorchEngineOptions:
        given = sorted(self.model_fields_set & set(STATIC_ONLY))
        if self.kv_cache == "dynamic" and given:
            raise ValueError(
                f"{given}: options of the static-cache torch engine; kv_cache: dynamic takes device, dtype, "
                "max_batch_size and prefix_sharing"
            )
        return self


def torch_option_problems(options: dict[str, Any]) -> list[str]:
    """What is wrong with ``engine.options`` of the torch engine, each naming the option and the fix."""
    try:
        TorchEngineOptions.model_validate(options)
    except ValidationError as err:
        out = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"])
            msg = type_problem(e) or e["msg"].removeprefix("Value error, ")
            if e["type"] == "extra_forbidden":
                close = difflib.get_close_matches(str(e["loc"][-1]), list(TorchEngineOptions.model_fields), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                msg = (
                    f"not an option of the torch engine; {hint}"
                    f"its options: {', '.join(TorchEngineOptions.model_fields)}"
                )
            out.append(f"engine.options.{where}: {msg}" if where else f"engine.options: {msg}")
        return out
    return []
