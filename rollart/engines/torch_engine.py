"""The built-in PyTorch engine (default; CPU or GPU): continuous batching over a Hugging Face causal LM.

Requests join and leave between steps. While the running set stays the same, a step decodes one
token per row from a batched KV cache (left-padded rows, an attention mask and per-row position ids,
so rows of different lengths decode together). When the set changes (a request joined, finished or
was aborted) the next step prefills the whole running batch again, rebuilding the cache — exact, and
cheap for the short contexts of RL tasks; long-context serving belongs to the vLLM/SGLang adapters.
Rows that share sampling settings are sampled in one vectorised call (a seeded row with its own uniform draw).

Sampling follows ``rollart.engines.base``: greedy at ``temperature == 0``; otherwise logits /
temperature, top-k, then top-p (nucleus), renormalised; the behaviour logprob is that of the sampled
token under this processed distribution. A request with ``seed`` samples from its own generator.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rollart.engines.base import EngineRequest, InferenceEngine, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Running:
    request: EngineRequest
    output: RequestOutput
    generator: torch.Generator | None


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution a token is sampled from (one row of logits)."""
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


class TorchEngine(InferenceEngine):
    def __init__(
        self, model_path: str, device: str = "cpu", dtype: torch.dtype | str = torch.float32, max_batch_size: int = 256
    ):
        from transformers import AutoModelForCausalLM

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self._waiting: deque[str] = deque()
        self._requests: OrderedDict[str, _Running] = OrderedDict()
        self._cache: object | None = None  # KV cache of the batch in ``_cache_rids`` order
        self._cache_rids: list[str] = []
        self._mask: torch.Tensor | None = None
        self._last_pos: torch.Tensor | None = None
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r}: prompt_token_ids is empty")
        gen = None
        if request.params.seed is not None and request.params.temperature > 0:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(int(request.params.seed))
        out = RequestOutput(request.request_id, list(request.prompt_token_ids), weight_version=self.weight_version)
        self._requests[request.request_id] = _Running(request, out, gen)
        self._waiting.append(request.request_id)
        self._cache = None  # the running set changes: the next step prefills

    def abort(self, request_id: str) -> RequestOutput | None:
        run = self._requests.pop(request_id, None)
        if run is None:
            return None
        try:
            self._waiting.remove(request_id)
        except ValueError:
            pass
        run.output.finished, run.output.finish_reason = True, "abort"
        self._cache = None
        return run.output

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ stepping
    def _batch(self) -> list[_Running]:
        running = [r for rid, r in self._requests.items() if rid not in self._waiting]
        while self._waiting and len(running) < self.max_batch_size:
            running.append(self._requests[self._waiting.popleft()])
        return running

    def _forward(self, batch: list[_Running]) -> torch.Tensor:
        """Next-token logits ``[B, V]``: one cached decode step if the batch is unchanged, else a prefill."""
        rids = [r.request.request_id for r in batch]
        dev = self.device
        if self._cache is not None and rids == self._cache_rids:
            last = torch.tensor([[r.output.output_token_ids[-1]] for r in batch], dtype=torch.long)
            assert self._mask is not None and self._last_pos is not None
            self._mask = torch.cat([self._mask, torch.ones((len(batch), 1), dtype=torch.long)], dim=1)
            self._last_pos = self._last_pos + 1
            out = self.model(
                input_ids=last.to(dev),
                attention_mask=self._mask.to(dev),
                position_ids=self._last_pos[:, None].to(dev),
                past_key_values=self._cache,
                use_cache=True,
            )
        else:
            seqs = [r.request.prompt_token_ids + r.output.output_token_ids for r in batch]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, seq in enumerate(seqs):
                ids[i, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
                mask[i, width - len(seq) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = self.model(
                input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev), use_cache=True
            )
            self._mask, self._last_pos = mask, pos[:, -1]
        self._cache, self._cache_rids = out.past_key_values, rids
        return out.logits[:, -1, :].float().cpu()

    def _sample(self, batch: list[_Running], logits: torch.Tensor) -> list[tuple[int, float]]:
        """(token, behaviour logprob) per row. Rows sharing settings are processed together; a seeded row
        draws its one uniform number from its own generator (inverse-CDF sampling), so what it samples
        does not depend on the other rows of the batch."""
        picks: list[tuple[int, float]] = [(0, 0.0)] * len(batch)
        shared: dict[tuple, list[int]] = {}
        for row, run in enumerate(batch):
            p = run.request.params
            shared.setdefault((p.temperature, p.top_k, p.top_p), []).append(row)
        for rows in shared.values():
            params = batch[rows[0]].request.params
            logp = process_logits(logits[rows], params)
            if params.temperature == 0:
                toks = torch.argmax(logp, dim=-1)
            else:
                probs = logp.exp()
                toks = torch.empty(len(rows), dtype=torch.long)
                seeded = [i for i, row in enumerate(rows) if batch[row].generator is not None]
                free = [i for i, row in enumerate(rows) if batch[row].generator is None]
                if free:
                    toks[free] = torch.multinomial(probs[free], 1).squeeze(-1)
                if seeded:
                    u = torch.cat([torch.rand(1, generator=batch[rows[i]].generator) for i in seeded])
                    cdf = probs[seeded].double().cumsum(-1)
                    # first token whose cumulative mass exceeds u (never a zero-probability token)
                    idx = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True).squeeze(-1)
                    toks[seeded] = idx.clamp(max=probs.shape[-1] - 1)
            chosen = logp.gather(-1, toks[:, None]).squeeze(-1)
            for row, tok, lp in zip(rows, toks.tolist(), chosen.tolist()):
                picks[row] = (int(tok), float(lp))
        return picks

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        batch = self._batch()
        if not batch:
            self._cache, self._cache_rids = None, []
            return []
        logits = self._forward(batch)
        finished = []
        for run, (tok, lp) in zip(batch, self._sample(batch, logits)):
            params = run.request.params
            out = run.output
            out.output_token_ids.append(tok)
            out.output_logprobs.append(lp)
            if tok in params.stop_token_ids:
                out.finished, out.finish_reason = True, "stop"
            elif len(out.output_token_ids) >= params.max_new_tokens:
                out.finished, out.finish_reason = True, "length"
            if out.finished:
                del self._requests[run.request.request_id]
                finished.append(out)
                self._cache = None
        return finished

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        current = self.model.state_dict()
        missing = [k for k in current if k not in weights and not k.endswith("lm_head.weight")]
        unexpected = [k for k in weights if k not in current]
        bad_shape = [k for k, v in weights.items() if k in current and tuple(v.shape) != tuple(current[k].shape)]
        if missing or unexpected or bad_shape:
            raise ValueError(
                f"update_weights(version={version}) refused: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                f"wrong shape {bad_shape[:3]}; the engine keeps serving version {self.weight_version}"
            )
        with torch.no_grad():
            for k, v in weights.items():
                current[k].copy_(v.to(current[k].device, current[k].dtype))
        self._cache, self._cache_rids = None, []  # cached keys/values came from the old weights
        self.weight_version = int(version)
