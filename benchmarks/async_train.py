"""async-train: asynchronous (alpha = 1, 2) vs synchronous (alpha = 0) end-to-end step time, with the
real pipeline (tiny model trained by the torch strategy) and a long-tailed generation injected through
the simulated engine (lognormal response lengths, time-scaled decode steps) — ROLL Flash §3.1.

Bounds (ROLL Flash Prop. 1–2, with every sample decoding concurrently, K = N): with ``mu`` the mean and
``L`` the longest generation time of a sample, and ``T`` the measured train + weight-sync time per step,

    sync  : T_sync  <= mu + L + T
    async : T_async <= max(mu + L / (alpha + 1), T)      (generation and training on disjoint workers)

``mu`` and ``L`` are measured from the alpha = 0 run's generation (rollout wait) and the length
distribution; the bench prints measured step times, their ratio to alpha = 0, and the bound ratios.
Every run trains on batches of the same N samples; the asynchronous runs keep Q = (alpha + 1) N
samples in flight (alpha + 1 env groups per trained group), the setting of Prop. 1's async case.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rollart.benchmarks.common import write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--alphas", default="0,1,2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--length-median", type=float, default=40.0)
    p.add_argument("--length-sigma", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--decode-step", type=float, default=0.01, help="real seconds per decode step")
    p.add_argument(
        "--no-pause",
        action="store_true",
        help="weight swaps without a global rollout pause (weights.pause_rollout=false)",
    )
    p.add_argument(
        "--background-load",
        action="store_true",
        help="asynchronous runs train the next batch while the workers load the weights (weights.background_load)",
    )
    p.add_argument("--out", default="runs/bench/async-train")
    p.add_argument("--json", action="store_true")


def _config(args: argparse.Namespace, alpha: int, out: str) -> Any:
    from rollart.config import PipelineConfig

    return PipelineConfig.model_validate(
        {
            "name": f"async-train-a{alpha}",
            "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
            # Q = (alpha + 1) N samples in flight (ROLL Flash Prop. 1): alpha + 1 env groups per trained group, so
            # rounds for the next alpha batches are already generating when a batch is taken
            "envs": [
                {
                    "name": "reverse",
                    "groups": args.groups * (alpha + 1),
                    "kwargs": {"length": 3},
                    "max_new_tokens": args.max_new_tokens,
                }
            ],
            "rollout": {
                "num_env_groups": args.groups * (alpha + 1),
                "group_size": args.group_size,
                "batch_groups": args.groups,
                "alpha": alpha,
            },
            "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens},
            "engine": {
                "kind": "simulated",
                "options": {
                    "decode_base_s": args.decode_step,
                    "decode_per_seq_s": 0.0,
                    "prefill_per_token_s": 0.0,
                    "vocab_size": 60,
                    "length_lognormal": (args.length_median, args.length_sigma),
                },
            },
            "train": {"lr": 1e-4},
            "steps": args.steps,
            "checkpoint_every": 0,
            "output_dir": out,
            "weights": {"pause_rollout": not args.no_pause, "background_load": args.background_load and alpha > 0},
        }
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.pipelines.agentic import AgenticPipeline

    alphas = [int(a) for a in args.alphas.split(",")]
    measured: dict[int, dict[str, float]] = {}
    for alpha in alphas:
        pipe = AgenticPipeline(_config(args, alpha, f"{args.out}/alpha{alpha}"), progress=False)
        try:
            history = pipe.run()
        finally:
            pipe.shutdown()
            import ray

            ray.shutdown()  # a fresh local Ray per alpha: released resources are not waited for
        steady = history[2:] or history  # the first steps fill the pipeline
        measured[alpha] = {
            "step_s": statistics.mean(h["time"]["step_s"] for h in steady),
            "rollout_wait_s": statistics.mean(h["time"]["rollout_wait_s"] for h in steady),
            "train_sync_s": statistics.mean(h["time"]["train_s"] + h["time"]["weight_sync_s"] for h in steady),
            "max_staleness": max(h["max_staleness"] for h in history),
        }
    base = measured[alphas[0]]
    # generation of one sample: mean and longest decode time under the injected length distribution
    import numpy as np

    lengths = np.minimum(
        args.length_median * np.random.default_rng(0).lognormal(0, args.length_sigma, 100_000), args.max_new_tokens
    )
    n = args.groups * args.group_size
    mu = float(lengths.mean()) * args.decode_step
    longest = float(np.mean([lengths[i : i + n].max() for i in range(0, 100_000 - n, n)])) * args.decode_step
    t_train = base["train_sync_s"]
    bound_sync = mu + longest + t_train
    rows = {}
    for alpha, m in measured.items():
        bound = bound_sync if alpha == 0 else max(mu + longest / (alpha + 1), t_train)
        rows[str(alpha)] = {
            **m,
            "ratio_to_sync": m["step_s"] / base["step_s"],
            "bound_s": bound,
            "bound_ratio": bound / bound_sync,
            "measured_over_bound": m["step_s"] / bound,
        }
    result = {
        "bench": "async-train",
        "per_alpha": rows,
        "mu_gen_s": mu,
        "longest_gen_s": longest,
        "train_sync_s": t_train,
        "paper_figure": "2.05x end to end (RollArt paper §7.2); bounds of ROLL Flash Prop. 1-2",
    }
    return write_report(
        args.out,
        "async-train",
        result,
        {f"alpha={a}": m["step_s"] for a, m in measured.items()},
        "step time (s)",
        "async training: " + ", ".join(f"α={a} {r['ratio_to_sync']:.2f}x of sync" for a, r in rows.items()),
    )
