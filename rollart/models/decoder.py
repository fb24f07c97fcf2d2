"""A decoder forward over a static KV cache, built from a Hugging Face causal LM's own modules.

The torch engine's fast path. :class:`StaticDecoder` runs the layers of a Llama-family model (Llama,
Qwen2, Qwen3, Mistral without a sliding window: pre-norm blocks of rotary self-attention and an MLP)
calling the model's own embedding, norms, projections and MLPs, so the weights stay the model's (a
weight update, sleep and wake-up act on the model as before). Only the attention is its own: keys and
values are written into a :class:`~rollart.models.kv_cache.StaticKVCache` at each row's own position,
and a query attends to its row's cached positions, so rows of different lengths run together without
padding or copies.

- :meth:`StaticDecoder.decode` (then :meth:`StaticDecoder.head`): one token for each of the slots ``0 .. B-1`` (a free slot in that
  range computes a throw-away row), attention over the first ``columns`` positions with a per-row
  length mask. Its shapes depend only on ``(B, columns)`` and it never synchronises with the host, so
  a CUDA graph can capture it.
- :meth:`StaticDecoder.prefill`: the new tokens of several sequences packed into one stream (no
  padding); each sequence may continue a prefix already in its slot (``start > 0``).

:func:`static_decoder_unsupported` says why a model cannot take this path (the engine then keeps the
Hugging Face forward over a dynamic cache).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from rollart.models.kv_cache import StaticKVCache

log = logging.getLogger(__name__)

__all__ = ["StaticDecoder", "static_config_unsupported", "static_decoder_unsupported"]

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")
"""Model types whose layers :class:`StaticDecoder` runs (all full attention, rotary positions)."""


def _rope_type(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default")


def static_config_unsupported(config: Any) -> str | None:
    """Why a model of this config cannot run on :class:`StaticDecoder` (from its ``config.json`` alone),
    or None when it can."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model type {kind!r} (the static-cache path runs {', '.join(SUPPORTED_TYPES)})"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "layers with sliding-window attention"
    if kind == "mistral" and getattr(config, "sliding_window", None):
        return "Mistral's sliding window"
    rope = _rope_type(config)
    if "dynamic" in rope or rope == "longrope":
        return f"rope type {rope!r} (its frequencies depend on the sequence length)"
    return None


def static_decoder_unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run on :class:`StaticDecoder`, or None when it can."""
    reason = static_config_unsupported(getattr(model, "config", None))
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the model has no model.{name}"
    if not hasattr(model, "lm_head"):
        return "the model has no lm_head"
    if not hasattr(inner.rotary_emb, "inv_freq"):
        return "the rotary embedding has no inv_freq"
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a layer without q/k/v/o projections"
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return "a layer without the pre-norm block layout"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama-family RMSNorm, as its module computes it (in float32, then scaled in the input's dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual ``h + delta`` and its RMSNorm."""
    h = h + delta
    return h, rms_norm(h, weight, eps)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions applied to queries ``[N, H, D]`` and keys ``[N, KVH, D]`` (``cos``, ``sin``: ``[N, D]``)."""
    c, s = cos[:, None, :], sin[:, None, :]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _Pointwise:
    """The decoder's elementwise steps; :meth:`compile` fuses each into one kernel (torch.compile) on a GPU,
    where a decode step of a small model is bound by how many kernels it launches."""

    def __init__(self) -> None:
        self.rms_norm: Any = rms_norm
        self.add_rms_norm: Any = add_rms_norm
        self.rotate: Any = rotate
        self.silu_mul: Any = silu_mul
        self.compiled = False

    def compile(self) -> None:
        """Compile each step (at its first call); a step that fails to compile runs unfused from then on."""
        for name in ("rms_norm", "add_rms_norm", "rotate", "silu_mul"):
            setattr(self, name, self._guarded(name, torch.compile(globals()[name], dynamic=True), globals()[name]))
        self.compiled = True

    def _guarded(self, name: str, fused: Callable[..., Any], plain: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            try:
                return fused(*args)
            except Exception:
                log.warning("torch.compile of the decoder's %s failed: it runs unfused", name, exc_info=True)
                setattr(self, name, plain)
                return plain(*args)

        return call


def _fresh_groups(starts: Sequence[int], lens: Sequence[int]) -> list[list[int]]:
    """Sequences without a cached prefix, in groups of similar lengths (padded to the longest of a group,
    at most as many padding positions as real ones); groups of one are left out."""
    fresh = sorted((j for j, s in enumerate(starts) if s == 0), key=lambda j: lens[j])
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for j in fresh:
        if current and lens[j] * (len(current) + 1) > 2 * (real + lens[j]):
            groups.append(current)
            current, real = [], 0
        current.append(j)
        real += lens[j]
    groups.append(current)
    return [g for g in groups if len(g) > 1]


class _PaddedGroup:
    """Sequences prefilled from position 0, attended in one call: queries gathered into ``[G, H, L, D]``,
    keys and values read from their cache slots, a causal mask that also hides each row's padding."""

    def __init__(self, members: list[int], slots: Sequence[int], lens: Sequence[int], offsets: list[int], dev: Any):
        self.members = set(members)
        width = max(lens[j] for j in members)
        src, valid, dst = [], [], []
        for row, j in enumerate(members):
            n = lens[j]
            src += [offsets[j] + min(t, n - 1) for t in range(width)]
            valid += [row * width + t for t in range(n)]
            dst += [offsets[j] + t for t in range(n)]
        self.width, self.count = width, len(members)
        self.slots = torch.tensor([slots[j] for j in members], dtype=torch.long, device=dev)
        self.src = torch.tensor(src, dtype=torch.long, device=dev)
        self.valid = torch.tensor(valid, dtype=torch.long, device=dev)
        self.dst = torch.tensor(dst, dtype=torch.long, device=dev)
        col = torch.arange(width, device=dev)
        n = torch.tensor([lens[j] for j in members], device=dev)
        causal = col[None, :] <= col[:, None]
        self.mask = (causal[None] & (col[None, None, :] < n[:, None, None]))[:, None]  # [G, 1, L, L]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention outputs ``[Σ n, heads · head_dim]`` of the group's real tokens, in ``dst`` order."""
        heads, dim = q.shape[1], q.shape[2]
        qg = q.index_select(0, self.src).view(self.count, self.width, heads, dim).transpose(1, 2)
        kg = keys[:, :, : self.width].index_select(0, self.slots)
        vg = values[:, :, : self.width].index_select(0, self.slots)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=self.mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(self.count * self.width, heads * dim).index_select(0, self.valid)


class StaticDecoder:
    """The layers of ``model`` over ``cache`` (see the module docstring)."""

    def __init__(self, model: Any, cache: StaticKVCache):
        reason = static_decoder_unsupported(model)
        if reason is not None:
            raise ValueError(f"the static-cache decoder cannot run this model: {reason}")
        self.model = model
        self.cache = cache
        inner = model.model
        config = model.config
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.group = self.heads // self.kv_heads
        attn = self.layers[0].self_attn
        self.scaling = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        first = self.layers[0]
        self.own_norms = all(
            hasattr(m, "variance_epsilon") and hasattr(m, "weight") for m in (first.input_layernorm, self.norm)
        )
        mlp = first.mlp
        self.own_mlp = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) and isinstance(
            getattr(mlp, "act_fn", None), torch.nn.SiLU
        )
        self.ops = _Pointwise()

    # ------------------------------------------------------------------ pieces
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[N, head_dim]`` of these positions (as the model's rotary module computes them)."""
        inv_freq = self.rotary.inv_freq.to(device=positions.device, dtype=torch.float)
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(getattr(self.rotary, "attention_scaling", 1.0))
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def _norm(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, module.weight, module.variance_epsilon) if self.own_norms else module(x)

    def _add_norm(self, module: Any, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.own_norms:
            out: tuple[torch.Tensor, torch.Tensor] = self.ops.add_rms_norm(
                h, delta, module.weight, module.variance_epsilon
            )
            return out
        h = h + delta
        return h, module(h)

    def _qkv(
        self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[N, H, D]``, keys and values ``[N, KVH, D]`` of the tokens ``x [N, hidden]``, rotated."""
        attn = layer.self_attn
        n = x.shape[0]
        q = attn.q_proj(x).view(n, self.heads, self.head_dim)
        k = attn.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(n, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
        q, k = self.ops.rotate(q, k, cos, sin)
        return q, k, v

    def _mlp(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        mlp = layer.mlp
        if not self.own_mlp:
            return mlp(x)
        return mlp.down_proj(self.ops.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))

    def _write_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's keys viewed as ``[slots · kv_heads · capacity, head_dim]`` that the tokens at
        ``slots``, ``positions`` write (``[N · kv_heads]``, token-major)."""
        heads = torch.arange(self.kv_heads, device=slots.device)
        return ((slots[:, None] * self.kv_heads + heads[None, :]) * self.cache.capacity + positions[:, None]).reshape(
            -1
        )

    def _write(self, i: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        keys, values = self.cache.layer(i)
        keys.view(-1, self.head_dim).index_copy_(0, index, k.reshape(-1, self.head_dim))
        values.view(-1, self.head_dim).index_copy_(0, index, v.reshape(-1, self.head_dim))

    def _layers(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: torch.Tensor, attend: Any
    ) -> torch.Tensor:
        """Every layer over hidden states ``h``; ``attend(i, q)`` is layer ``i``'s attention output
        ``[N, heads · head_dim]``. Returns the final normed hidden states."""
        delta = None
        for i, layer in enumerate(self.layers):
            if delta is None:
                x = self._norm(layer.input_layernorm, h)
            else:
                h, x = self._add_norm(layer.input_layernorm, h, delta)
            q, k, v = self._qkv(layer, x, cos, sin)
            self._write(i, index, k, v)
            h, x = self._add_norm(layer.post_attention_layernorm, h, layer.self_attn.o_proj(attend(i, q)))
            delta = self._mlp(layer, x)
        assert delta is not None
        return self._add_norm(self.norm, h, delta)[1]

    # ------------------------------------------------------------------ decode
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, columns: int) -> torch.Tensor:
        """Final hidden states ``[B, hidden]`` (:meth:`head` makes them logits) of one token per slot
        ``0 .. B-1``: ``ids [B]`` at ``positions [B]`` (its key and value are written there), attending to
        the positions ``<=`` its own among the first ``columns``."""
        b = ids.shape[0]
        h = self.embed(ids)
        cos, sin = self._rope(positions, h.dtype)
        col = torch.arange(columns, device=ids.device)
        bias = torch.zeros((b, 1, 1, columns), dtype=h.dtype, device=ids.device)
        bias = bias.masked_fill((col[None, :] > positions[:, None])[:, None, None, :], float("-inf"))
        index = self._write_index(torch.arange(b, device=ids.device), positions)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            keys, values = self.cache.layer(i)
            # the query heads of one KV head are that head's "query positions": no repeated keys
            qg = q.view(b, self.kv_heads, self.group, self.head_dim)
            o = F.scaled_dot_product_attention(
                qg, keys[:b, :, :columns], values[:b, :, :columns], attn_mask=bias, scale=self.scaling
            )
            return o.reshape(b, self.heads * self.head_dim)

        return self._layers(h, cos, sin, index, attend)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits of final hidden states."""
        return self.lm_head(hidden)

    # ------------------------------------------------------------------ prefill
    def prefill(self, slots: Sequence[int], starts: Sequence[int], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run ``tokens[j]`` at positions ``starts[j] ..`` of slot ``slots[j]`` (positions before ``starts[j]``
        already hold that sequence's keys and values), all sequences in one packed forward. Logits
        ``[J, V]`` of each sequence's last token."""
        dev = self.cache.device
        lens = [len(t) for t in tokens]
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(dev)
        tok_slot = torch.tensor([s for s, n in zip(slots, lens) for _ in range(n)], dtype=torch.long, device=dev)
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        masks = [  # a continued sequence sees its prefix and its own earlier tokens
            None
            if start == 0
            else torch.arange(start + n, device=dev)[None, :] <= torch.arange(start, start + n, device=dev)[:, None]
            for start, n in zip(starts, lens)
        ]
        groups = [_PaddedGroup(g, slots, lens, offsets, dev) for g in _fresh_groups(starts, lens)]
        alone = [j for j in range(len(lens)) if not any(j in g.members for g in groups)]

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            keys, values = self.cache.layer(i)
            out = q.new_empty((q.shape[0], self.heads * self.head_dim))
            for g in groups:  # sequences of similar lengths without a cached prefix: one padded call
                out.index_copy_(0, g.dst, g.attend(q, keys, values, self.scaling))
            for j in alone:
                slot, start, n = slots[j], starts[j], lens[j]
                qj = q[offsets[j] : offsets[j + 1]].transpose(0, 1)[None]  # [1, H, n, D]
                kj = keys[slot : slot + 1, :, : start + n]
                vj = values[slot : slot + 1, :, : start + n]
                oj = F.scaled_dot_product_attention(
                    qj, kj, vj, attn_mask=masks[j], is_causal=masks[j] is None, scale=self.scaling, enable_gqa=True
                )
                out[offsets[j] : offsets[j + 1]] = oj[0].transpose(0, 1).reshape(n, self.heads * self.head_dim)
            return out

        h = self.embed(ids)
        cos, sin = self._rope(pos, h.dtype)
        hidden = self._layers(h, cos, sin, self._write_index(tok_slot, pos), attend)
        last = torch.tensor([o - 1 for o in offsets[1:]], dtype=torch.long, device=dev)
        return self.head(hidden.index_select(0, last))
