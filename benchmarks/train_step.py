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

``--lengths 16-512`` gives the rows lengths spread evenly over that range (seeded) instead of ``seq-len``
each; the attention FLOPs then count ``sum(len^2)``, the useful work of the real tokens (a padded pass's
padding is not counted). ``--packing auto|on|off`` picks ``train.packing`` (auto: null, the config's
default); ``both`` runs the padded then the
packed step on the same batch and reports each (``padded``, ``packed``) and ``packing_speedup``, the
ratio of their tokens/s. ``--max-tokens`` is the micro-batch budget (default: the config's, 16384, with
``--lengths``; else the whole batch). The rows are random, so they share no prompt: the bench runs with
``prefix_sharing: false``.

``phase_s`` splits the median step: ``forward`` (the passes that compute log-probs, the proximal ones
included, and the loss), ``backward``, ``optimizer`` (the optimiser step with its gradient clipping),
``communication`` (0 in this one-process bench: data-parallel reductions run inside the backward pass of
a multi-rank job) and ``other`` (building the micro-batches, metrics). On a GPU each phase is timed with
a device synchronisation at its ends, which serialises a little work that otherwise overlaps.
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
    p.add_argument("--lengths", default=None, help="MIN-MAX: row lengths spread over this range (e.g. 16-512)")
    p.add_argument(
        "--packing",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="train.packing: auto (null: packed where it is exact and, on a GPU, has varlen flash attention), on, "
        "off; both compares off with on",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="train.max_tokens_per_microbatch (default 16384)")
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


def lengths_of(spec: str, rows: int, seed: int = 0) -> list[int]:
    """``rows`` lengths spread evenly over ``MIN-MAX`` (a seeded shuffle of an even spread)."""
    try:
        low, high = (int(x) for x in spec.split("-"))
    except ValueError:
        raise SystemExit(f"rollart bench train-step: --lengths {spec!r}: give MIN-MAX, e.g. 16-512") from None
    if not 2 <= low <= high:
        raise SystemExit(f"rollart bench train-step: --lengths {spec!r}: need 2 <= MIN <= MAX")
    spread = [round(low + (high - low) * i / max(rows - 1, 1)) for i in range(rows)]
    g = torch.Generator().manual_seed(seed)
    return [spread[i] for i in torch.randperm(rows, generator=g).tolist()]


def rows_of(lengths: list[int], vocab: int, seed: int = 0) -> ra.Batch:
    """Random rows of the given lengths; the second half of each is the action."""
    from rollart.training import columns as C

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    mask = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    behaviour = [[0.0] * (n // 2) + (-3 * torch.rand(n - n // 2, generator=g)).tolist() for n in lengths]
    adv = [[float((-1) ** i)] * n for i, n in enumerate(lengths)]
    return ra.Batch({C.INPUT_IDS: ids, C.LOSS_MASK: mask, C.BEHAVIOUR_LOGPROBS: behaviour, C.ADVANTAGES: adv})


class PhaseClock:
    """Times the phases of a worker's ``train_step`` by wrapping what runs them: its log-prob and loss
    passes (forward), ``Tensor.backward`` and the optimiser's ``step`` (with the clipping before it)."""

    def __init__(self, worker: Any, device: torch.device):
        self.device = device
        self.totals = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self._worker = worker
        self._backward = torch.Tensor.backward

    def _timed(self, phase: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.totals[phase] += time.perf_counter() - t0

        return wrapped

    def _start(self, phase: str) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def _stop(self, phase: str) -> None:
        self._sync()
        self.totals[phase] += time.perf_counter() - self._t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> PhaseClock:
        w = self._worker
        w._logprobs = self._timed("forward", w._logprobs)
        w._loss = self._timed("forward", w._loss)
        self._hooks = [  # hooks, not a wrapper: the LR scheduler checks that step is the optimizer's own
            w.optimizer.register_step_pre_hook(lambda *_: self._start("optimizer")),
            w.optimizer.register_step_post_hook(lambda *_: self._stop("optimizer")),
        ]
        torch.Tensor.backward = self._timed("backward", self._backward)  # type: ignore[method-assign]
        # gradient clipping belongs to the optimizer phase
        self._clip = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = self._timed("optimizer", self._clip)
        return self

    def __exit__(self, *exc: Any) -> None:
        w = self._worker
        for name in ("_logprobs", "_loss"):
            w.__dict__.pop(name, None)
        for hook in self._hooks:
            hook.remove()
        torch.Tensor.backward = self._backward  # type: ignore[method-assign]
        torch.nn.utils.clip_grad_norm_ = self._clip

    def reset(self) -> None:
        self.totals = dict.fromkeys(self.totals, 0.0)


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


def step_flops(config: Any, params: int, lengths: list[int]) -> float:
    """``sum(len) · 6·N + 12·layers·hidden·sum(len^2)`` (``tokens · (6·N + 12·layers·hidden·seq_len)`` for
    rows of one length), N without an untied input embedding."""
    embed = config.vocab_size * config.hidden_size
    n = params - (0 if getattr(config, "tie_word_embeddings", False) else embed)
    heads_dim = config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    return 6.0 * n * sum(lengths) + 12.0 * config.num_hidden_layers * heads_dim * sum(x * x for x in lengths)


def measure(args: argparse.Namespace, device: torch.device, config: dict[str, Any], lengths: list[int]) -> dict:
    """``--warmup`` then ``--steps`` timed steps of a fresh worker of ``config`` on rows of ``lengths``: the
    median step (wall and, on the CPU, this process's CPU seconds), its phases, whether it ran packed and the
    worker."""
    on_gpu = device.type == "cuda"
    worker = local_train_worker(device, config)
    vocab = worker.module.config.vocab_size
    batch = rows_of(lengths, min(vocab, 50_000))
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times, cpu_times, phases, micro = [], [], [], 0.0
    with PhaseClock(worker, device) as phase_clock:
        for i in range(args.warmup + args.steps):
            if on_gpu:
                torch.cuda.synchronize(device)
            phase_clock.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = worker.train_step(batch)  # returns metrics as Python floats: the step is done on the device
            if on_gpu:
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - c0)
                phases.append(dict(phase_clock.totals))
                micro = metrics["microbatches"] if metrics else 0.0
    step_s = statistics.median(times)
    median = phases[times.index(sorted(times)[(len(times) - 1) // 2])]  # the phases of the median step
    phase_s = {**median, "communication": 0.0}
    phase_s["other"] = max(0.0, step_s - sum(phase_s.values()))
    return {
        "worker": worker,
        "step_s": step_s,
        "step_s_all": times,
        "step_cpu_s": statistics.median(cpu_times),
        "phase_s": phase_s,
        "microbatches": micro,
        "packed": bool(metrics and metrics.get("packed")),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.shape is not None and args.model is not None:
        raise SystemExit("rollart bench train-step: give --shape or --model, not both")
    device = pick_device(args.device)
    on_gpu = device.type == "cuda"
    dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    rows = args.batch or (8 if on_gpu else 1)
    seq_len = args.seq_len or (512 if on_gpu else 128)
    lengths = lengths_of(args.lengths, rows) if args.lengths else [seq_len] * rows
    path, label = model_folder(args.model, args.shape, args.layers)
    peaks = device_peaks(device)
    base = {
        "model": path,
        "dtype": dtype,
        "gradient_checkpointing": args.gradient_checkpointing,
        "max_tokens_per_microbatch": args.max_tokens or (rows * seq_len if not args.lengths else 16384),
        "loss": "ppo",
        "ppo_epochs": 1,
        "prefix_sharing": False,  # random rows share no prompt: its passes would only add a second one
    }
    runs = {}
    for mode in ("off", "on") if args.packing == "both" else (args.packing,):
        runs[mode] = measure(args, device, {**base, "packing": {"auto": None, "on": True, "off": False}[mode]}, lengths)
    last = runs[args.packing if args.packing != "both" else "on"]
    worker = last["worker"]
    config = worker.module.config
    params = sum(p.numel() for p in worker.module.parameters())
    step_s, times, cpu_step = last["step_s"], last["step_s_all"], last["step_cpu_s"]
    tokens = sum(lengths)
    flops = step_flops(config, params, lengths)
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
        "seq_len": seq_len if not args.lengths else max(lengths),
        "lengths": args.lengths,
        "packing": args.packing,
        "ran_packed": last["packed"],
        "max_tokens_per_microbatch": base["max_tokens_per_microbatch"],
        "microbatches": last["microbatches"],
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
        "phase_s": last["phase_s"],
        **(
            {  # this process's CPU seconds: on a shared machine steadier than the wall clock
                "step_cpu_s": cpu_step,
                "tokens_per_cpu_s": tokens / cpu_step,
                "mfu_cpu_time": flops / cpu_step / peaks.peak_flops,
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
    if args.packing == "both":
        for mode, key in (("off", "padded"), ("on", "packed")):
            r = runs[mode]
            result[key] = {
                "step_s": r["step_s"],
                "tokens_per_s": tokens / r["step_s"],
                "microbatches": r["microbatches"],
                "phase_s": r["phase_s"],
                **({"step_cpu_s": r["step_cpu_s"], "tokens_per_cpu_s": tokens / r["step_cpu_s"]} if not on_gpu else {}),
            }
        result["packing_speedup"] = runs["off"]["step_s"] / runs["on"]["step_s"]
        if not on_gpu:
            result["packing_speedup_cpu_time"] = runs["off"]["step_cpu_s"] / runs["on"]["step_cpu_s"]
    bars = (
        {"padded": result["padded"]["tokens_per_s"], "packed": result["packed"]["tokens_per_s"]}
        if args.packing == "both"
        else {"tokens/s": result["tokens_per_s"]}
    )
    return write_report(
        args.out,
        "train_step",
        result,
        bars,
        "training tokens/s",
        f"{label} on {device}: MFU {result['mfu']:.1%}",
    )
