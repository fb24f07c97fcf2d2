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
same sequence.
"""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Callable, Mapping

import torch

from rollart.engines.base import EngineRequest, InferenceEngine, RequestOutput
from rollart.engines.hardware import HardwareProfile, ModelShape, profile_for


class SimulatedEngine(InferenceEngine):
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
        self.weight_version = 0
        self._running: dict[str, tuple[EngineRequest, RequestOutput, int]] = {}
        self._new_prompt_tokens = 0
        self.busy_s = 0.0

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._running:
            raise ValueError(f"request {request.request_id!r} is already running")
        seed = request.params.seed if request.params.seed is not None else zlib.crc32(request.request_id.encode())
        rng = random.Random(seed)
        target = request.params.max_new_tokens
        if self.length_sampler is not None:
            length = float(self.length_sampler(rng))
            if self.difficulty_from_first_token and request.prompt_token_ids:
                # per-prompt difficulty: the first prompt token scales the expected length
                length *= request.prompt_token_ids[0] * self.difficulty_from_first_token
            target = max(1, min(target, int(length)))
        out = RequestOutput(request.request_id, list(request.prompt_token_ids), weight_version=self.weight_version)
        self._running[request.request_id] = (request, out, target)
        self._new_prompt_tokens += len(request.prompt_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        item = self._running.pop(request_id, None)
        if item is None:
            return None
        _, out, _ = item
        out.finished, out.finish_reason = True, "abort"
        return out

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def _token(self, req: EngineRequest, out: RequestOutput) -> int:
        # a function of the previous token and the position: a resumed request (prompt + partial
        # tokens) continues exactly the sequence it would have produced uninterrupted
        context = req.prompt_token_ids + out.output_token_ids
        h = zlib.crc32(f"{context[-1] if context else -1}:{len(context)}".encode())
        tok = 1 + h % (self.vocab_size - 1)
        return tok if tok != self.stop_token_id else tok + 1

    def step(self) -> list[RequestOutput]:
        active = list(self._running.items())[: self.max_batch_size]
        if self.profile is not None:
            context = sum(len(req.prompt_token_ids) + len(out.output_token_ids) for _, (req, out, _) in active)
            delay = self.profile.step_s(self._new_prompt_tokens, len(active), context) * self.time_scale
        else:
            delay = (
                self.decode_base_s
                + self.decode_per_seq_s * len(active)
                + self.prefill_per_token_s * self._new_prompt_tokens
            ) * self.time_scale
        self._new_prompt_tokens = 0
        if delay > 0:
            time.sleep(delay)
        self.busy_s += delay
        finished = []
        for rid, (req, out, target) in active:
            out.output_token_ids.append(self._token(req, out))
            out.output_logprobs.append(-1.0)
            if len(out.output_token_ids) >= target:
                out.finished = True
                out.finish_reason = "stop" if target < req.params.max_new_tokens else "length"
                finished.append(out)
                del self._running[rid]
        return finished

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.weight_version = int(version)
