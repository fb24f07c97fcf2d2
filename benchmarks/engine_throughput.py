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
``roofline_fraction_cpu_time``), steadier than the wall clock on a shared machine. The engine's own
traffic beyond that (attention over the context bucket rather than each row's exact length, the
sampling) counts against it.

``--kv-cache`` picks the engine: ``static`` (the default engine: static KV cache, device sampling, on a
GPU CUDA graphs unless ``--no-cuda-graphs``) or ``dynamic`` (the Hugging Face forward over a left-padded
``DynamicCache``, the engine before the static cache); ``--compare`` runs both on the same prompts and
reports the speed-up. The prefix cache is off (every repeat decodes the same prompts).

``--session N`` measures prefix reuse instead: ``batch`` chat sessions of N turns each, every turn's
prompt the previous prompt, the previous answer and ``--user-tokens`` new tokens (the first prompt
``prompt-len`` tokens, each answer ``new-tokens`` greedy tokens), run with the prefix cache and
without it on the same engine: per-turn latency (``turn_ms``, from the turn's requests joining to
their last token), the tokens prefilled per turn, the prefix cache's hits, and whether both runs
produced the same tokens.

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
    p.add_argument("--kv-cache", choices=["static", "dynamic"], default="static", help="the engine (default static)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True, help="on a GPU (static)")
    p.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=True, help="with CUDA graphs")
    p.add_argument("--compare", action="store_true", help="also time the dynamic-cache engine: the speed-up")
    p.add_argument("--session", type=int, default=None, help="N: time N-turn chat sessions with/without prefix reuse")
    p.add_argument("--user-tokens", type=int, default=24, help="with --session: new tokens of each user turn")
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


def _engine(path: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace, kv_cache: str) -> Any:
    from rollart.engines.torch_engine import TorchEngine

    if kv_cache == "dynamic":
        return TorchEngine(path, device=str(device), dtype=dtype, max_batch_size=args.batch, kv_cache="dynamic")
    return TorchEngine(
        path,
        device=str(device),
        dtype=dtype,
        max_batch_size=args.batch,
        kv_cache="static",
        prefix_cache_tokens=0,
        cuda_graphs=args.cuda_graphs,
        torch_compile=args.torch_compile,
    )


def _time_decode(
    engine: Any, prompts: torch.Tensor, args: argparse.Namespace, device: torch.device
) -> dict[str, float]:
    """Best-of-repeats wall and CPU seconds of the decode steps, and of the whole generation."""
    from rollart.engines.base import EngineRequest, SamplingParams

    decode_s, decode_cpu_s, total_s = [], [], []
    for _ in range(args.repeats):
        for i, row in enumerate(prompts.tolist()):
            sampling = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
            engine.add_request(EngineRequest(f"r{i}", row, sampling))
        _sync(device)
        t0 = time.perf_counter()
        engine.step()  # every prompt joins: the prefill
        _sync(device)
        t1, c1 = time.perf_counter(), time.process_time()
        while engine.has_unfinished():
            engine.step()
        _sync(device)
        t2 = time.perf_counter()
        decode_s.append(t2 - t1)
        decode_cpu_s.append(time.process_time() - c1)
        total_s.append(t2 - t0)
    return {"decode_s": min(decode_s), "decode_cpu_s": min(decode_cpu_s), "total_s": min(total_s)}


def _session_turns(engine: Any, args: argparse.Namespace, device: torch.device, vocab: int) -> dict[str, Any]:
    """``args.batch`` sessions of ``args.session`` turns on ``engine``: per-turn latency, prefilled tokens."""
    from rollart.engines.base import EngineRequest, SamplingParams

    g = torch.Generator().manual_seed(1)
    top = min(100, vocab)
    prompts = [torch.randint(3, top, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    turn_ms, prefilled, outputs, lengths = [], [], [], []
    for t in range(args.session):
        before = engine.stats["prefill_tokens"]
        for i, prompt in enumerate(prompts):
            engine.add_request(
                EngineRequest(f"s{i}t{t}", prompt, SamplingParams(temperature=0, max_new_tokens=args.new_tokens))
            )
        _sync(device)
        t0 = time.perf_counter()
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.output_token_ids for o in engine.step()})
        _sync(device)
        turn_ms.append(1e3 * (time.perf_counter() - t0))
        prefilled.append(engine.stats["prefill_tokens"] - before)
        lengths.append(max(len(p) for p in prompts))
        answers = [done[f"s{i}t{t}"] for i in range(len(prompts))]
        outputs.append(answers)
        user = [torch.randint(3, top, (args.user_tokens,), generator=g).tolist() for _ in prompts]
        prompts = [p + a + u for p, a, u in zip(prompts, answers, user)]
    return {"turn_ms": turn_ms, "prefilled_tokens": prefilled, "prompt_lens": lengths, "outputs": outputs}


def run_session(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, path: str, label: str
) -> dict[str, Any]:
    from rollart.engines.torch_engine import TorchEngine

    engine = TorchEngine(
        path,
        device=str(device),
        dtype=dtype,
        max_batch_size=max(args.batch, 1),
        cuda_graphs=args.cuda_graphs,
        torch_compile=args.torch_compile,
    )
    vocab = engine.model.config.vocab_size
    _session_turns(engine, argparse.Namespace(**{**vars(args), "session": 2}), device, vocab)  # warm-up
    budget = engine.prefix_cache.budget
    runs = {}
    for name, tokens in (("reuse", budget), ("recompute", 0)):
        engine.prefix_cache.clear()
        engine.prefix_cache.budget = tokens
        hits = engine.stats["prefix_cache_hit_tokens"]
        runs[name] = _session_turns(engine, args, device, vocab)
        runs[name]["hit_tokens"] = engine.stats["prefix_cache_hit_tokens"] - hits
    reuse, recompute = runs["reuse"], runs["recompute"]
    result: dict[str, Any] = {
        "bench": "engine",
        "mode": "session",
        "model": label,
        "device": str(device),
        "device_name": device_peaks(device).name,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": args.threads,
        "sessions": args.batch,
        "turns": args.session,
        "first_prompt_len": args.prompt_len,
        "user_tokens": args.user_tokens,
        "answer_tokens": args.new_tokens,
        "prompt_lens": reuse["prompt_lens"],
        "turn_ms_reuse": reuse["turn_ms"],
        "turn_ms_recompute": recompute["turn_ms"],
        "prefilled_tokens_reuse": reuse["prefilled_tokens"],
        "prefilled_tokens_recompute": recompute["prefilled_tokens"],
        "prefix_cache_hit_tokens": reuse["hit_tokens"],
        "prefilled_over_longest_prompt": sum(reuse["prefilled_tokens"]) / (args.batch * max(reuse["prompt_lens"])),
        "same_tokens": reuse["outputs"] == recompute["outputs"],
        "session_s_reuse": sum(reuse["turn_ms"]) / 1e3,
        "session_s_recompute": sum(recompute["turn_ms"]) / 1e3,
    }
    bars = {"recompute": result["session_s_recompute"], "prefix reuse": result["session_s_reuse"]}
    return write_report(
        args.out,
        "engine-session",
        result,
        bars,
        "session seconds",
        f"{label}: {args.session}-turn sessions on {device}",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.shape is not None and args.model is not None:
        raise SystemExit("rollart bench engine: give --shape or --model, not both")
    device = pick_device(args.device)
    small = device.type == "cpu" and (args.shape is not None or args.model is not None)  # about a minute at 0.5B
    args.batch = args.batch or (1 if args.session else 4 if small else 16)
    args.new_tokens = args.new_tokens or (16 if small or args.session else 64)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    path, label = model_folder(args.model, args.shape, args.layers)
    if args.session:
        return run_session(args, device, dtype, path, label)
    peaks = device_peaks(device)
    g = torch.Generator().manual_seed(0)
    engine = _engine(path, device, dtype, args, args.kv_cache)
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
    timed = _time_decode(engine, prompts, args, device)
    best = timed["decode_s"]
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
        "engine": type(engine).__name__,
        "kv_cache": args.kv_cache,
        "cuda_graphs": bool(getattr(engine, "graphs", None)),
        "torch_compile": bool(getattr(getattr(engine, "decoder", None), "ops", None) and engine.decoder.ops.compiled),
        "decode_tokens_per_s": args.batch * steps / best,
        "decode_step_ms": 1e3 * best / steps,
        "torch_engine_tokens_per_s": args.batch * args.new_tokens / timed["total_s"],  # prefill included
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
        result["decode_step_cpu_ms"] = 1e3 * timed["decode_cpu_s"] / steps
        result["roofline_fraction_cpu_time"] = ideal / timed["decode_cpu_s"]
    bars = {"decode (rollart torch engine)": result["decode_tokens_per_s"]}
    if args.compare and args.kv_cache != "dynamic":
        model = engine.model
        del engine
        before = _engine(path, device, dtype, args, "dynamic")
        before.model.load_state_dict(model.state_dict())
        del model
        old = _time_decode(before, prompts, args, device)
        result["dynamic_decode_tokens_per_s"] = args.batch * steps / old["decode_s"]
        result["dynamic_decode_step_ms"] = 1e3 * old["decode_s"] / steps
        result["dynamic_roofline_fraction"] = ideal / old["decode_s"]
        result["speedup_vs_dynamic"] = old["decode_s"] / best
        if device.type == "cpu":
            result["dynamic_decode_step_cpu_ms"] = 1e3 * old["decode_cpu_s"] / steps
            result["speedup_vs_dynamic_cpu_time"] = old["decode_cpu_s"] / timed["decode_cpu_s"]
        bars = {"dynamic cache (before)": result["dynamic_decode_tokens_per_s"], **bars}
        engine = before
    if args.hf if args.hf is not None else (args.shape is None and args.model is None):
        result.update(_hf_generate(engine.model, prompts.to(device), args, result["torch_engine_tokens_per_s"]))
        bars = {"HF generate": result["hf_generate_tokens_per_s"], **bars}
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
