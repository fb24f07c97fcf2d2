"""train-step: rollart's training step (PPO, AdamW) tokens/s and model FLOPs utilisation (MFU).

One in-process ``TorchTrainWorker`` (the torch strategy a run uses) on ``--device`` (auto: the GPU when
torch sees one) takes ``--steps`` timed ``train_step`` calls after ``--warmup`` untimed ones, each on
``batch`` rows of ``seq-len`` random tokens whose second half is the action (``ppo_epochs: 1``: one
forward and one backward pass, then the optimiser step).

FLOPs of a step: ``tokens · (6 · N + 12 · layers · hidden · seq-len)``: the weight matmuls forward and
backward (N: the parameters that multiply, the output layer included, the input embedding lookup not)
and the attention scores and mixing, counted in full (non-causal), as the PaLM paper's MFU does. MFU is
that over the step time and the device's peak: a GPU's dense BF16 datasheet figure
(``rollart.benchmarks.device_peaks``), or on the CPU a measured float32 matmul with the bench's threads
(timed in CPU seconds; the CPU run also reports ``mfu_cpu_time``, its step in this process's CPU seconds,
steadier than the wall clock on a shared machine).

``--shape qwen2.5-0.5b`` runs the real architecture with random weights (``rollart.models.shapes``);
without ``--shape``/``--model``, the built-in tiny model.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

import torch

import rollart as ra
from rollart.benchmarks.common import write_report
from rollart.benchmarks.device_peaks import device_peaks, pick_device
from rollart.benchmarks.engine_throughput import model_folder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default=None, help="a model shape with random weights, e.g. qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=None, help="with --shape: fewer layers (a quick smoke run)")
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: the built-in tiny model)")
    p.add_argument("--batch", type=int, default=None, help="rows per step (default 8 on a GPU, 1 on the CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 512 on a GPU, 128 on the CPU)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--device", default="auto", help="auto (the GPU when torch sees one), cpu, cuda")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default="runs/bench/train_step")


def batch_of(rows: int, seq_len: int, vocab: int, seed: int = 0) -> ra.Batch:
    """``rows`` random sequences of ``seq_len`` tokens; the second half is the action."""
    from rollart.training import columns as C

    g = torch.Generator().manual_seed(seed)
    prompt = seq_len // 2
    ids = torch.randint(3, vocab, (rows, seq_len), generator=g).tolist()
    mask = [[0] * prompt + [1] * (seq_len - prompt) for _ in range(rows)]
    behaviour = [[0.0] * prompt + (-3 * torch.rand(seq_len - prompt, generator=g)).tolist() for _ in range(rows)]
    adv = [[float((-1) ** i)] * seq_len for i in range(rows)]
    return ra.Batch({C.INPUT_IDS: ids, C.LOSS_MASK: mask, C.BEHAVIOUR_LOGPROBS: behaviour, C.ADVANTAGES: adv})


def local_train_worker(device: torch.device, config: dict[str, Any]) -> Any:
    """A ``TorchTrainWorker`` in this process on ``device`` (no Ray: the bench names the device itself)."""
    from rollart.cluster.worker import Worker, WorkerContext
    from rollart.training.torch_strategy import TorchTrainWorker

    ctx = WorkerContext(cluster="bench", job_id="bench", rank=0, world_size=1, pool=None, hardware=device.type)
    worker = TorchTrainWorker.__new__(TorchTrainWorker)
    Worker._rollart_bind(worker, ctx)
    worker.device_ids = (device.index or 0,) if device.type == "cuda" else ()
    TorchTrainWorker.__init__(worker, config)
    return worker


def step_flops(config: Any, params: int, tokens: int, seq_len: int) -> float:
    """``tokens · (6·N + 12·layers·hidden·seq_len)``, N without an untied input embedding."""
    embed = config.vocab_size * config.hidden_size
    n = params - (0 if getattr(config, "tie_word_embeddings", False) else embed)
    heads_dim = config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    return tokens * (6.0 * n + 12.0 * config.num_hidden_layers * heads_dim * seq_len)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.shape is not None and args.model is not None:
        raise SystemExit("rollart bench train-step: give --shape or --model, not both")
    device = pick_device(args.device)
    on_gpu = device.type == "cuda"
    dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    rows = args.batch or (8 if on_gpu else 1)
    seq_len = args.seq_len or (512 if on_gpu else 128)
    path, label = model_folder(args.model, args.shape, args.layers)
    peaks = device_peaks(device)
    worker = local_train_worker(
        device,
        {
            "model": path,
            "dtype": dtype,
            "gradient_checkpointing": args.gradient_checkpointing,
            "max_tokens_per_microbatch": rows * seq_len,
            "loss": "ppo",
            "ppo_epochs": 1,
        },
    )
    config = worker.module.config
    params = sum(p.numel() for p in worker.module.parameters())
    batch = batch_of(rows, seq_len, min(config.vocab_size, 50_000))
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times, cpu_times = [], []
    for i in range(args.warmup + args.steps):
        if on_gpu:
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        worker.train_step(batch)  # returns metrics as Python floats: the step is done on the device
        if on_gpu:
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    step_s = statistics.median(times)
    tokens = rows * seq_len
    flops = step_flops(config, params, tokens, seq_len)
    result: dict[str, Any] = {
        "bench": "train-step",
        "model": label,
        "params": params,
        "device": str(device),
        "device_name": peaks.name,
        "dtype": dtype,
        "gradient_checkpointing": args.gradient_checkpointing,
        "threads": args.threads,
        "batch": rows,
        "seq_len": seq_len,
        "tokens_per_step": tokens,
        "steps": args.steps,
        "step_s": step_s,
        "step_s_all": times,
        "tokens_per_s": tokens / step_s,
        "flops_per_step": flops,
        "achieved_flops": flops / step_s,
        "peak_flops": peaks.peak_flops,
        "peak_flops_source": peaks.peak_flops_source,
        "mfu": flops / step_s / peaks.peak_flops,
        **(
            {  # this process's CPU seconds: on a shared machine steadier than the wall clock
                "step_cpu_s": statistics.median(cpu_times),
                "tokens_per_cpu_s": tokens / statistics.median(cpu_times),
                "mfu_cpu_time": flops / statistics.median(cpu_times) / peaks.peak_flops,
            }
            if not on_gpu
            else {}
        ),
        "peak_memory_gb": (
            torch.cuda.max_memory_allocated(device) / 1e9
            if on_gpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB; the whole process
        ),
    }
    return write_report(
        args.out,
        "train_step",
        result,
        {"tokens/s": result["tokens_per_s"]},
        "training tokens/s",
        f"{label} on {device}: MFU {result['mfu']:.1%}",
    )
