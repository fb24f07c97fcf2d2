"""A simulated engine for time-scaled benchmarks and runtime tests: real continuous batching
bookkeeping, no model. Each step sleeps for a prefill/decode latency model

    t_step = (decode_base_s + decode_per_seq_s * running + prefill_per_token_s * new_prompt_tokens) * time_scale

and emits one token per running request. A request's output length is drawn from ``length_sampler``
(or ``length_lognormal=(median, sigma)``), seeded by the request's sampling seed, else its id, and
capped at ``max_new_tokens``. With ``profile`` (a hardware name of :mod:`rollart.engines.hardware`,
e.g. ``"H800"``; ``"auto"`` in a config means the worker's own hardware) the step time is that
device's roofline instead: compute-bound prefill, bandwidth-bound decode of the weights plus the KV
cache of every running sequence. Each token is a
deterministic function of the previous token and the position, so a resumed request continues the
same sequence. Its log-prob is always -1.0; asked for top log-probs it lists the emitted token
first, then the next token ids at -2.0, -3.0, ... (made up: there is no model).

Batching follows a paged-KV engine (vLLM's scheduler): requests wait in arrival order and join the
running batch while ``max_batch_size`` and ``kv_capacity_tokens`` allow (``"auto"``: what the
profile's device holds after its weights at 90% memory use); when the next step's KV cache would not
fit, the newest running request is preempted back to the head of the queue and recomputed (its prompt
and tokens prefilled again) when it rejoins. ``token_scale`` lets one simulated token stand for that
many real ones (a step decodes ``token_scale`` tokens of each sequence; costs and capacity count real
tokens), so 30k-token responses simulate in 1k steps. ``sim_s`` is the modelled time, unscaled.
"""

from __future__ import annotations

import random
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from typing import Literal

import torch

from rollart.engines.base import DeltaTracker, EngineRequest, InferenceEngine, RequestOutput, TokenDelta
from rollart.engines.hardware import HardwareProfile, ModelShape, profile_for


class SimulatedEngine(InferenceEngine):
    loads_model = False  # no weights: its latencies are simulated

    def __init__(
        self,
        decode_base_s: float = 0.02,
        decode_per_seq_s: float = 0.0005,
        prefill_per_token_s: float = 0.00002,
        time_scale: float = 1.0,
        vocab_size: int = 64,
        stop_token_id: int = 0,
        length_sampler: Callable[[random.Random], int] | None = None,
        max_batch_size: int = 1024,
        length_lognormal: tuple[float, float] | None = None,
        difficulty_from_first_token: float | None = None,
        profile: str | None = None,
        profile_model: Mapping[str, float | str] | None = None,
        kv_capacity_tokens: int | Literal["auto"] | None = None,
        token_scale: int = 1,
    ):
        self.decode_base_s, self.decode_per_seq_s = decode_base_s, decode_per_seq_s
        self.prefill_per_token_s, self.time_scale = prefill_per_token_s, time_scale
        self.vocab_size, self.stop_token_id = vocab_size, stop_token_id
        if length_sampler is None and length_lognormal is not None:
            median, sigma = length_lognormal
            length_sampler = lambda rng: int(round(median * rng.lognormvariate(0.0, sigma)))
        self.length_sampler = length_sampler
        self.difficulty_from_first_token = difficulty_from_first_token
        self.max_batch_size = max_batch_size
        self.profile: HardwareProfile | None = None
        if profile is not None:
            self.profile = profile_for(profile, ModelShape(**profile_model) if profile_model else None)  # type: ignore[arg-type]
        if int(token_scale) < 1:
            raise ValueError(f"engine.options.token_scale={token_scale!r}: must be an integer >= 1")
        self.token_scale = int(token_scale)
        if kv_capacity_tokens == "auto":
            if self.profile is None:
                raise ValueError(
                    "engine.options.kv_capacity_tokens: 'auto' reads the device of a profile; "
                    "set profile (e.g. H800) or give the capacity in tokens"
                )
            kv_capacity_tokens = self.profile.kv_capacity_tokens()
        if kv_capacity_tokens is not None and int(kv_capacity_tokens) < 1:
            raise ValueError(f"engine.options.kv_capacity_tokens={kv_capacity_tokens!r}: must be >= 1, or unset")
        self.kv_capacity_tokens = None if kv_capacity_tokens is None else int(kv_capacity_tokens)
        self.weight_version = 0
        # arrival order: requests wait (FIFO; a preempted one goes back to the head), then run
        self._waiting: deque[str] = deque()
        self._requests: dict[str, tuple[EngineRequest, RequestOutput, int]] = {}
        self._running: dict[str, None] = {}
        self._new_prompt_tokens = 0
        self.busy_s = 0.0  # slept (scaled) seconds
        self.sim_s = 0.0  # modelled seconds
        self.preemptions = 0
        self._streams = DeltaTracker()

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already running")
        target = self.target_length(request)
        out = RequestOutput(request.request_id, list(request.prompt_token_ids), weight_version=self.weight_version)
        self._requests[request.request_id] = (request, out, target)
        self._waiting.append(request.request_id)
        self._streams.watch(request)

    def target_length(self, request: EngineRequest) -> int:
        """The output length this engine gives ``request``: drawn from ``length_sampler`` (seeded by the
        sampling seed, else the request id) and the prompt's difficulty, capped at ``max_new_tokens``."""
        seed = request.params.seed if request.params.seed is not None else zlib.crc32(request.request_id.encode())
        target = request.params.max_new_tokens
        if self.length_sampler is not None:
            length = float(self.length_sampler(random.Random(seed)))
            if self.difficulty_from_first_token and request.prompt_token_ids:
                # per-prompt difficulty: the first prompt token scales the expected length
                length *= request.prompt_token_ids[0] * self.difficulty_from_first_token
            target = max(1, min(target, int(length)))
        return target

    def abort(self, request_id: str) -> RequestOutput | None:
        item = self._requests.pop(request_id, None)
        if item is None:
            return None
        if request_id in self._running:
            del self._running[request_id]
        else:
            self._waiting.remove(request_id)
        _, out, _ = item
        out.finished, out.finish_reason = True, "abort"
        return out

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def take_deltas(self) -> list[TokenDelta]:
        return self._streams.deltas(lambda rid: item[1] if (item := self._requests.get(rid)) else None)

    def _context(self, rid: str) -> int:
        req, out, _ = self._requests[rid]
        return len(req.prompt_token_ids) + len(out.output_token_ids)

    def _schedule(self) -> int:
        """Admit waiting requests while batch size and KV capacity allow; preempt the newest running
        ones when this step's KV cache would not fit (at least one request always runs). Returns the
        context tokens of the running batch."""
        cap = None if self.kv_capacity_tokens is None else self.kv_capacity_tokens / self.token_scale
        context = sum(self._context(rid) for rid in self._running)
        # the KV cache after this step: every running context plus the token it decodes now
        while cap is not None and context + len(self._running) > cap and len(self._running) > 1:
            rid = next(reversed(self._running))
            del self._running[rid]
            self._waiting.appendleft(rid)
            context -= self._context(rid)
            self.preemptions += 1
        while self._waiting and len(self._running) < self.max_batch_size:
            need = self._context(self._waiting[0])
            if cap is not None and self._running and context + len(self._running) + need + 1 > cap:
                break
            self._running[self._waiting.popleft()] = None
            self._new_prompt_tokens += need  # prefilled on admission (again, after a preemption)
            context += need
        return context

    def _step_s(self, running: int, context: int) -> float:
        """The modelled time of one step (``token_scale`` real decode steps), in real-token units."""
        s, new = self.token_scale, self._new_prompt_tokens * self.token_scale
        if self.profile is not None:
            ctx = context * s
            first = self.profile.step_s(new, running, ctx)
            return first + (s - 1) * self.profile.step_s(0, running, ctx + running * s // 2)
        decode = self.decode_base_s + self.decode_per_seq_s * running
        return s * decode + self.prefill_per_token_s * new

    def _token(self, req: EngineRequest, out: RequestOutput) -> int:
        # a function of the previous token and the position: a resumed request (prompt + partial
        # tokens) continues exactly the sequence it would have produced uninterrupted
        context = req.prompt_token_ids + out.output_token_ids
        h = zlib.crc32(f"{context[-1] if context else -1}:{len(context)}".encode())
        tok = 1 + h % (self.vocab_size - 1)
        return tok if tok != self.stop_token_id else tok + 1

    def step(self) -> list[RequestOutput]:
        context = self._schedule()
        active = list(self._running)
        model_s = self._step_s(len(active), context) if active else 0.0
        self._new_prompt_tokens = 0
        delay = model_s * self.time_scale
        if delay > 0:
            time.sleep(delay)
        self.busy_s += delay
        self.sim_s += model_s
        finished = []
        for rid in active:
            req, out, target = self._requests[rid]
            tok = self._token(req, out)
            out.output_token_ids.append(tok)
            out.output_logprobs.append(-1.0)
            if req.params.top_logprobs:  # a made-up distribution whose most likely token is the one emitted
                k = min(req.params.top_logprobs, self.vocab_size)
                out.output_top_logprobs.append([((tok + j) % self.vocab_size, -1.0 - j) for j in range(k)])
            if len(out.output_token_ids) >= target:
                out.finished = True
                out.finish_reason = "stop" if target < req.params.max_new_tokens else "length"
                finished.append(out)
                del self._running[rid], self._requests[rid]
        return finished

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.weight_version = int(version)
