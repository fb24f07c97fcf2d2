"""throughput: samples/s and tokens/s of generation and training on reverse-3, synchronous (``alpha: 0``)
and asynchronous (``alpha: 1``), and the steps and time to a trailing-mean reward of ``--threshold``.

The setting of issue #17: a Qwen2 built locally (128 hidden, 4 layers, 4 heads, 2 KV heads, 384
intermediate, tied embeddings, the built-in character-level byte-BPE tokenizer), 32 prompts × 8
samples per step, temperature 1, sequence-level GRPO, token-mean loss, one optimizer step per batch,
lr 3e-4, the torch engine. Each mode is one ``AgenticPipeline`` run on a fresh local Ray; the figures
come from its per-step metrics (the first ``--skip`` steps, with their start-up costs, are left out):

- generation: samples (and output tokens) per second of rollout wait — the time the trainer waited for
  a batch; in ``alpha: 1`` generation overlaps training, so this is what was not hidden;
- training: samples (and trained tokens) per second of ``train_s``;
- end to end: samples per second of step time.

Not the issue's full setting yet: no chat template, no 50-step supervised warm-up, and the built-in
reverse reward (letters in place over the longer length) instead of 0.8·in-place/3 + 0.1·stop.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from rollart.benchmarks.common import run_pipeline_once, write_report
from rollart.benchmarks.quickstart import summarise

log = logging.getLogger("rollart.bench")

MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 384}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300, help="steps per mode (the cap on steps to the threshold)")
    p.add_argument("--alphas", default="0,1", help="comma-separated asynchronous bounds to run, e.g. 0,1")
    p.add_argument("--groups", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--window", type=int, default=20, help="steps in the trailing mean of the reward")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the throughput figures")
    p.add_argument("--quick", action="store_true", help="smoke test: 3 steps, 4 prompts x 4 samples, a 1-layer model")
    p.add_argument("--out", default="runs/bench/throughput")


def mode_config(args: argparse.Namespace, alpha: int, out_dir: Path) -> dict[str, Any]:
    """The overrides of ``pipelines/quickstart.yaml`` for one mode (dotted keys)."""
    model = {**MODEL, "num_layers": 1} if args.quick else MODEL
    return {
        "name": f"throughput-a{alpha}",
        "steps": args.steps,
        "tiny_model": model,
        "envs": [{"name": "reverse", "groups": args.groups, "kwargs": {"length": 3}}],
        "rollout.num_env_groups": args.groups,
        "rollout.group_size": args.group_size,
        "rollout.batch_groups": args.groups,
        "rollout.alpha": alpha,
        "sampling": {"temperature": 1.0, "max_new_tokens": 3, "seed": 0},
        "advantage": "grpo",
        "train.lr": 3e-4,
        "train.entropy_coef": 0.0,
        "train.loss_agg": "token-mean",
        "checkpoint_every": 0,
        "output_dir": str(out_dir),
    }


def throughput(history: list[dict[str, Any]], skip: int) -> dict[str, float]:
    """Samples/s and tokens/s of generation (per second of rollout wait), training and end to end."""
    rows = history[skip:] if len(history) > skip else history
    samples = sum(float(h["train"]["rows"]) for h in rows)
    gen_tokens = sum(float(h["tokens"]) for h in rows)
    train_tokens = sum(float(h["train"]["tokens"]) for h in rows)
    wait = sum(float(h["time"]["rollout_wait_s"]) for h in rows)
    train = sum(float(h["time"]["train_s"]) for h in rows)
    step = sum(float(h["time"]["step_s"]) for h in rows)

    def per(x: float, t: float) -> float:
        return x / t if t > 0 else float("nan")

    return {
        "steps_measured": len(rows),
        "generation_samples_per_s": per(samples, wait),
        "generation_tokens_per_s": per(gen_tokens, wait),
        "train_samples_per_s": per(samples, train),
        "train_tokens_per_s": per(train_tokens, train),
        "samples_per_s": per(samples, step),
        "rollout_wait_s_per_step": per(wait, len(rows)),
        "train_s_per_step": per(train, len(rows)),
        "step_s": per(step, len(rows)),
    }


def _run_mode(args: argparse.Namespace, alpha: int) -> tuple[list[dict[str, Any]], float]:
    from rollart.config import load_config

    cfg = load_config("pipelines/quickstart.yaml", mode_config(args, alpha, Path(args.out) / f"alpha{alpha}"))
    return run_pipeline_once(cfg)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.steps, args.groups, args.group_size, args.skip, args.window = 3, 4, 4, 1, 2
    alphas = [int(a) for a in str(args.alphas).split(",") if a.strip()]
    if not alphas or any(a < 0 for a in alphas) or args.steps < 1:
        raise SystemExit(f"--alphas must list bounds >= 0 and --steps be >= 1, got {args.alphas!r}, {args.steps}")
    result: dict[str, Any] = {
        "bench": "throughput",
        "model": MODEL,
        "groups": args.groups,
        "group_size": args.group_size,
    }
    bars: dict[str, float] = {}
    for alpha in alphas:
        history, wall = _run_mode(args, alpha)
        rewards = [float(h["reward_mean"]) for h in history]
        learnt = summarise(rewards, window=args.window, threshold=args.threshold)
        to = learnt["steps_to_threshold"]
        steps_time = [float(h["time"]["step_s"]) for h in history]
        mode = {
            **throughput(history, args.skip),
            **learnt,
            "time_to_threshold_s": None if to is None else sum(steps_time[: to + 1]),
            "wall_s": wall,
        }
        result[f"alpha {alpha}"] = mode
        bars[f"alpha {alpha}"] = mode["samples_per_s"]
        log.info("alpha %d: %s", alpha, mode)
    return write_report(
        args.out, "throughput", result, bars, "samples/s (end to end)", "rollart bench throughput: reverse-3, 32x8"
    )
