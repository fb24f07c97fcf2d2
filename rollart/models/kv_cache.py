"""The key/value cache of a Hugging Face causal LM's forward, across transformers versions.

transformers 5.x names the argument and the output field ``cache``; ``past_key_values`` still works
there with a deprecation warning and goes away in 5.40. Older versions know only ``past_key_values``.
:func:`cache_kwargs` and :func:`output_cache` pick the name the installed version uses.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["cache_kwargs", "output_cache"]


@functools.cache
def _argument(forward_of: type) -> str:
    params = inspect.signature(forward_of.forward).parameters  # follows the decorators' __wrapped__
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(...)``: the argument ``model``'s forward takes the cache as. Wrappers
    that hand their keyword arguments on are looked through: ``torch.compile``'s (``_orig_mod``) and a
    PEFT model's (``get_base_model()``, e.g. LoRA)."""
    inner = getattr(model, "_orig_mod", model)
    if callable(getattr(inner, "get_base_model", None)):
        inner = inner.get_base_model()
    return {_argument(type(inner)): cache}


def output_cache(out: Any) -> Any:
    """The cache a forward with ``use_cache=True`` returned (``out.cache``, else ``out.past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
