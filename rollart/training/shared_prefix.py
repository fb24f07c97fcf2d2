"""Shared-prefix training passes: the samples of one prompt are trained on its tokens once.

GRPO-style batches hold ``n`` samples of every prompt, so most of a batch's positions are the same
prompt repeated ``n`` times (reverse-3 in chat form: 31 prompt tokens, 4 answer tokens). A plain pass
runs every row whole. Here a micro-batch is cut at each row's first action token (its first position
with loss mask 1): every distinct prefix runs once (left-padded, with the KV cache kept), its cache is
copied to the rows that share it, and the rows' suffixes run on top of it. The log-probabilities and
entropies are the same as a whole-row pass (up to float rounding), and so are the gradients: the copied
cache is part of the graph, so each prefix's gradient is the sum over the rows that read it.

:func:`plan_shared_microbatches` packs rows under the token budget counting each prefix once (rows of
one prefix stay together where the budget allows). :class:`SharedPrefixForward` holds the model and
runs both passes inside one ``forward``, so DDP sees one forward per backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rollart.models.kv_cache import cache_kwargs, output_cache

# the keys of a micro-batch's shared layout (tensors, built on the CPU by :func:`shared_layout`)
PREFIX_IDS, PREFIX_MASK, PREFIX_POS = "prefix_ids", "prefix_mask", "prefix_pos"
GROUP_INDEX = "group_index"
SUFFIX_IDS, SUFFIX_MASK, SUFFIX_POS, SUFFIX_AT = "suffix_ids", "suffix_mask", "suffix_pos", "suffix_at"
LAYOUT_KEYS = (PREFIX_IDS, PREFIX_MASK, PREFIX_POS, GROUP_INDEX, SUFFIX_IDS, SUFFIX_MASK, SUFFIX_POS, SUFFIX_AT)


def prefix_length(loss_mask: Sequence[float], length: int) -> int:
    """Where a row is cut: its first action token (loss mask 1), at least 1 and at most ``length``."""
    first = next((i for i, m in enumerate(loss_mask[:length]) if m > 0), length)
    return min(max(first, 1), length)


def plan_shared_microbatches(
    input_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """Index lists, each a micro-batch (every index exactly once). A micro-batch costs its padded
    prefixes (distinct prefixes × the longest) plus its padded suffixes (rows × the longest), and
    stays within ``max_tokens`` unless one row alone is larger."""
    if max_tokens <= 0:
        raise ValueError("max_tokens_per_microbatch must be > 0")
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ids, p) in enumerate(zip(input_ids, prefix_lens)):
        groups.setdefault(tuple(ids[:p]), []).append(i)
    order = sorted(groups.values(), key=lambda rows: (prefix_lens[rows[0]], max(len(input_ids[r]) for r in rows)))
    batches: list[list[int]] = []
    current: list[int] = []
    n_prefix, widest_prefix, widest_suffix = 0, 0, 0
    for rows in order:
        p = prefix_lens[rows[0]]
        opened = False  # this group's prefix is counted in ``current`` already
        for r in rows:
            s = len(input_ids[r]) - p
            prefixes = n_prefix + (0 if opened else 1)
            cost = prefixes * max(widest_prefix, p) + (len(current) + 1) * max(widest_suffix, s)
            if current and cost > max_tokens:
                batches.append(current)
                current, n_prefix, widest_prefix, widest_suffix, opened = [], 0, 0, 0, False
            if not opened:
                n_prefix, opened = n_prefix + 1, True
            current.append(r)
            widest_prefix, widest_suffix = max(widest_prefix, p), max(widest_suffix, s)
    if current:
        batches.append(current)
    return batches


def shared_positions(
    input_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int], plans: Sequence[Sequence[int]]
) -> int:
    """The positions the shared passes of ``plans`` run: per micro-batch, its distinct prefixes x the longest
    plus its rows x the longest suffix (what :func:`plan_shared_microbatches` budgets)."""
    total = 0
    for idx in plans:
        prefixes = {tuple(input_ids[i][: prefix_lens[i]]) for i in idx}
        total += len(prefixes) * max(prefix_lens[i] for i in idx)
        total += len(idx) * max(len(input_ids[i]) - prefix_lens[i] for i in idx)
    return total


def shared_layout(rows: Sequence[Sequence[int]], prefix_lens: Sequence[int]) -> dict[str, torch.Tensor]:
    """The tensors of the shared passes of one micro-batch (``rows`` are its token id lists)."""
    index: dict[tuple[int, ...], int] = {}
    prefixes: list[Sequence[int]] = []
    group = []
    for ids, p in zip(rows, prefix_lens):
        key = tuple(ids[:p])
        if key not in index:
            index[key] = len(prefixes)
            prefixes.append(ids[:p])
        group.append(index[key])
    width = max(len(p) for p in prefixes)
    prefix_ids = torch.zeros((len(prefixes), width), dtype=torch.long)
    prefix_mask = torch.zeros((len(prefixes), width), dtype=torch.long)
    for g, ids in enumerate(prefixes):  # left-padded: every prefix ends at the last column
        prefix_ids[g, width - len(ids) :] = torch.as_tensor(list(ids), dtype=torch.long)
        prefix_mask[g, width - len(ids) :] = 1
    suffix_width = max(1, max(len(ids) - p for ids, p in zip(rows, prefix_lens)))
    total = max(len(ids) for ids in rows)
    suffix_ids = torch.zeros((len(rows), suffix_width), dtype=torch.long)
    suffix_mask = torch.zeros((len(rows), suffix_width), dtype=torch.long)
    steps = torch.arange(suffix_width)
    plen = torch.as_tensor(list(prefix_lens), dtype=torch.long)
    for r, (ids, p) in enumerate(zip(rows, prefix_lens)):
        tail = list(ids[p:])
        if tail:
            suffix_ids[r, : len(tail)] = torch.as_tensor(tail, dtype=torch.long)
            suffix_mask[r, : len(tail)] = 1
    # where each suffix position lands in the whole-row layout [B, total]; padding lands past ``total``
    at = torch.where(suffix_mask.bool(), plen[:, None] + steps, total + steps)
    return {
        PREFIX_IDS: prefix_ids,
        PREFIX_MASK: prefix_mask,
        PREFIX_POS: (prefix_mask.cumsum(-1) - 1).clamp(min=0),
        GROUP_INDEX: torch.as_tensor(group, dtype=torch.long),
        SUFFIX_IDS: suffix_ids,
        SUFFIX_MASK: suffix_mask,
        SUFFIX_POS: plen[:, None] + steps,
        SUFFIX_AT: at,
    }


class SharedPrefixForward(torch.nn.Module):
    """The causal LM, with a second way in: ``forward(**layout)`` runs the prefixes once and the
    suffixes on their copied cache, returning (each prefix's last logits ``[G, V]``, the suffixes'
    logits ``[B, S, V]``). ``forward(input_ids=..., attention_mask=...)`` (with any other keyword arguments
    of the model, e.g. a packed pass's) is the plain model's."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **layout: Any):
        if PREFIX_IDS not in layout:
            return self.lm(input_ids=input_ids, attention_mask=attention_mask, **layout)
        pre = self.lm(
            input_ids=layout[PREFIX_IDS],
            attention_mask=layout[PREFIX_MASK],
            position_ids=layout[PREFIX_POS],
            use_cache=True,
        )
        group = layout[GROUP_INDEX]
        cache = output_cache(pre)
        for layer in cache.layers:  # every row reads its prefix's keys and values (a graph edge, not a copy)
            layer.keys, layer.values = layer.keys.index_select(0, group), layer.values.index_select(0, group)
        mask = torch.cat([layout[PREFIX_MASK].index_select(0, group), layout[SUFFIX_MASK]], dim=1)
        suf = self.lm(
            input_ids=layout[SUFFIX_IDS],
            attention_mask=mask,
            position_ids=layout[SUFFIX_POS],
            use_cache=True,
            **cache_kwargs(self.lm, cache),
        )
        return pre.logits[:, -1, :], suf.logits


def shared_token_logprobs(
    model: torch.nn.Module, mb: dict[str, torch.Tensor], width: int, with_entropy: bool = False
) -> Any:
    """What ``token_logprobs`` gives for the micro-batch's rows (layout ``[B, width]``; positions
    before a row's cut are 0, they are never actions), from the shared passes of ``model`` (a
    :class:`SharedPrefixForward`, or DDP around one)."""
    last, suffix_logits = model(**{k: mb[k] for k in LAYOUT_KEYS if k != SUFFIX_AT})
    group = mb[GROUP_INDEX]
    # suffix token j is predicted by the position before it: the prefix's last for j = 0
    pred = torch.cat([last.index_select(0, group)[:, None], suffix_logits[:, :-1]], dim=1).float()
    all_logp = torch.log_softmax(pred, dim=-1)
    logp = all_logp.gather(-1, mb[SUFFIX_IDS][..., None]).squeeze(-1)
    at, rows, s = mb[SUFFIX_AT], logp.shape[0], logp.shape[1]

    def place(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros((rows, width + s)).scatter(1, at, values)[:, :width]

    if not with_entropy:
        return place(logp)
    entropy = -(all_logp.exp() * all_logp).sum(-1)
    return place(logp), place(entropy)
