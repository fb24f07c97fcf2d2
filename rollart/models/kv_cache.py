"""Key/value caches: the argument of a Hugging Face forward across transformers versions, and the
torch engine's static cache.

transformers 5.x names the argument and the output field ``cache``; ``past_key_values`` still works
there with a deprecation warning and goes away in 5.40. Older versions know only ``past_key_values``.
:func:`cache_kwargs` and :func:`output_cache` pick the name the installed version uses.

:class:`StaticKVCache` holds the keys and values of up to ``max_slots`` sequences in preallocated
tensors per layer, ``[slots, kv_heads, capacity, head_dim]``: a sequence owns one slot and writes its
position ``p`` at column ``p``, so sequences join and leave without moving the others. It is sized on
demand: ``reserve`` grows the slot count and the capacity to the next power of two that holds what is
asked (at most ``max_slots`` and ``max_len``), copying the old contents once per growth; ``generation``
counts the reallocations (CUDA graphs captured against the old tensors must be captured again).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

__all__ = ["StaticKVCache", "cache_kwargs", "output_cache"]


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


def _pow2_at_least(n: int, floor: int) -> int:
    size = floor
    while size < n:
        size *= 2
    return size


class StaticKVCache:
    """Preallocated keys and values for sequences in slots (module docstring)."""

    MIN_SLOTS = 4
    MIN_CAPACITY = 64

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_slots: int,
        max_len: int | None = None,
    ):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_slots, self.max_len = max_slots, max_len
        self.keys: list[torch.Tensor] = []  # per layer, [slots, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.generation = 0

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def reserve(self, slots: int, length: int) -> bool:
        """Hold slot indices ``< slots`` and positions ``< length``; True when it reallocated."""
        if slots > self.max_slots:
            raise ValueError(f"{slots} slots asked of a cache of at most {self.max_slots} (max_batch_size)")
        if self.max_len is not None and length > self.max_len:
            raise ValueError(f"{length} positions asked of a cache of at most {self.max_len} (max_model_len)")
        if slots <= self.slots and length <= self.capacity:
            return False
        new_slots = min(self.max_slots, _pow2_at_least(max(slots, self.slots), self.MIN_SLOTS))
        new_cap = _pow2_at_least(max(length, self.capacity), self.MIN_CAPACITY)
        if self.max_len is not None:
            new_cap = min(new_cap, self.max_len)
        shape = (new_slots, self.kv_heads, new_cap, self.head_dim)
        s, c = self.slots, self.capacity
        for tensors in (self.keys, self.values):
            for i in range(self.layers):  # one layer at a time: at most one old layer more is held
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(tensors):
                    new[:s, :, :c] = tensors[i]
                    tensors[i] = new
                else:
                    tensors.append(new)
        self.generation += 1
        return True

    def release(self) -> None:
        """Drop the tensors (the next ``reserve`` allocates them again)."""
        self.keys, self.values = [], []
        self.generation += 1

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values, ``[slots, kv_heads, capacity, head_dim]`` each."""
        return self.keys[i], self.values[i]

    def read(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``start .. end-1`` of ``slot``, ``[end-start, layers, kv_heads, head_dim]``."""
        keys = torch.stack([k[slot, :, start:end] for k in self.keys]).permute(2, 0, 1, 3)
        values = torch.stack([v[slot, :, start:end] for v in self.values]).permute(2, 0, 1, 3)
        return keys, values

    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``[n, layers, kv_heads, head_dim]`` keys and values at positions ``start .. start+n-1`` of ``slot``."""
        n = keys.shape[0]
        for i in range(self.layers):
            self.keys[i][slot, :, start : start + n] = keys[:, i].transpose(0, 1)
            self.values[i][slot, :, start : start + n] = values[:, i].transpose(0, 1)

    def copy_slots(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first ``length`` positions of each slot of ``src`` into the slot of ``dst`` at its index."""
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[:, :, :length].index_copy_(0, dst_t, t[:, :, :length].index_select(0, src_t))
