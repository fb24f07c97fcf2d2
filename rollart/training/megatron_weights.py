"""Weight naming between a Hugging Face causal LM and megatron-core's ``GPTModel`` (local or
Transformer-Engine layer spec): :func:`hf_to_megatron`, :func:`megatron_to_hf` (exact in both
directions: they only move, split and concatenate tensors; see :mod:`rollart.training.megatron_strategy`
for the layouts) and :func:`load_hf_state_dict`. Only torch is imported here, so exporting a megatron
checkpoint (:mod:`rollart.training.export`) needs no megatron-core and no training strategy."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


# ---------------------------------------------------------------------------------------------------- shapes
def _cfg(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _shape(config: Any) -> tuple[int, int, int, int, bool]:
    """``(num_layers, heads, query_groups, head_dim, tied)`` of an HF config (object or dict)."""
    heads = int(_cfg(config, "num_attention_heads"))
    groups = int(_cfg(config, "num_key_value_heads") or heads)
    head_dim = _cfg(config, "head_dim") or int(_cfg(config, "hidden_size")) // heads
    if heads % groups:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    tied = bool(_cfg(config, "tie_word_embeddings", True))
    return int(_cfg(config, "num_hidden_layers")), heads, groups, int(head_dim), tied


def _ignored(name: str) -> bool:
    """Entries that carry no weights: rotary caches and Transformer-Engine/megatron ``_extra_state``."""
    return (
        name.endswith("rotary_emb.inv_freq")
        or name.endswith("._extra_state")
        or name.endswith("rotary_pos_emb.inv_freq")
    )


# ---------------------------------------------------------------------------------------------------- conversion
def hf_to_megatron(
    state: Mapping[str, torch.Tensor], config: Any, *, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """A Hugging Face Qwen2/Llama-style state dict in megatron ``GPTModel`` names.

    ``config`` is the HF config (object or dict). ``fused_norms`` names the RMSNorm weights as the
    Transformer-Engine spec does (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``)
    instead of the local spec's ``input_layernorm`` / ``pre_mlp_layernorm``. With tied embeddings
    ``lm_head.weight`` (if present) must equal the embedding and is dropped; an unknown name raises.
    """
    layers, heads, groups, head_dim, tied = _shape(config)
    src = {k: v for k, v in state.items() if not _ignored(k)}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return src[name]

    def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rest = q.shape[1:]
        q = q.reshape(groups, heads // groups * head_dim, *rest)
        k = k.reshape(groups, head_dim, *rest)
        v = v.reshape(groups, head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
    for i in range(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        norm_in = m + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight")
        out[norm_in] = take(h + "input_layernorm.weight")
        out[m + "self_attention.linear_proj.weight"] = take(attn + "o_proj.weight")
        if attn + "o_proj.bias" in src:
            out[m + "self_attention.linear_proj.bias"] = take(attn + "o_proj.bias")
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight")
        )
        if attn + "q_proj.bias" in src:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias")
            )
        norm_mlp = m + ("mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight")
        out[norm_mlp] = take(h + "post_attention_layernorm.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat([take(h + "mlp.gate_proj.weight"), take(h + "mlp.up_proj.weight")])
        out[m + "mlp.linear_fc2.weight"] = take(h + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if "lm_head.weight" in src:
        head = take("lm_head.weight")
        if not tied:
            out["output_layer.weight"] = head
        elif head is not src["model.embed_tokens.weight"] and not torch.equal(head, src["model.embed_tokens.weight"]):
            raise ValueError("tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight")
    elif not tied:
        raise KeyError("untied embeddings need lm_head.weight")
    unknown = sorted(set(src) - used)
    if unknown:
        raise KeyError(f"hf_to_megatron: no megatron name for {unknown[:5]} ({len(unknown)} in all)")
    return out


def megatron_to_hf(state: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_megatron` (either norm naming), in the order and with the keys of a
    Hugging Face ``state_dict()``: with tied embeddings ``lm_head.weight`` is the embedding tensor itself."""
    layers, heads, groups, head_dim, tied = _shape(config)
    src = {k: v for k, v in state.items() if not _ignored(k) and v is not None}
    used: set[str] = set()

    def take(*names: str) -> torch.Tensor:
        for name in names:
            if name in src:
                used.add(name)
                return src[name]
        raise KeyError(f"megatron_to_hf: none of {names} in the state dict")

    def split_qkv(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rest = fused.shape[1:]
        per_group = heads // groups * head_dim
        g = fused.reshape(groups, per_group + 2 * head_dim, *rest)
        q, k, v = torch.split(g, [per_group, head_dim, head_dim], dim=1)
        return (
            q.reshape(heads * head_dim, *rest).contiguous(),
            k.reshape(groups * head_dim, *rest).contiguous(),
            v.reshape(groups * head_dim, *rest).contiguous(),
        )

    embed = take("embedding.word_embeddings.weight")
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        weights = split_qkv(take(m + "self_attention.linear_qkv.weight"))
        bias_name = m + "self_attention.linear_qkv.bias"
        biases = split_qkv(take(bias_name)) if bias_name in src else None
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[attn + proj + ".weight"] = weights[j]
            if biases is not None:
                out[attn + proj + ".bias"] = biases[j]
        out[attn + "o_proj.weight"] = take(m + "self_attention.linear_proj.weight")
        if m + "self_attention.linear_proj.bias" in src:
            out[attn + "o_proj.bias"] = take(m + "self_attention.linear_proj.bias")
        gate, up = torch.chunk(take(m + "mlp.linear_fc1.weight"), 2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate.contiguous()
        out[h + "mlp.up_proj.weight"] = up.contiguous()
        out[h + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
        out[h + "input_layernorm.weight"] = take(
            m + "input_layernorm.weight", m + "self_attention.linear_qkv.layer_norm_weight"
        )
        out[h + "post_attention_layernorm.weight"] = take(
            m + "pre_mlp_layernorm.weight", m + "mlp.linear_fc1.layer_norm_weight"
        )
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    out["lm_head.weight"] = embed if tied else take("output_layer.weight")
    unknown = sorted(set(src) - used)
    if unknown:
        raise KeyError(f"megatron_to_hf: no Hugging Face name for {unknown[:5]} ({len(unknown)} in all)")
    return out


def load_hf_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder (``*.safetensors`` shards, else ``pytorch_model*.bin``), on CPU,
    without instantiating the HF model; a shape folder's seeded random weights (``rollart.models.shapes``)."""
    from rollart.models.shapes import hf_state_dict, is_shape_folder

    if is_shape_folder(path):
        return hf_state_dict(path)
    folder = Path(path)
    shards = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if shards:
        from safetensors.torch import load_file

        for shard in shards:
            state.update(load_file(str(shard), device="cpu"))
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {folder}")
    for shard in bins:
        state.update(torch.load(shard, map_location="cpu", weights_only=True))
    return state
