"""The torch engine over a Hugging Face ``DynamicCache`` (``engine.options.kv_cache: dynamic``): continuous
batching through the model's own forward, for any Hugging Face causal LM. The default torch engine
(:class:`rollart.engines.torch_engine.TorchEngine`) runs this one for architectures its static-cache
decoder does not cover, and the tests compare the two.

Requests join and leave between steps without recomputing the others. The running requests are the
rows of one batched KV cache (left-padded rows, an attention mask and per-row position ids, so rows of
different lengths decode together); a step decodes one token per running row from it, and prefills the
requests that join in a forward of their own whose cache rows are then appended (both sides
left-padded to a common width). Requests whose sequences are identical (the n samples of one prompt)
are prefilled once and their cache row copied. A row that finishes or is aborted is dropped by index,
and leading columns no row uses any more are cut.
Rows that share sampling settings are sampled in one vectorised call (a seeded row with its own uniform draw).

Colocated mode: ``sleep(1)`` drops the KV cache, ``sleep(2)`` also the weights' storage (each parameter
keeps its shape to be allocated again); ``wake_up(weights, version)`` allocates them and loads the
trainer's weights. On a GPU the freed blocks go back to the device (``torch.cuda.empty_cache``).

Sampling follows ``rollart.engines.base``: greedy at ``temperature == 0``; otherwise logits /
temperature, top-k, then top-p (nucleus), renormalised; the behaviour logprob is that of the sampled
token under this processed distribution. A request with ``seed`` samples from its own generator.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollart.engines.base import (
    SLEEP_LEVELS,
    DeltaTracker,
    EngineMemory,
    EngineRequest,
    InferenceEngine,
    RequestOutput,
    TokenDelta,
)
from rollart.engines.sampling import process_logits, top_logprobs
from rollart.models.kv_cache import cache_kwargs, output_cache

log = logging.getLogger(__name__)


@dataclass
class _Running:
    request: EngineRequest
    output: RequestOutput
    generator: torch.Generator | None


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``x`` with zeros prepended along ``dim`` up to ``width`` (masked-out cache columns)."""
    extra = width - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class DynamicCacheTorchEngine(InferenceEngine):
    """Continuous batching over one batched KV cache whose rows are the running requests.

    ``stats`` counts the work done: ``prefill_forwards`` / ``prefill_tokens`` (positions run through
    the model to build cache rows), ``decode_forwards`` / ``decode_tokens`` and ``shared_prefill_rows``
    (rows whose cache was copied from an identical sequence prefilled in the same forward).
    """

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_batch_size: int = 256,
        prefix_sharing: bool = True,
        model: Any = None,
    ):
        from rollart.models.shapes import load_causal_lm

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        if model is None:  # ``model``: one loaded already (the torch engine's fallback)
            model = load_causal_lm(model_path, dtype=dtype)
        self.model = model.to(self.device).eval()
        self.max_batch_size = max_batch_size
        self.prefix_sharing = prefix_sharing
        self.weight_version = 0
        self._waiting: deque[str] = deque()
        self._requests: OrderedDict[str, _Running] = OrderedDict()
        self._running: list[_Running] = []  # the rows of the KV cache, in order
        self._cache: Any = None  # a DynamicCache over ``_running``: left-padded rows
        self._mask: torch.Tensor | None = None  # [B, T] 1 where the cache holds a real token
        self._next_pos: torch.Tensor | None = None  # [B] position id of each row's next input token
        self._row_dropped = False  # a running request was aborted: its row goes at the next step
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        # names and shapes of the weights a state dict must match (the module's own are emptied by sleep(2))
        self._state_shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        self._dropped: list[tuple[torch.nn.Parameter, torch.Size]] = []  # parameters emptied by sleep(2)
        self._kv_peak = 0
        self._freed: int | None = None  # device memory the last sleep gave back (CUDA only)
        self._streams = DeltaTracker()
        self.stats: dict[str, int] = {
            "prefill_forwards": 0,
            "prefill_tokens": 0,
            "decode_forwards": 0,
            "decode_tokens": 0,
            "shared_prefill_rows": 0,
        }

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> None:
        if self.sleep_level:
            raise RuntimeError(
                f"request {request.request_id!r}: the engine is asleep (level {self.sleep_level}: the trainer holds "
                "the device); wake_up first"
            )
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
        self._streams.watch(request)
        self._waiting.append(request.request_id)  # joins the batch at the next step; the others keep their rows

    def abort(self, request_id: str) -> RequestOutput | None:
        run = self._requests.pop(request_id, None)
        if run is None:
            return None
        try:
            self._waiting.remove(request_id)
        except ValueError:
            self._row_dropped = True  # it has a cache row: dropped at the next step
        run.output.finished, run.output.finish_reason = True, "abort"
        return run.output

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def take_deltas(self) -> list[TokenDelta]:
        return self._streams.deltas(lambda rid: run.output if (run := self._requests.get(rid)) else None)

    # ------------------------------------------------------------------ the batched cache
    def _reset_cache(self) -> None:
        self._running, self._cache, self._mask, self._next_pos = [], None, None, None

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep only these cache rows (in order), and cut the leading columns no row uses any more."""
        if not keep:
            self._reset_cache()
            return
        assert self._mask is not None and self._next_pos is not None
        self._running = [self._running[i] for i in keep]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, idx)
        used = mask.any(0)
        first = int(used.to(torch.int8).argmax()) if bool(used.any()) else 0
        self._mask, self._next_pos = mask[:, first:], self._next_pos.index_select(0, idx)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, first:]
            layer.values = layer.values.index_select(0, idx)[:, :, first:]

    def _decode(self) -> torch.Tensor:
        """One token for every running row from the cache: next-token logits ``[B, V]``."""
        assert self._mask is not None and self._next_pos is not None
        dev = self.device
        batch = self._running
        last = torch.tensor([r.output.output_token_ids[-1] for r in batch], dtype=torch.long, device=dev)
        self._mask = torch.cat([self._mask, torch.ones((len(batch), 1), dtype=torch.long, device=dev)], dim=1)
        out = self.model(
            input_ids=last[:, None],
            attention_mask=self._mask,
            position_ids=self._next_pos[:, None],
            use_cache=True,
            **cache_kwargs(self.model, self._cache),
        )
        self._cache = output_cache(out)
        self._next_pos = self._next_pos + 1
        self.stats["decode_forwards"] += 1
        self.stats["decode_tokens"] += len(batch)
        return out.logits[:, -1, :].float()

    def _prefill(self, joining: list[_Running]) -> torch.Tensor:
        """Prefill the joining requests (identical sequences once), append their rows to the cache:
        next-token logits ``[len(joining), V]``."""
        dev = self.device
        seqs = [r.request.prompt_token_ids + r.output.output_token_ids for r in joining]
        rows: list[int] = []
        unique: dict[tuple[int, ...], int] = {}
        useqs: list[list[int]] = []
        for seq in seqs:
            key = tuple(seq) if self.prefix_sharing else (len(useqs),)
            at = unique.get(key)
            if at is None:
                at = unique[key] = len(useqs)
                useqs.append(seq)
            rows.append(at)
        width = max(len(s) for s in useqs)
        ids = torch.full((len(useqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(useqs), width), dtype=torch.long)
        for i, seq in enumerate(useqs):
            ids[i, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
            mask[i, width - len(seq) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_tokens"] += sum(len(s) for s in useqs)
        self.stats["shared_prefill_rows"] += len(seqs) - len(useqs)
        logits = out.logits[:, -1, :].float()
        new = output_cache(out)
        next_pos = pos[:, -1] + 1
        if len(useqs) < len(seqs):  # copy the shared rows' cache to every request of the group
            sel = torch.tensor(rows, dtype=torch.long, device=dev)
            logits, mask, next_pos = (
                logits.index_select(0, sel),
                mask.index_select(0, sel),
                next_pos.index_select(0, sel),
            )
            for layer in new.layers:
                layer.keys, layer.values = layer.keys.index_select(0, sel), layer.values.index_select(0, sel)
        if self._cache is None:
            self._cache, self._mask, self._next_pos = new, mask, next_pos
        else:
            assert self._mask is not None and self._next_pos is not None
            width = max(self._mask.shape[1], mask.shape[1])
            self._mask = torch.cat([_left_pad(self._mask, width, 1), _left_pad(mask, width, 1)], dim=0)
            self._next_pos = torch.cat([self._next_pos, next_pos])
            for old, add in zip(self._cache.layers, new.layers):
                old.keys = torch.cat([_left_pad(old.keys, width, 2), _left_pad(add.keys, width, 2)], dim=0)
                old.values = torch.cat([_left_pad(old.values, width, 2), _left_pad(add.values, width, 2)], dim=0)
        self._running.extend(joining)
        return logits

    def _sample(
        self, batch: list[_Running], logits: torch.Tensor
    ) -> list[tuple[int, float, list[tuple[int, float]] | None]]:
        """(token, behaviour logprob, top log-probs when asked) per row. Rows sharing settings are
        processed together; a seeded row draws its one uniform number from its own generator (inverse-CDF
        sampling), so what it samples does not depend on the other rows of the batch."""
        picks: list[tuple[int, float, list[tuple[int, float]] | None]] = [(0, 0.0, None)] * len(batch)
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
            top = max(batch[row].request.params.top_logprobs for row in rows)
            listed = top_logprobs(logp, top) if top else [None] * len(rows)
            for row, tok, lp, best in zip(rows, toks.tolist(), chosen.tolist(), listed):
                k = batch[row].request.params.top_logprobs
                picks[row] = (int(tok), float(lp), best[:k] if best is not None and k else None)
        return picks

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if self._row_dropped:  # rows of aborted requests go
            self._row_dropped = False
            live = [i for i, r in enumerate(self._running) if self._requests.get(r.request.request_id) is r]
            if len(live) < len(self._running):
                self._keep_rows(live)
        joining: list[_Running] = []
        while self._waiting and len(self._running) + len(joining) < self.max_batch_size:
            joining.append(self._requests[self._waiting.popleft()])
        if not self._running and not joining:
            self._reset_cache()
            return []
        parts = []
        if self._running:  # the running rows decode one token from their cache, never prefilled again
            parts.append(self._decode())
        if joining:
            parts.append(self._prefill(joining))
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        batch = self._running
        finished = []
        keep: list[int] = []
        for i, (run, (tok, lp, best)) in enumerate(zip(batch, self._sample(batch, logits.cpu()))):
            params = run.request.params
            out = run.output
            out.output_token_ids.append(tok)
            out.output_logprobs.append(lp)
            if best is not None:
                out.output_top_logprobs.append(best)
            if tok in params.stop_token_ids:
                out.finished, out.finish_reason = True, "stop"
            elif len(out.output_token_ids) >= params.max_new_tokens:
                out.finished, out.finish_reason = True, "length"
            if out.finished:
                del self._requests[run.request.request_id]
                finished.append(out)
            else:
                keep.append(i)
        if len(keep) < len(batch):
            self._keep_rows(keep)
        self._kv_peak = max(self._kv_peak, self.kv_cache_bytes())
        return finished

    # ------------------------------------------------------------------ weights
    def _check_state(self, weights: Mapping[str, torch.Tensor], version: int | None) -> None:
        shapes = self._state_shapes
        missing = [k for k in shapes if k not in weights and not k.endswith("lm_head.weight")]
        unexpected = [k for k in weights if k not in shapes]
        bad_shape = [k for k, v in weights.items() if k in shapes and tuple(v.shape) != shapes[k]]
        if self._dropped:  # every emptied parameter must be written (a tied one under either name)
            given = {id(p) for k, p in self.model.named_parameters(remove_duplicate=False) if k in weights}
            names = {id(p): k for k, p in self.model.named_parameters()}
            missing += [names[id(p)] for p, _ in self._dropped if id(p) not in given and names[id(p)] not in missing]
        if missing or unexpected or bad_shape:
            raise ValueError(
                f"update_weights(version={version}) refused: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                f"wrong shape {bad_shape[:3]}; the engine keeps serving version {self.weight_version}"
            )

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        if self._dropped:
            raise RuntimeError(
                "update_weights: the weights were freed by sleep(2); wake_up(weights, version) loads them"
            )
        self._check_state(weights, version)
        current = self.model.state_dict()
        with torch.no_grad():
            for k, v in weights.items():
                current[k].copy_(v.to(current[k].device, current[k].dtype))
        # cached keys/values came from the old weights: running requests are prefilled again first
        live = [r.request.request_id for r in self._running if self._requests.get(r.request.request_id) is r]
        self._waiting.extendleft(reversed(live))
        self._reset_cache()
        self.weight_version = int(version)

    # ------------------------------------------------------------------ colocated mode
    def kv_cache_bytes(self) -> int:
        """Bytes of the batched KV cache held now (keys and values of every layer)."""
        if self._cache is None:
            return 0
        tensors = [t for layer in self._cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def sleep(self, level: int = 1) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep(level={level}): use one of {SLEEP_LEVELS}")
        if self._requests:
            raise RuntimeError(f"sleep: {len(self._requests)} requests are still in the engine; abort them first")
        self._waiting.clear()
        cuda = self.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        self._reset_cache()
        if level >= 2 and not self._dropped:
            for param in self.model.parameters():  # tied weights are one parameter: emptied once
                self._dropped.append((param, param.shape))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.sleep_level = max(level, self.sleep_level)
        if cuda:  # the blocks go back to the device: what the caching allocator held less after than before
            torch.cuda.empty_cache()
            self._freed = reserved - torch.cuda.memory_reserved(self.device)
        log.debug("torch engine asleep (level %d)", self.sleep_level)

    def wake_up(self, weights: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        if weights is not None:
            self._check_state(weights, version)  # before anything changes: a bad state dict leaves it asleep
        elif self._dropped:
            raise ValueError("wake_up: the weights were freed by sleep(2); give the weights to load")
        with torch.no_grad():
            for param, shape in self._dropped:
                param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        self._dropped = []
        self.sleep_level = 0
        self._kv_peak = 0
        if weights is not None:
            self.update_weights(weights, self.weight_version if version is None else version)

    def memory(self) -> EngineMemory:
        return EngineMemory(
            sleep_level=self.sleep_level,
            kv_cache_bytes=self.kv_cache_bytes(),
            kv_cache_peak_bytes=self._kv_peak,
            weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            frees_memory=True,
            freed_bytes=self._freed,
        )
