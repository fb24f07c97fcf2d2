"""Sampling for the torch engines, on the device the logits are on.

:func:`process_logits` is the distribution a token is sampled from (``rollart.engines.base``: greedy
reports the log-softmax of the raw logits; otherwise logits / temperature, top-k, then top-p,
renormalised). :func:`sample_rows` samples a batch of rows with per-row settings in a few vectorised
calls and returns only the sampled tokens and their log-probs, so nothing of size ``[B, vocab]`` leaves
the device.

Every sampled (non-greedy) row draws by inverse CDF with one uniform number ``u`` per token, drawn on
the host: a request with a seed from its own ``torch.Generator`` (so what it samples does not depend
on the other rows of the batch, nor on the device), an unseeded one from torch's global generator.
The token is the first whose cumulative probability (in vocabulary order, float64) exceeds
``u · total``, never a token of probability zero.

Top log-probs (:func:`sample_rows_top`, for requests with ``top_logprobs > 0``): the ``k`` largest
log-probs of the same distribution the sampled token's log-prob is taken from, so under greedy
decoding the first of them is the sampled token's. Tokens the distribution gives probability zero
(cut by top-k or top-p) are never listed, so a row may list fewer than ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollart.engines.base import SamplingParams

__all__ = ["RowSampling", "process_logits", "sample_rows", "sample_rows_top", "top_logprobs", "uniform_draws"]


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution a token is sampled from (rows of logits, one setting)."""
    if params.temperature == 0:
        return torch.log_softmax(logits.float(), dim=-1)
    x = logits.float() / params.temperature
    if params.top_k and params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[..., -1, None]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix with mass >= top_p
        x = x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
    return torch.log_softmax(x, dim=-1)


@dataclass(frozen=True)
class RowSampling:
    """One row's settings, as :func:`sample_rows` takes them."""

    temperature: float
    top_k: int
    top_p: float

    @classmethod
    def of(cls, params: SamplingParams) -> RowSampling:
        return cls(float(params.temperature), int(params.top_k), float(params.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def uniform_draws(generators: Sequence[torch.Generator | None], greedy: Sequence[bool]) -> list[float]:
    """One uniform number per row for inverse-CDF sampling (0 for a greedy row, which draws nothing): a
    row with a generator draws from it, the others from torch's global generator."""
    free = [i for i, (g, gr) in enumerate(zip(generators, greedy)) if g is None and not gr]
    shared = torch.rand(len(free)).tolist() if free else []
    u = [0.0] * len(generators)
    for i, value in zip(free, shared):
        u[i] = value
    for i, (g, gr) in enumerate(zip(generators, greedy)):
        if g is not None and not gr:
            u[i] = float(torch.rand(1, generator=g))
    return u


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling], u: Sequence[float]) -> torch.Tensor:
    """Sample one token per row of ``logits [R, V]`` (any device): ``[2, R]`` float64 on the host,
    the tokens and their behaviour log-probs (one device-to-host copy of ``2 · R`` numbers)."""
    return _sample(logits, rows, u, 0)[0]


def sample_rows_top(
    logits: torch.Tensor, rows: Sequence[RowSampling], u: Sequence[float], top: int
) -> tuple[torch.Tensor, list[list[tuple[int, float]]]]:
    """:func:`sample_rows` and, per row, the ``top`` most likely tokens of the distribution it sampled
    from: ``[(token, log-prob), ...]`` most likely first (only tokens of nonzero probability)."""
    picks, top_lp = _sample(logits, rows, u, top)
    assert top_lp is not None
    return picks, top_lp


def top_logprobs(logp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The ``k`` largest entries of each row of log-probs ``[R, V]`` as ``(token, log-prob)`` lists,
    most likely first; entries of probability zero (``-inf``) left out. One copy to the host."""
    k = min(k, logp.shape[-1])
    values, ids = torch.topk(logp.float(), k, dim=-1)
    both = torch.stack([ids.double(), values.double()]).cpu()
    out = []
    for r in range(both.shape[1]):
        out.append([(int(t), float(v)) for t, v in zip(both[0, r].tolist(), both[1, r].tolist()) if v != float("-inf")])
    return out


def _sample(
    logits: torch.Tensor, rows: Sequence[RowSampling], u: Sequence[float], top: int
) -> tuple[torch.Tensor, list[list[tuple[int, float]]] | None]:
    vocab = logits.shape[-1]
    dev = logits.device
    x = logits.float()
    if all(r.greedy for r in rows):  # the common case of rollouts that decode greedily: two reductions
        tok = torch.argmax(x, dim=-1)
        norm = torch.logsumexp(x, dim=-1)
        lp = x.gather(-1, tok[:, None]).squeeze(-1) - norm
        listed = top_logprobs(x - norm[:, None], top) if top > 0 else None
        return torch.stack([tok.double(), lp.double()]).cpu(), listed
    host = torch.tensor(
        [
            [r.temperature if not r.greedy else 1.0 for r in rows],
            [r.top_k if not r.greedy and 0 < r.top_k < vocab else vocab for r in rows],
            [r.top_p if not r.greedy else 1.0 for r in rows],
            [1.0 if r.greedy else 0.0 for r in rows],
            list(u),
        ],
        dtype=torch.float64,
    )
    p = host.to(dev, non_blocking=True)
    temp, top_k, top_p, greedy, draws = p[0].float(), p[1].long(), p[2].float(), p[3].bool(), p[4]
    x = x / temp[:, None]
    if any(not r.greedy and (0 < r.top_k < vocab or r.top_p < 1.0) for r in rows):
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        kth = sorted_x.gather(-1, (top_k - 1)[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))  # top-k: ties with the k-th stay
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (probs.cumsum(-1) - probs > top_p[:, None]) & (top_p < 1.0)[:, None]
        x = torch.empty_like(x).scatter_(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
    logp = torch.log_softmax(x, dim=-1)  # a greedy row has temperature 1 here: the raw log-softmax
    cdf = logp.exp().double().cumsum(-1)
    drawn = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=vocab - 1)
    tok = torch.where(greedy, torch.argmax(logp, dim=-1), drawn)
    lp = logp.gather(-1, tok[:, None]).squeeze(-1)
    listed = top_logprobs(logp, top) if top > 0 else None
    return torch.stack([tok.double(), lp.double()]).cpu(), listed
