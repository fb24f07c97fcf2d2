"""engine: torch engine decode tokens/s and its memory-bandwidth roofline fraction (vs HF generate).

The engine decodes ``batch`` prompts of ``prompt-len`` random tokens for exactly ``new-tokens`` tokens
(greedy) on ``--device`` (auto: the GPU when torch sees one). Its first step prefills every prompt;
the decode steps after it are timed: decode tokens/s = batch · (new-tokens − 1) / their time (best of
``--repeats``).

Roofline: a decode step reads every weight once (the tied embedding once, as the output layer) and the
KV cache of every running sequence, ``bytes = params · dtype bytes + Σ_rows context · KV bytes per
token``; at the device's memory bandwidth (a GPU's datasheet figure, a CPU's measured copy kernel:
``rollart.benchmarks.device_peaks``) that is the shortest a step can take. ``roofline_fraction`` =
ideal time / measured time; on the CPU also by this process's CPU time (``decode_step_cpu_ms``,
``roofline_fraction_cpu_time``), steadier than the wall clock on a shared machine. The engine's own traffic beyond that (its cache growing by concatenation,
the sampling) counts against it.

``--shape qwen2.5-0.5b`` runs the real architecture with random weights (``rollart.models.shapes``);
without it, the built-in tiny model. ``--hf`` also times Hugging Face ``generate`` on the same batch
(the default for the tiny model) and reports the engine's ratio to it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from rollart.benchmarks.common import write_report
from rollart.benchmarks.device_peaks import device_peaks, pick_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=None, help="default 16; 4 for a shape on the CPU")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=None, help="default 64; 16 for a shape on the CPU")
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: the built-in tiny model)")
    p.add_argument("--shape", default=None, help="a model shape with random weights, e.g. qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=None, help="with --shape: fewer layers (a quick smoke run)")
    p.add_argument("--device", default="auto", help="auto (the GPU when torch sees one), cpu, cuda, cuda:1")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None, help="also time HF generate")
    p.add_argument("--out", default="runs/bench/engine")


def model_folder(model: str | None, shape: str | None, layers: int | None) -> tuple[str, str]:
    """(folder, label) of the bench's model: a shape's folder, a given folder, or the tiny model."""
    if shape is not None:
        from rollart.models.shapes import shape_folder

        return str(shape_folder({"shape": shape, "layers": layers})), shape + (f" ({layers} layers)" if layers else "")
    if model is not None:
        return model, model
    from rollart.models import default_tiny_path

    return str(default_tiny_path()), "tiny"


def kv_bytes_per_token(config: Any, value_bytes: int) -> float:
    """KV-cache bytes of one token: layers · (K, V) · KV heads · head dim · bytes."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * value_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.engines.base import EngineRequest, SamplingParams
    from rollart.engines.torch_engine import TorchEngine

    torch.set_num_threads(args.threads)
    if args.shape is not None and args.model is not None:
        raise SystemExit("rollart bench engine: give --shape or --model, not both")
    device = pick_device(args.device)
    small = device.type == "cpu" and (args.shape is not None or args.model is not None)  # about a minute at 0.5B
    args.batch = args.batch or (4 if small else 16)
    args.new_tokens = args.new_tokens or (16 if small else 64)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    path, label = model_folder(args.model, args.shape, args.layers)
    peaks = device_peaks(device)
    g = torch.Generator().manual_seed(0)
    engine = TorchEngine(path, device=str(device), dtype=dtype, max_batch_size=args.batch)
    config = engine.model.config
    prompts = torch.randint(3, min(100, config.vocab_size), (args.batch, args.prompt_len), generator=g)
    params = sum(p.numel() for p in engine.model.parameters())  # a tied matrix once: read once per step
    value_bytes = torch.finfo(dtype).bits // 8
    per_token_kv = kv_bytes_per_token(config, value_bytes)
    steps = args.new_tokens - 1  # the first token comes from the prefill
    if steps < 1:
        raise SystemExit("rollart bench engine: --new-tokens must be at least 2 (one decode step)")
    kv_read = sum(args.batch * (args.prompt_len + k) * per_token_kv for k in range(1, steps + 1))
    decode_bytes = steps * params * value_bytes + kv_read
    decode_s, decode_cpu_s, total_s = [], [], []
    for _ in range(args.repeats):
        for i, row in enumerate(prompts.tolist()):
            sampling = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
            engine.add_request(EngineRequest(f"r{i}", row, sampling))
        _sync(device)
        t0 = time.perf_counter()
        engine.step()  # every prompt joins: the prefill
        t1, c1 = time.perf_counter(), time.process_time()
        while engine.has_unfinished():
            engine.step()
        _sync(device)
        t2 = time.perf_counter()
        decode_s.append(t2 - t1)
        decode_cpu_s.append(time.process_time() - c1)
        total_s.append(t2 - t0)
    best = min(decode_s)
    ideal = decode_bytes / peaks.bandwidth_B_s
    result: dict[str, Any] = {
        "bench": "engine",
        "model": label,
        "params": params,
        "device": str(device),
        "device_name": peaks.name,
        "dtype": dtype_name,
        "threads": args.threads,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "decode_tokens_per_s": args.batch * steps / best,
        "decode_step_ms": 1e3 * best / steps,
        "torch_engine_tokens_per_s": args.batch * args.new_tokens / min(total_s),  # prefill included
        "bytes_per_decode_step": decode_bytes / steps,
        "weight_bytes": params * value_bytes,
        "kv_bytes_per_token": per_token_kv,
        "bandwidth_B_per_s": peaks.bandwidth_B_s,
        "bandwidth_source": peaks.bandwidth_source,
        "copy_kernel_B_per_s": peaks.copy_B_s,
        "achieved_B_per_s": decode_bytes / best,
        "roofline_fraction": ideal / best,
    }
    if device.type == "cpu":  # this process's CPU seconds: on a shared machine steadier than the wall clock
        result["decode_step_cpu_ms"] = 1e3 * min(decode_cpu_s) / steps
        result["roofline_fraction_cpu_time"] = ideal / min(decode_cpu_s)
    bars = {"decode (rollart torch engine)": result["decode_tokens_per_s"]}
    if args.hf if args.hf is not None else (args.shape is None and args.model is None):
        result.update(_hf_generate(engine.model, prompts.to(device), args, result["torch_engine_tokens_per_s"]))
        bars = {"HF generate": result["hf_generate_tokens_per_s"], "rollart torch engine": bars.popitem()[1]}
    return write_report(
        args.out,
        "engine",
        result,
        bars,
        "output tokens/s",
        f"{label} on {device}: {result['roofline_fraction']:.0%} of the bandwidth roofline",
    )


def _hf_generate(model: Any, prompts: torch.Tensor, args: argparse.Namespace, engine_tps: float) -> dict[str, Any]:
    """HF ``generate`` (its KV cache, greedy) on the same prompts and the same model object."""
    times = []
    for _ in range(args.repeats):
        _sync(prompts.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        _sync(prompts.device)
        times.append(time.perf_counter() - t0)
    hf_tps = args.batch * args.new_tokens / min(times)
    return {"hf_generate_tokens_per_s": hf_tps, "ratio": engine_tps / hf_tps, "goal": ">= 0.8x of HF generate"}
