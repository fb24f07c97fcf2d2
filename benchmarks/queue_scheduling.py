"""queue-scheduling: queue scheduling + dynamic filtering vs batch rollout (ROLL Flash §5.1.1, Fig. 7).

RLVR with ``prompts × samples`` per step (default 8 × 8) and dynamic filtering of groups whose rewards
are all equal. Response lengths are long-tailed (lognormal), rewards Bernoulli with a per-prompt
probability ``Beta(0.5, 0.5)``, each reward takes ``N(1, 0.3)`` simulated s.

- batch rollout: generate the whole batch (one batched call per worker), then compute every reward,
  filter, and start another batch of prompts while fewer than ``prompts`` groups survived;
- queue scheduling: every sample is its own task through the real scheduler and EnvManagers, its
  reward computed as soon as it ends; ``extra`` more prompts run at once (``max_additional_running_prompts``)
  so a filtered group is replaced at once.

The model bound is the same length/reward model evaluated with no system cost (Monte Carlo).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np

from rollart.benchmarks.common import (
    ScaledClock,
    SimVerifiableEnv,
    TinyCodec,
    add_common_arguments,
    start_inference,
    write_report,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--extra", type=int, default=16, help="additional running prompts (queue scheduling)")
    p.add_argument("--length-median", type=float, default=300.0, help="median response length (tokens)")
    p.add_argument("--length-sigma", type=float, default=0.6)
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--decode-step", type=float, default=0.05, help="simulated s per decode step")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    add_common_arguments(p, "runs/bench/queue-scheduling")


def _env(clock: ScaledClock, rng: Any, args: argparse.Namespace, member: int) -> SimVerifiableEnv:
    # per-sample draws (seeded by prompt and member): the outcome does not depend on completion order
    return SimVerifiableEnv(
        clock,
        rng,
        max_new_tokens=args.max_new_tokens,
        reward_mean=1.0,
        reward_std=0.3,
        beta=(0.5, 0.5),
        member=member,
    )


async def _batch_rollout(proxy: Any, args: argparse.Namespace, clock: ScaledClock, rng: Any, first_seed: int) -> float:
    import rollart as ra
    from rollart.engines.base import SamplingParams
    from rollart.rollout.types import GenerateRequest

    codec = TinyCodec()
    kept, seed = 0, first_seed
    t0 = time.monotonic()
    while kept < args.prompts:
        envs, reqs = [], []
        for p in range(args.prompts):
            for s in range(args.samples):
                env = _env(clock, rng, args, s)
                obs, _ = await env.reset(seed + p)
                envs.append(env)
                reqs.append(
                    GenerateRequest(
                        request_id=f"b{seed + p}:{s}",
                        prompt_token_ids=codec.encode(obs),
                        sampling=SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=[0]),
                    )
                )
        outs = await proxy.cluster.generate_batch(ra.Batch({"requests": reqs}))
        rewards = [
            r[1] for r in await asyncio.gather(*(e.step(codec.decode(o.output_token_ids)) for e, o in zip(envs, outs)))
        ]
        for p in range(args.prompts):
            group = rewards[p * args.samples : (p + 1) * args.samples]
            kept += len(set(group)) > 1
        seed += args.prompts
    return time.monotonic() - t0


async def _queue(proxy: Any, args: argparse.Namespace, clock: ScaledClock, rng: Any, first_seed: int) -> float:
    from rollart.engines.base import SamplingParams
    from rollart.rollout.config import RolloutConfig
    from rollart.rollout.env_manager import EnvManager
    from rollart.rollout.scheduler import RolloutScheduler

    codec = TinyCodec()
    n_groups = args.prompts + args.extra
    groups = [
        [
            EnvManager(
                _env(clock, rng, args, s), proxy, codec, sampling=SamplingParams(max_new_tokens=args.max_new_tokens)
            )
            for s in range(args.samples)
        ]
        for _ in range(n_groups)
    ]
    cfg = RolloutConfig(
        num_env_groups=n_groups, group_size=args.samples, batch_groups=args.prompts, alpha=0, filter_zero_variance=True
    )
    sched = RolloutScheduler(groups, cfg, seed_fn=lambda g, r: first_seed + r * n_groups + g)
    t0 = time.monotonic()
    sched.start()
    batch = await sched.get_batch()
    elapsed = time.monotonic() - t0
    await sched.stop()
    assert len(batch) == args.prompts and all(len({t.reward for t in g}) > 1 for g in batch)
    return elapsed


def _model(args: argparse.Namespace, rng: Any, trials: int = 300) -> tuple[float, float]:
    """(batch, queue) step times of the length/reward model with no system cost, simulated s."""

    def sample_groups(n: int) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.minimum(
            args.length_median * rng.lognormal(0, args.length_sigma, (n, args.samples)), args.max_new_tokens
        )
        done = lengths * args.decode_step + np.clip(rng.normal(1.0, 0.3, (n, args.samples)), 0, None)
        p = rng.beta(0.5, 0.5, n)[:, None]
        r = rng.random((n, args.samples)) < p
        keep = r.any(axis=1) & ~r.all(axis=1)
        return done.max(axis=1), keep

    batch_t, queue_t = [], []
    for _ in range(trials):
        kept, t = 0, 0.0
        while kept < args.prompts:
            done, keep = sample_groups(args.prompts)
            t += done.max()
            kept += keep.sum()
        batch_t.append(t)
        # queue: prompts+extra slots; each slot runs groups back to back; the step ends when the
        # prompts-th kept group completes
        ends: list[float] = []
        for _slot in range(args.prompts + args.extra):
            clock = 0.0
            for _ in range(6):
                done, keep = sample_groups(1)
                clock += float(done[0])
                if keep[0]:
                    ends.append(clock)
        queue_t.append(sorted(ends)[args.prompts - 1] if len(ends) >= args.prompts else float("nan"))
    return float(np.mean(batch_t)), float(np.nanmean(queue_t))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.rollout.llm_proxy import LLMProxy

    clock = ScaledClock(args.time_scale)
    engine = {
        "decode_base_s": args.decode_step,
        "decode_per_seq_s": 0.0,
        "prefill_per_token_s": 0.0,
        "time_scale": args.time_scale,
        "length_lognormal": (args.length_median, args.length_sigma),
    }
    rm, cluster = start_inference({"rollout": {"hardware": "H20", "devices": args.workers}}, {"*": ["H20"]}, engine)
    proxy = LLMProxy(cluster)
    rng = np.random.default_rng(args.seed)

    async def measure() -> tuple[float, float]:
        b = q = 0.0
        for k in range(args.repeats):
            b += await _batch_rollout(proxy, args, clock, rng, 10_000 * (k + 1))
            q += await _queue(proxy, args, clock, rng, 10_000 * (k + 1))
        return clock.to_sim(b / args.repeats), clock.to_sim(q / args.repeats)

    batch_s, queue_s = asyncio.run(measure())
    cluster.shutdown()
    rm.shutdown()
    mb, mq = _model(args, np.random.default_rng(args.seed + 1))
    speedup = batch_s / queue_s
    result = {
        "bench": "queue-scheduling",
        "config": f"{args.prompts}x{args.samples}+{args.extra}",
        "batch_rollout_sim_s": batch_s,
        "queue_scheduling_sim_s": queue_s,
        "speedup": speedup,
        "model_batch_sim_s": mb,
        "model_queue_sim_s": mq,
        "model_speedup": mb / mq,
        "paper_figure": "3.4x at 8x8 with 16 extra prompts (ROLL Flash Fig. 7: 125 s -> 37 s)",
    }
    return write_report(
        args.out,
        "queue-scheduling",
        result,
        {"batch rollout": batch_s, "queue scheduling": queue_s},
        "generation time per step (simulated s)",
        f"queue scheduling {args.prompts}x{args.samples}+{args.extra}: {speedup:.2f}x (model {mb / mq:.2f}x)",
    )
