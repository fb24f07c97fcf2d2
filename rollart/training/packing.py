"""Padding-free training passes: the rows of a micro-batch packed into one sequence.

A padded micro-batch runs ``rows x longest`` positions; agentic batches mix short and long trajectories,
so most of them can be padding. Here the rows are laid end to end in one sequence of ``sum(lengths)``
positions: each row keeps its own position ids (``0 .. len - 1``, so the rotary embeddings are those of
the padded pass) and attends only to its own earlier tokens (a block-diagonal causal mask). The
log-probabilities and entropies are scattered back to the padded ``[rows, longest]`` layout, so the loss,
its masks and its token weighting are computed exactly as on the padded path.

The attention runs through :data:`PACKED_ATTENTION`, an implementation registered with transformers'
attention interface (the model is switched to it with :func:`use_packed_attention`): given the rows'
boundaries (``cu_seq_lens_q``, as flash-attention's variable-length kernels take them) it runs causal
attention per row: on a CUDA device in bf16/fp16 through ``torch.nn.attention.varlen`` (flash
attention; its first call in a process is checked against SDPA per row, and on a disagreement or an
error the process keeps SDPA per row, with a warning), elsewhere one SDPA call per row, so the cost is
``sum(len^2)``, never ``(sum len)^2``.
Without boundaries it is transformers' own SDPA attention, so the model's padded passes (and its KV-cache
passes, e.g. :mod:`rollart.training.shared_prefix`) are unchanged.

:func:`plan_packed_microbatches` forms micro-batches by a token budget (the sum of the rows' lengths);
a row longer than the budget gets a micro-batch of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

PACKED_ATTENTION = "rollart_packed"
"""The name of the packed attention implementation in transformers' ``AttentionInterface``."""

# the keys of a packed micro-batch's layout (tensors built on the CPU by :func:`packed_layout`)
PACKED_IDS, PACKED_POS, PACKED_CU, PACKED_AT = "packed_ids", "packed_pos", "packed_cu", "packed_at"
PACKED_KEYS = (PACKED_IDS, PACKED_POS, PACKED_CU, PACKED_AT)


def plan_packed_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Index lists, each a micro-batch (every index exactly once) whose rows' lengths sum to at most
    ``max_tokens``, unless one row alone is longer (it then has a micro-batch of its own). Rows are placed
    longest first, each in the first micro-batch with room (first-fit decreasing: few, full micro-batches)."""
    if max_tokens <= 0:
        raise ValueError("max_tokens_per_microbatch must be > 0")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                plans[b].append(i)
                room[b] -= n
                break
        else:
            plans.append([i])
            room.append(max_tokens - n)
    return [sorted(p) for p in plans]


def packed_layout(rows: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """The tensors of one packed pass over ``rows`` (token id lists): the ids ``[1, L]``, the per-row
    position ids ``[1, L]``, the rows' boundaries ``[rows + 1]`` (int32) and where each packed position
    lands in the padded ``[rows, longest]`` layout, flattened (``[L]``)."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("a packed micro-batch needs at least one row and no empty row")
    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)
    pos = torch.cat([torch.arange(n) for n in lengths])
    row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return {PACKED_IDS: ids[None], PACKED_POS: pos[None], PACKED_CU: cu, PACKED_AT: row_of * width + pos}


def packed_forward_kwargs(mb: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The keyword arguments of the model's packed forward over micro-batch ``mb``."""
    cu = mb[PACKED_CU]
    longest = int((cu[1:] - cu[:-1]).max())
    return {
        "input_ids": mb[PACKED_IDS],
        "position_ids": mb[PACKED_POS],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "use_cache": False,
    }


def packed_token_logprobs(
    model: torch.nn.Module, mb: dict[str, torch.Tensor], rows: int, width: int, with_entropy: bool = False
) -> Any:
    """What ``token_logprobs`` gives for the micro-batch's rows (layout ``[rows, width]``: position 0 of a
    row and the positions past its end are 0), from one packed pass of ``model`` (the packed attention must
    be on: :func:`use_packed_attention`)."""
    ids = mb[PACKED_IDS][0]
    logits = model(**packed_forward_kwargs(mb)).logits[0].float()  # [L, V]
    all_logp = torch.log_softmax(logits[:-1], dim=-1)  # position p predicts the token at p + 1
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[mb[PACKED_CU][:-1].long()] = True  # a row's first token has no prediction (0, as padded)
    logp = torch.nn.functional.pad(all_logp.gather(-1, ids[1:, None]).squeeze(-1), (1, 0))
    logp = torch.where(starts, torch.zeros_like(logp), logp)
    at = mb[PACKED_AT]

    def place(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(rows * width).scatter(0, at, values).view(rows, width)

    if not with_entropy:
        return place(logp)
    entropy = torch.nn.functional.pad(-(all_logp.exp() * all_logp).sum(-1), (1, 0))
    return place(logp), place(torch.where(starts, torch.zeros_like(entropy), entropy))


# ---------------------------------------------------------------------- the attention implementation
def _position_bounds(kwargs: dict[str, Any], attention_mask: Any, q_len: int) -> list[int] | None:
    """The packed rows' boundaries of an attention call without ``cu_seq_lens_q``, from its position ids
    (where they restart), or None for an ordinary (padded) call."""
    pos = kwargs.get("position_ids")
    if attention_mask is not None or pos is None or q_len < 2 or pos.shape[0] != 1:
        return None
    starts = torch.nonzero(torch.diff(pos[0]) != 1).flatten() + 1  # where the positions restart
    if not len(starts):
        return None
    return [0, *starts.tolist(), q_len]


_varlen_ok: bool | None = None  # whether torch's varlen flash attention agreed with SDPA per row (None: not tried)


def _varlen_call(
    varlen_attn: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    longest: int,
    scaling: Any,
) -> torch.Tensor | None:
    """``varlen_attn`` on ``[L, H, D]`` rows, causal, with its arguments spelt for this torch's version (its
    keywords changed between releases: ``is_causal`` or ``window_size``; ``enable_gqa`` or none, then the
    key/value heads are repeated here), or None where this version cannot take the call (no causal mode, or
    a scale it cannot be given)."""
    import inspect

    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    if "scale" in params:
        kwargs["scale"] = scaling
    elif scaling is not None and abs(float(scaling) - query.shape[-1] ** -0.5) > 1e-6:
        return None
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # grouped-query attention: each key/value head serves query.shape[1] / key.shape[1] query heads
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return varlen_attn(query, key, value, cu, cu, longest, longest, **kwargs)


def _varlen_cuda(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any], scaling: Any):
    """Flash attention over the packed rows (CUDA, bf16/fp16), or None where torch has no varlen kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    cu = kwargs["cu_seq_lens_q"].to(device=query.device, dtype=torch.int32)
    longest = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
    out = _varlen_call(
        varlen_attn, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, longest, scaling
    )
    return None if out is None else out[None]  # [1, L, H, D], the layout the attention module reshapes


def varlen_problem(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why packed passes on ``device`` would not get torch's varlen flash attention (None: they do). On a
    CUDA device the packed rows otherwise fall back to one SDPA call per row, slower than the padded pass's
    flash kernel (measured on an H200); off CUDA one SDPA call per row is the packed path anyway."""
    if device.type != "cuda":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 64, generator=g).to(device=device, dtype=dtype) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    try:
        out = _varlen_call(varlen_attn, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, 7, None)
    except (RuntimeError, TypeError, ValueError) as err:
        return f"torch's varlen attention failed: {err}"
    if out is None:
        return "this torch's varlen attention has no causal mode"
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    parts = [
        torch.nn.functional.scaled_dot_product_attention(q[..., s:e, :], k[..., s:e, :], v[..., s:e, :], is_causal=True)
        for s, e in ((0, 5), (5, 12))
    ]
    ref = torch.cat(parts, dim=2)[0].transpose(0, 1)
    if not torch.allclose(out.float(), ref.float(), atol=3e-2, rtol=3e-2):
        return "torch's varlen attention disagrees with SDPA"
    return None


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed row (``query`` ``[1, H, L, D]``); an ordinary call (no row
    boundaries) is transformers' SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len = query.shape[2]
    cu = kwargs.get("cu_seq_lens_q")
    bounds = _position_bounds(kwargs, attention_mask, q_len) if cu is None else None
    if cu is None and bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1 or key.shape[2] != q_len:
        raise ValueError("packed attention takes one packed sequence without a KV cache")

    def per_row() -> torch.Tensor:
        edges = bounds if bounds is not None else [int(b) for b in cu.tolist()]
        # one split per tensor (its backward is one concatenation; slicing per row would zero-fill a
        # full-size gradient per row and per tensor)
        sizes = [e - s for s, e in zip(edges[:-1], edges[1:])]
        parts = [
            sdpa_attention_forward(module, q, k, v, None, dropout, scaling, is_causal=True)[0]
            for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2))
        ]
        return torch.cat(parts, dim=1)

    global _varlen_ok
    varlen = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0
    if varlen and _varlen_ok is not False and cu is not None:
        try:
            out = _varlen_cuda(query, key, value, kwargs, scaling)
        except (RuntimeError, TypeError, ValueError) as err:  # no kernel for this GPU, head size or build
            log.warning("packed attention: torch's varlen flash attention failed (%s); SDPA per row instead", err)
            out = None
        if out is None:
            _varlen_ok = False
        if out is not None and _varlen_ok is None:  # checked once against SDPA per row on the first real call
            with torch.no_grad():
                ref = per_row()
            _varlen_ok = bool(torch.allclose(out.detach().float(), ref.float(), atol=3e-2, rtol=3e-2))
            if not _varlen_ok:
                log.warning(
                    "packed attention: torch's varlen flash attention disagrees with SDPA; SDPA per row instead"
                )
        if out is not None and _varlen_ok:
            return out, None
    return per_row(), None


def packed_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask :func:`packed_attention` gets: none for a pass without padding or cache (packed rows are
    separated by their boundaries, one row is causal), SDPA's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length and not q_offset and not kv_offset:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


_registered = False


def register_packed_attention() -> None:
    """Register :data:`PACKED_ATTENTION` with transformers' attention and mask interfaces (once)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_attention_mask)
    _registered = True


def packing_unsupported(config: Any) -> str | None:
    """Why a model of this (Hugging Face) config cannot train packed, or None when it can: the packed
    attention replaces the attention of Llama-family models of full, rotary attention."""
    from rollart.models.decoder import static_config_unsupported

    reason = static_config_unsupported(config)
    if reason is None and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        reason = "attention dropout"
    return reason


def packing_on(wanted: bool | None, path: str, device: torch.device | None = None, compute_bf16: bool = False) -> bool:
    """Whether a model folder's passes run packed: ``wanted`` (``train.packing``; null: where the model
    supports it and, on a CUDA ``device``, where the passes get torch's varlen flash attention: bf16
    compute, :func:`varlen_problem`). An explicit ``True`` on a model that cannot is refused, naming the
    field and the fix."""
    if wanted is False:
        return False
    from transformers import AutoConfig

    reason = packing_unsupported(AutoConfig.from_pretrained(path))
    if reason is not None and wanted:
        raise ValueError(
            f"train.packing: true: the model at {path} cannot train packed ({reason}); set train.packing: false"
        )
    if reason is None and device is not None and device.type == "cuda":
        reason = varlen_problem(device) if compute_bf16 else "fp32 passes on a GPU (train.dtype: fp32)"
        if reason is not None and wanted:
            log.warning(
                "train.packing: true on %s: %s; the packed rows run one SDPA call each, which can be slower than "
                "the padded pass (train.packing: null chooses)",
                device,
                reason,
            )
            return True
    if reason is None:
        return True
    log.info("training padded: the model at %s does not train packed here (%s)", path, reason)
    return False


def use_packed_attention(model: Any) -> None:
    """Switch ``model`` (a Hugging Face causal LM) to :data:`PACKED_ATTENTION`: its ordinary passes stay
    SDPA's, its packed passes (:func:`packed_token_logprobs`) attend within each row."""
    register_packed_attention()
    model.set_attn_implementation(PACKED_ATTENTION)


__all__ = [
    "PACKED_ATTENTION",
    "PACKED_KEYS",
    "packed_layout",
    "packed_token_logprobs",
    "packing_on",
    "varlen_problem",
    "packing_unsupported",
    "plan_packed_microbatches",
    "use_packed_attention",
]
