"""redundant-env: more env groups and bigger groups than the batch needs (ROLL Flash §5.2.2, Fig. 10).

The batch is ``batch_groups × group_keep`` trajectories (default 32 × 8 = 256). The baseline runs exactly
that many envs (32 × 8); the redundant configuration runs ``num_env_groups × group_size`` (36 × 12) and
stops once 32 groups of 8 are in, aborting the rest. Both use the real scheduler, EnvManagers and
LLMProxy, with the latency/failure model of :class:`StochasticLatencyEnv` (defaults: steps ``N(10, 5)``
simulated s, 3 turns, 5% fail-slow episodes at 4x, 1% fail-stop episodes detected by a 150 s step
timeout, after which the round is retried with the same seed).

Ideal bound: a baseline round must wait for the failure timeout whenever one of its 256 envs fails
stop, the redundant one does not; the bench reports the measured ratio next to
``E[baseline] / E[redundant]`` estimated by Monte Carlo from the same model without any system cost.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np

from rollart.benchmarks.common import (
    ScaledClock,
    StochasticLatencyEnv,
    TinyCodec,
    add_common_arguments,
    start_inference,
    write_report,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", default="32x8", help="num_env_groups x group_size of the baseline")
    p.add_argument("--redundant", default="36x12", help="num_env_groups x group_size with redundancy")
    p.add_argument("--batch-groups", type=int, default=32)
    p.add_argument("--group-keep", type=int, default=8)
    p.add_argument("--mean", type=float, default=10.0)
    p.add_argument("--std", type=float, default=5.0)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--p-slow", type=float, default=0.05)
    p.add_argument("--slow-factor", type=float, default=4.0)
    p.add_argument("--p-stop", type=float, default=0.01)
    p.add_argument("--timeout", type=float, default=150.0, help="env step timeout (simulated s)")
    p.add_argument("--repeats", type=int, default=2, help="batches measured per configuration")
    add_common_arguments(p, "runs/bench/redundant-env")


def _shape(text: str) -> tuple[int, int]:
    g, s = text.lower().split("x")
    return int(g), int(s)


async def _collect(
    proxy: Any, args: argparse.Namespace, groups: int, size: int, rng: Any, clock: ScaledClock
) -> tuple[float, dict]:
    from rollart.rollout.config import EnvManagerConfig, RolloutConfig
    from rollart.rollout.env_manager import EnvManager
    from rollart.rollout.scheduler import RolloutScheduler

    mcfg = EnvManagerConfig(step_retries=0, step_timeout_s=args.timeout * clock.scale)
    codec = TinyCodec()
    managers = [
        [
            EnvManager(
                StochasticLatencyEnv(
                    rng,
                    clock,
                    mean=args.mean,
                    std=args.std,
                    turns=args.turns,
                    p_slow=args.p_slow,
                    slow_factor=args.slow_factor,
                    p_stop=args.p_stop,
                ),
                proxy,
                codec,
                config=mcfg,
            )
            for _ in range(size)
        ]
        for _ in range(groups)
    ]
    cfg = RolloutConfig(
        num_env_groups=groups,
        group_size=size,
        group_keep=args.group_keep,
        batch_groups=args.batch_groups,
        alpha=0,
        max_round_failures=100,
    )
    sched = RolloutScheduler(managers, cfg)
    t0 = time.monotonic()
    sched.start()
    batch = await sched.get_batch()
    elapsed = time.monotonic() - t0
    await sched.stop()
    assert len(batch) == args.batch_groups and all(len(g) == args.group_keep for g in batch)
    return elapsed, dict(sched.counts)


def _model_expectation(args: argparse.Namespace, groups: int, size: int, rng: Any, trials: int = 400) -> float:
    """Monte Carlo step time of the model with zero system cost (simulated s).

    Each group retries its seed until a round has ``group_keep`` members that did not fail stop (a
    failed round costs the step timeout); the round ends at its ``group_keep``-th fastest member; the
    batch is in when ``batch_groups`` groups are.
    """
    times = []
    for _ in range(trials):
        group_times = np.zeros(groups)
        pending = np.ones(groups, dtype=bool)
        while pending.any():
            lat = np.clip(rng.normal(args.mean, args.std, size=(groups, size, args.turns)), 0, None)
            slow = rng.random((groups, size)) < args.p_slow
            stop = rng.random((groups, size)) < args.p_stop
            ep = np.where(stop, np.inf, lat.sum(axis=2) * np.where(slow, args.slow_factor, 1.0))
            kth = np.sort(ep, axis=1)[:, args.group_keep - 1]
            finished = pending & np.isfinite(kth)
            group_times[finished] += kth[finished]
            failed = pending & ~np.isfinite(kth)
            group_times[failed] += args.timeout
            pending = failed
        times.append(float(np.sort(group_times)[args.batch_groups - 1]))
    return float(np.mean(times))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.rollout.llm_proxy import LLMProxy

    clock = ScaledClock(args.time_scale)
    rm, cluster = start_inference(
        {"rollout": {"hardware": "H20", "devices": 2}},
        {"*": ["H20"]},
        {"decode_base_s": 0.0005, "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0},
    )
    proxy = LLMProxy(cluster)
    rng = np.random.default_rng(args.seed)
    base_shape, red_shape = _shape(args.baseline), _shape(args.redundant)

    async def measure(shape: tuple[int, int]) -> tuple[float, dict]:
        total, counts = 0.0, {}
        for _ in range(args.repeats):
            t, c = await _collect(proxy, args, shape[0], shape[1], rng, clock)
            total += t
            for k, v in c.items():
                counts[k] = counts.get(k, 0) + v
        return clock.to_sim(total / args.repeats), counts

    base_s, base_counts = asyncio.run(measure(base_shape))
    red_s, red_counts = asyncio.run(measure(red_shape))
    cluster.shutdown()
    rm.shutdown()
    model_rng = np.random.default_rng(args.seed + 1)
    ideal = _model_expectation(args, *base_shape, model_rng) / _model_expectation(args, *red_shape, model_rng)
    speedup = base_s / red_s
    result = {
        "bench": "redundant-env",
        "baseline": args.baseline,
        "redundant": args.redundant,
        "baseline_step_sim_s": base_s,
        "redundant_step_sim_s": red_s,
        "speedup": speedup,
        "model_speedup": ideal,
        "baseline_counts": base_counts,
        "redundant_counts": red_counts,
        "model": {k: getattr(args, k) for k in ("mean", "std", "turns", "p_slow", "slow_factor", "p_stop", "timeout")},
        "paper_figure": "5.45x for 36x12 vs 32x8 (ROLL Flash Fig. 10: 243 s -> 45 s)",
    }
    return write_report(
        args.out,
        "redundant-env",
        result,
        {args.baseline: base_s, args.redundant: red_s},
        "step time (simulated s)",
        f"redundant env rollouts: {speedup:.2f}x (model {ideal:.2f}x)",
    )
