"""The built-in PyTorch engine (default; CPU or GPU): continuous batching over a static KV cache.

Each running request owns one slot of a preallocated KV cache
(:class:`~rollart.models.kv_cache.StaticKVCache`) and its own length: a step decodes one token for
every running request in one forward (:class:`~rollart.models.decoder.StaticDecoder`, the model's own
modules with an attention that reads each row's cached positions), then prefills the requests that join,
packed into one forward by a token budget (``max_prefill_tokens``), into free slots. Requests join and
leave without moving the others' keys and values; identical sequences that join together (the n samples
of one prompt) are prefilled once and their slot copied (``prefix_sharing``).

Sampling runs on the device (:mod:`rollart.engines.sampling`): per-row temperature, top-k, top-p and
seed, and only the sampled tokens and their log-probs come back to the host. On a CUDA device the decode
step is replayed from CUDA graphs captured at a few batch and context sizes
(:mod:`rollart.engines.decode_graphs`; ``cuda_graphs: false`` turns them off); on the CPU the same code
runs eagerly.

Prefix reuse (``prefix_cache_tokens``, :mod:`rollart.engines.prefix_cache`): the keys and values of
finished (and aborted) requests stay in a bounded, least-recently-used cache keyed by their tokens; a
request that starts with stored tokens — the next turn of a session, whose prompt is the previous
prompt, the previous answer and the new user message — copies them into its slot and prefills only the
rest. New weights clear it.

Architectures: Llama, Qwen2, Qwen3 and Mistral without a sliding window run this way. Any other causal
LM runs on :class:`~rollart.engines.torch_dynamic.DynamicCacheTorchEngine` (the model's own forward over a
Hugging Face ``DynamicCache`` with left-padded rows), which ``kv_cache: dynamic`` also picks.

Colocated mode: ``sleep(1)`` frees the KV cache, the prefix cache and the CUDA graphs; ``sleep(2)`` also
the weights' storage (each parameter keeps its shape to be allocated again); ``wake_up(weights,
version)`` allocates them and loads the trainer's weights. On a GPU the freed blocks go back to the
device (``torch.cuda.empty_cache``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

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
from rollart.engines.decode_graphs import DecodeGraphs
from rollart.engines.prefix_cache import PrefixCache
from rollart.engines.sampling import RowSampling, process_logits, sample_rows, sample_rows_top, uniform_draws
from rollart.engines.torch_dynamic import DynamicCacheTorchEngine
from rollart.engines.torch_options import STATIC_ONLY
from rollart.models.decoder import StaticDecoder, static_config_unsupported
from rollart.models.kv_cache import StaticKVCache

__all__ = ["KV_CACHE_KINDS", "DynamicCacheTorchEngine", "TorchEngine", "process_logits"]

log = logging.getLogger(__name__)

KV_CACHE_KINDS = ("auto", "static", "dynamic")
"""``kv_cache``: ``static`` (the static-cache engine), ``dynamic`` (the Hugging Face forward over a
``DynamicCache``), ``auto`` (static where the architecture allows)."""


@dataclass
class _Request:
    request: EngineRequest
    output: RequestOutput
    generator: torch.Generator | None
    sampling: RowSampling
    order: int  # when it was added: running requests go back to the queue in this order
    slot: int = -1  # its cache slot while it runs
    length: int = 0  # positions of its sequence held in its slot

    def sequence(self) -> list[int]:
        return self.request.prompt_token_ids + self.output.output_token_ids


@dataclass
class _Join:
    run: _Request
    seq: list[int]
    reused: int  # leading tokens whose keys and values come from the prefix cache
    pool_rows: list[int]
    twin: int | None  # index of an identical joining sequence prefilled in its place


def _static_unsupported(model_path: str) -> str | None:
    from transformers import AutoConfig

    return static_config_unsupported(AutoConfig.from_pretrained(str(model_path)))


class TorchEngine(InferenceEngine):
    """Continuous batching over a static KV cache (module docstring).

    Options: ``device``, ``dtype``, ``max_batch_size`` (requests running at once: the cache's slots),
    ``prefix_sharing``, ``kv_cache`` (:data:`KV_CACHE_KINDS`), ``max_model_len`` (positions per sequence;
    None: as many as a sequence needs, the cache growing by doubling), ``max_prefill_tokens`` (the
    tokens one step prefills; a longer prompt alone still joins), ``prefix_cache_tokens`` (the prefix
    cache's budget in tokens; 0 turns it off), ``cuda_graphs`` (capture the decode step on a GPU),
    ``torch_compile`` (with CUDA graphs: fuse the decoder's elementwise steps with ``torch.compile``).

    ``stats`` counts the work done: ``prefill_forwards`` / ``prefill_tokens`` (positions run through the
    model to build cache rows), ``decode_forwards`` / ``decode_tokens``, ``shared_prefill_rows`` (rows
    copied from an identical sequence prefilled in the same forward), ``prefix_cache_queries`` /
    ``prefix_cache_hits`` / ``prefix_cache_hit_tokens`` (joining requests that looked up, found, and the
    tokens they did not prefill), ``prefix_cache_stored_tokens`` / ``prefix_cache_evicted_tokens``,
    ``graph_captures`` / ``graph_replays``.
    """

    def __new__(cls, model_path: str, *args: Any, kv_cache: str = "auto", **kwargs: Any) -> Any:
        if kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"engine.options.kv_cache={kv_cache!r}: use one of {', '.join(KV_CACHE_KINDS)}")
        if cls is TorchEngine and kv_cache != "static":
            reason = "kv_cache: dynamic" if kv_cache == "dynamic" else _static_unsupported(model_path)
            if reason is not None:
                static_only = sorted(k for k in kwargs if k in STATIC_ONLY)
                if static_only and kv_cache == "dynamic":
                    raise ValueError(
                        f"engine.options {static_only}: options of the static-cache torch engine; "
                        "kv_cache: dynamic takes device, dtype, max_batch_size and prefix_sharing"
                    )
                log.info("torch engine: the Hugging Face forward over a dynamic cache (%s)", reason)
                if static_only:
                    log.warning("torch engine: %s do not apply to the dynamic-cache engine (%s)", static_only, reason)
                known = {k: v for k, v in kwargs.items() if k not in STATIC_ONLY}
                return DynamicCacheTorchEngine(model_path, *args, **known)
        return super().__new__(cls)

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_batch_size: int = 256,
        prefix_sharing: bool = True,
        *,
        kv_cache: str = "auto",
        max_model_len: int | None = None,
        max_prefill_tokens: int = 8192,
        prefix_cache_tokens: int = 32768,
        cuda_graphs: bool = True,
        torch_compile: bool = True,
    ):
        from rollart.models.shapes import load_causal_lm

        if max_batch_size < 1:
            raise ValueError(f"engine.options.max_batch_size={max_batch_size}: at least 1")
        if max_prefill_tokens < 1:
            raise ValueError(f"engine.options.max_prefill_tokens={max_prefill_tokens}: at least 1")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"engine.options.max_model_len={max_model_len}: at least 2, or null (no limit)")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype=dtype).to(self.device).eval()
        config = self.model.config
        self.max_batch_size = max_batch_size
        self.prefix_sharing = prefix_sharing
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_cache_kind: Literal["static"] = "static"
        self.weight_version = 0
        heads = int(config.num_attention_heads)
        self.cache = StaticKVCache(
            layers=int(config.num_hidden_layers),
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            dtype=next(self.model.parameters()).dtype,
            device=self.device,
            max_slots=max_batch_size,
            max_len=max_model_len,
        )
        self.decoder = StaticDecoder(self.model, self.cache)
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda":
            if torch_compile:
                self.decoder.ops.compile()
            self.graphs = DecodeGraphs(self.decoder, max_batch_size)
        self._waiting: deque[str] = deque()
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        self._slots: dict[int, _Request] = {}  # slot -> the request running in it
        self._free: set[int] = set()  # free slots below ``_next_slot``
        self._next_slot = 0  # slots at and above are free
        self._added = 0
        self._streams = DeltaTracker()
        pad = config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self._state_shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        self._dropped: list[tuple[torch.nn.Parameter, torch.Size]] = []  # parameters emptied by sleep(2)
        self._kv_peak = 0
        self._freed: int | None = None
        self.stats: dict[str, int] = {
            "prefill_forwards": 0,
            "prefill_tokens": 0,
            "decode_forwards": 0,
            "decode_tokens": 0,
            "shared_prefill_rows": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prefix_cache_hit_tokens": 0,
            "prefix_cache_stored_tokens": 0,
            "prefix_cache_evicted_tokens": 0,
            "graph_captures": 0,
            "graph_replays": 0,
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
        if self.max_model_len is not None and len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: a prompt of {len(request.prompt_token_ids)} tokens leaves no room "
                f"under max_model_len={self.max_model_len}; shorten it or raise engine.options.max_model_len"
            )
        gen = None
        if request.params.seed is not None and request.params.temperature > 0:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(int(request.params.seed))
        out = RequestOutput(request.request_id, list(request.prompt_token_ids), weight_version=self.weight_version)
        self._added += 1
        self._requests[request.request_id] = _Request(request, out, gen, RowSampling.of(request.params), self._added)
        self._waiting.append(request.request_id)
        self._streams.watch(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        run = self._requests.pop(request_id, None)
        if run is None:
            return None
        if run.slot >= 0:
            with torch.inference_mode():
                self._leave(run)
        else:
            self._waiting.remove(request_id)
        run.output.finished, run.output.finish_reason = True, "abort"
        return run.output

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def take_deltas(self) -> list[TokenDelta]:
        return self._streams.deltas(lambda rid: run.output if (run := self._requests.get(rid)) else None)

    @property
    def num_running(self) -> int:
        """Requests holding a cache slot now."""
        return len(self._slots)

    # ------------------------------------------------------------------ slots
    def _take_slot(self) -> int:
        """The lowest free slot (running requests stay in the low slots: a decode step reads slots
        ``0 ..`` the highest running one)."""
        if self._free:
            slot = min(self._free)
            self._free.remove(slot)
            return slot
        self._next_slot += 1
        return self._next_slot - 1

    def _free_slot(self, slot: int) -> None:
        self._free.add(slot)
        while self._next_slot - 1 in self._free:
            self._next_slot -= 1
            self._free.remove(self._next_slot)

    def _leave(self, run: _Request) -> None:
        """``run`` gives its slot back; its keys and values go to the prefix cache."""
        if self.prefix_cache.enabled and run.length > 0:
            self.prefix_cache.store(run.sequence()[: run.length], self.cache, run.slot)
            self._sync_cache_stats()
        del self._slots[run.slot]
        self._free_slot(run.slot)
        run.slot, run.length = -1, 0

    def _sync_cache_stats(self) -> None:
        self.stats["prefix_cache_stored_tokens"] = self.prefix_cache.stats["stored_tokens"]
        self.stats["prefix_cache_evicted_tokens"] = self.prefix_cache.stats["evicted_tokens"]

    # ------------------------------------------------------------------ the forwards
    def _decode(self, batch: list[_Request]) -> torch.Tensor:
        """One token for every running request: next-token logits ``[len(batch), V]`` (``batch`` in slot order)."""
        rows = batch[-1].slot + 1
        ids = [self.pad_id] * rows
        pos = [0] * rows
        for run in batch:
            ids[run.slot] = run.output.output_token_ids[-1]
            pos[run.slot] = run.length
        if self.cache.reserve(rows, max(pos) + 1):
            log.debug("KV cache grown to %d slots x %d positions", self.cache.slots, self.cache.capacity)
        if self.graphs is not None:
            logits = self.graphs.run(ids, pos)
            self.stats["graph_captures"], self.stats["graph_replays"] = self.graphs.captures, self.graphs.replays
        else:
            dev = self.device
            ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
            pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
            logits = self.decoder.head(self.decoder.decode(ids_t, pos_t, max(pos) + 1))
        for run in batch:
            run.length += 1
        self.stats["decode_forwards"] += 1
        self.stats["decode_tokens"] += len(batch)
        if len(batch) < rows:  # free slots below the highest running one computed throw-away rows
            logits = logits.index_select(0, torch.tensor([r.slot for r in batch], device=logits.device))
        return logits

    def _admit(self, running: int) -> list[_Join]:
        """The waiting requests that join this step: while slots are free and the tokens to prefill stay
        within ``max_prefill_tokens`` (the first one always joins)."""
        joins: list[_Join] = []
        firsts: dict[tuple[int, ...], int] = {}
        budget = 0
        while self._waiting and running + len(joins) < self.max_batch_size:
            run = self._requests[self._waiting[0]]
            seq = run.sequence()
            key = tuple(seq)
            twin = firsts.get(key) if self.prefix_sharing else None
            reused, rows = 0, []
            if twin is None and self.prefix_cache.enabled:
                found, rows = self.prefix_cache.match(seq)
                reused = min(found, len(seq) - 1)  # the last token runs: its logits sample the next one
                rows = rows[:reused]
            cost = 0 if twin is not None else len(seq) - reused
            if joins and budget + cost > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            budget += cost
            if twin is None:
                firsts[key] = len(joins)
            joins.append(_Join(run, seq, reused, rows, twin))
        return joins

    def _prefill(self, joins: list[_Join]) -> torch.Tensor:
        """Give each joining request a slot, its cached prefix, and prefill the rest (identical sequences
        once): next-token logits ``[len(joins), V]``."""
        for j in joins:
            j.run.slot = self._take_slot()
            self._slots[j.run.slot] = j.run
        self.cache.reserve(max(self._slots) + 1, max(len(j.seq) for j in joins))
        first = [j for j in joins if j.twin is None]
        for j in first:
            self.stats["prefix_cache_queries"] += int(self.prefix_cache.enabled)
            if j.reused:
                self.prefix_cache.load(j.pool_rows, self.cache, j.run.slot)
                self.stats["prefix_cache_hits"] += 1
                self.stats["prefix_cache_hit_tokens"] += j.reused
        logits = self.decoder.prefill(
            [j.run.slot for j in first], [j.reused for j in first], [j.seq[j.reused :] for j in first]
        )
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_tokens"] += sum(len(j.seq) - j.reused for j in first)
        row_of = {id(j): i for i, j in enumerate(first)}
        select, copy_from, copy_to = [], [], []
        for j in joins:
            j.run.length = len(j.seq)
            if j.twin is not None:
                source = joins[j.twin]
                copy_from.append(source.run.slot)
                copy_to.append(j.run.slot)
                select.append(row_of[id(source)])
            else:
                select.append(row_of[id(j)])
        if copy_to:  # the twins' slots: their first's keys and values
            self.cache.copy_slots(copy_from, copy_to, max(len(j.seq) for j in joins if j.twin is not None))
            self.stats["shared_prefill_rows"] += len(copy_to)
        if len(first) < len(joins):
            logits = logits.index_select(0, torch.tensor(select, device=logits.device))
        return logits

    # ------------------------------------------------------------------ a step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        batch = [self._slots[s] for s in sorted(self._slots)]
        parts = []
        if batch:  # the running requests decode one token from their slots, never prefilled again
            parts.append(self._decode(batch))
        joins = self._admit(len(batch)) if self._waiting else []
        if joins:
            parts.append(self._prefill(joins))
        if not parts:
            return []
        rows = batch + [j.run for j in joins]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        greedy = [r.sampling.greedy for r in rows]
        draws = uniform_draws([r.generator for r in rows], greedy)
        top = max(r.request.params.top_logprobs for r in rows)
        listed: list[list[tuple[int, float]]] | None = None
        if top:  # only a step with a request that asks pays for the top-k
            picks, listed = sample_rows_top(logits, [r.sampling for r in rows], draws, top)
        else:
            picks = sample_rows(logits, [r.sampling for r in rows], draws)
        finished = []
        for i, (run, tok, lp) in enumerate(zip(rows, picks[0].long().tolist(), picks[1].tolist())):
            params, out = run.request.params, run.output
            out.output_token_ids.append(tok)
            out.output_logprobs.append(lp)
            if listed is not None and params.top_logprobs:
                out.output_top_logprobs.append(listed[i][: params.top_logprobs])
            if tok in params.stop_token_ids:
                out.finished, out.finish_reason = True, "stop"
            elif len(out.output_token_ids) >= params.max_new_tokens:
                out.finished, out.finish_reason = True, "length"
            elif self.max_model_len is not None and run.length + 1 >= self.max_model_len:
                out.finished, out.finish_reason = True, "length"  # no position left for this token
            if out.finished:
                del self._requests[run.request.request_id]
                self._leave(run)
                finished.append(out)
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
        with torch.no_grad():  # in place: the CUDA graphs keep the weights' addresses
            for k, v in weights.items():
                current[k].copy_(v.to(current[k].device, current[k].dtype))
        # cached keys and values came from the old weights: running requests are prefilled again first
        running = sorted(self._slots.values(), key=lambda r: r.order)
        for run in running:
            run.slot, run.length = -1, 0
        self._slots.clear()
        self._free, self._next_slot = set(), 0
        self._waiting.extendleft(r.request.request_id for r in reversed(running))
        self.prefix_cache.clear()
        self.weight_version = int(version)

    # ------------------------------------------------------------------ colocated mode
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache and the prefix cache held now."""
        return self.cache.nbytes + self.prefix_cache.nbytes

    def sleep(self, level: int = 1) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep(level={level}): use one of {SLEEP_LEVELS}")
        if self._requests:
            raise RuntimeError(f"sleep: {len(self._requests)} requests are still in the engine; abort them first")
        self._waiting.clear()
        cuda = self.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        if self.graphs is not None:
            self.graphs.reset()
        self.cache.release()
        self.prefix_cache.clear(release=True)
        self._slots.clear()
        self._free, self._next_slot = set(), 0
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
