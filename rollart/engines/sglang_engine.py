"""SGLang behind rollart's engine interface (GPUs only; RollArt paper §5.3).

SGLang schedules its own batches in subprocesses, so there is no step to call: the adapter streams
every request (``Engine.async_generate(input_ids=..., stream=True, rid=...)``) on a private event
loop thread, keeps each request's cumulative tokens and logprobs, and ``step`` returns the requests
that finished since the last call (waiting up to ``poll_s`` for the first). ``abort`` asks SGLang's
tokenizer manager to abort the request id and returns the tokens streamed so far.
``update_weights`` loads a full state dict with ``update_weights_from_tensor`` and flushes the radix
cache. SGLang reports logprobs of the sampled tokens; they equal rollart's behaviour logprobs at
temperature 1 without top-k/top-p (the RL default) — with other settings check your SGLang
version's ``return_logprob`` semantics.

Tested only where a CUDA device is present (tests/test_engine_vllm.py skips it otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Mapping
from typing import Any

import torch

from rollart.engines.base import EngineRequest, InferenceEngine, RequestOutput

logger = logging.getLogger(__name__)


class SGLangEngine(InferenceEngine):
    """``engine: {kind: sglang, model: PATH, options: {dtype: bfloat16, mem_fraction_static: 0.5}}``."""

    def __init__(self, model: str, *, dtype: str = "auto", seed: int = 0, poll_s: float = 0.05, **server_args: Any):
        try:
            import sglang as sgl
        except ImportError as err:
            raise ImportError("engine.kind=sglang needs pip install 'rollart[sglang]' on a CUDA machine") from err
        if not torch.cuda.is_available():
            raise RuntimeError("engine.kind=sglang serves on CUDA GPUs; use kind: torch or vllm on CPUs")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-loop", daemon=True)
        self._thread.start()
        # the engine binds its event loop at construction: build it on the private loop's thread
        self._engine = asyncio.run_coroutine_threadsafe(
            self._build(sgl, model, dtype, seed, server_args), self._loop
        ).result()
        self.poll_s = poll_s
        self._partial: dict[str, RequestOutput] = {}
        self._tasks: dict[str, Any] = {}
        self._finished: queue.Queue[RequestOutput] = queue.Queue()
        self._lock = threading.Lock()
        self.weight_version = 0

    @staticmethod
    async def _build(sgl: Any, model: str, dtype: str, seed: int, server_args: dict[str, Any]) -> Any:
        from rollart.models.shapes import is_shape_folder

        if is_shape_folder(model):  # random weights (rollart.models.shapes): SGLang's own dummy ones
            server_args = {"load_format": "dummy", **server_args}
        return sgl.Engine(model_path=model, dtype=dtype, random_seed=seed, skip_tokenizer_init=True, **server_args)

    def _sampling(self, request: EngineRequest) -> dict[str, Any]:
        p = request.params
        out: dict[str, Any] = {
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1,
            "max_new_tokens": p.max_new_tokens,
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": True,
        }
        if p.seed is not None:
            out["sampling_seed"] = p.seed
        return out

    async def _stream(self, request: EngineRequest) -> None:
        rid = request.request_id
        gen = await self._engine.async_generate(
            input_ids=list(request.prompt_token_ids),
            sampling_params=self._sampling(request),
            return_logprob=request.params.logprobs,
            stream=True,
            rid=rid,
        )
        async for chunk in gen:
            with self._lock:
                out = self._partial.get(rid)
                if out is None:
                    return
                out.output_token_ids = list(chunk.get("output_ids", out.output_token_ids))
                lps = chunk.get("meta_info", {}).get("output_token_logprobs")
                if lps:
                    out.output_logprobs = [float(x[0]) for x in lps]
                reason = (chunk.get("meta_info", {}).get("finish_reason") or {}).get("type")
                if reason:
                    out.finished = True
                    out.finish_reason = {"length": "length", "abort": "abort"}.get(reason, "stop")  # type: ignore[assignment]
                    self._partial.pop(rid, None)
                    self._finished.put(out)
                    return

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        with self._lock:
            self._partial[rid] = RequestOutput(
                request_id=rid, prompt_token_ids=list(request.prompt_token_ids), weight_version=self.weight_version
            )
        self._tasks[rid] = asyncio.run_coroutine_threadsafe(self._stream(request), self._loop)

    def abort(self, request_id: str) -> RequestOutput | None:
        with self._lock:
            out = self._partial.pop(request_id, None)
        if out is None:
            return None
        self._loop.call_soon_threadsafe(self._engine.tokenizer_manager.abort_request, request_id)
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        out.finished, out.finish_reason = True, "abort"
        return out

    def step(self) -> list[RequestOutput]:
        done: list[RequestOutput] = []
        try:
            done.append(self._finished.get(timeout=self.poll_s))
        except queue.Empty:
            return done
        while True:
            try:
                done.append(self._finished.get_nowait())
            except queue.Empty:
                break
        for out in done:
            self._tasks.pop(out.request_id, None)
        return done

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._partial) or not self._finished.empty()

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        if any(not torch.is_tensor(v) for v in weights.values()):
            raise ValueError("update_weights: every value of the state dict must be a tensor")
        named = [(k, v.detach()) for k, v in weights.items()]
        result = asyncio.run_coroutine_threadsafe(self._update(named), self._loop).result()
        ok = result[0] if isinstance(result, tuple) else bool(result)
        if not ok:
            raise ValueError(f"update_weights: SGLang refused the state dict: {result}")
        self.weight_version = version

    async def _update(self, named: list[tuple[str, torch.Tensor]]) -> Any:
        """The coroutine behind ``Engine.update_weights_from_tensor`` (whose sync wrapper would re-enter
        this already running loop): one serialized copy per tensor-parallel rank, cache flushed."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        tp = int(getattr(self._engine.server_args, "tp_size", 1) or 1)
        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named) for _ in range(tp)],
            load_format=None,
            flush_cache=True,
        )
        return await self._engine.tokenizer_manager.update_weights_from_tensor(obj, None)

    def shutdown(self) -> None:
        self._engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
