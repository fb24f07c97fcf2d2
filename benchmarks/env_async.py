"""env-async: trajectory-level vs batch-level environment interaction (ROLL Flash §5.2.1, Fig. 9).

Both modes run the real LLMProxy and inference workers (simulated engine) over the same envs with the
same sampled step latencies ``N(mean, std)`` (simulated seconds, clipped at 0), time-scaled.

- batch-level: every turn generates for all envs (one batched call per inference worker), then steps
  all envs and waits for the slowest;
- trajectory-level: one EnvManager per env through the RolloutScheduler; each trajectory moves on as
  soon as its own step returns. Its LLMProxy sends requests as a pipeline does (``engine.batch_requests``,
  on by default: the requests of one event-loop turn go to each worker as one call).

Ideal bound for the sampled latencies (generation time taken as 0):
``sum_t max_i lat[i, t] / max_i sum_t lat[i, t]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np

from rollart.benchmarks.common import (
    ScaledClock,
    ScriptedLatencyEnv,
    TinyCodec,
    add_common_arguments,
    start_inference,
    write_report,
)
from rollart.rollout.config import EngineConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mean", type=float, default=10.0, help="mean env step latency (simulated s)")
    p.add_argument("--std", type=float, default=10.0, help="std of env step latency (simulated s)")
    p.add_argument("--batch", type=int, default=512, help="trajectories per batch (one env each)")
    p.add_argument("--turns", type=int, default=30, help="env steps per trajectory")
    p.add_argument("--workers", type=int, default=2, help="inference workers")
    p.add_argument(
        "--batch-requests",
        action=argparse.BooleanOptionalAction,
        default=EngineConfig.model_fields["batch_requests"].default,
        help="trajectory-level: the LLMProxy's batched ADD, as a pipeline sends requests (engine.batch_requests; "
        "default: the pipeline's default); --no-batch-requests: one Ray call per request",
    )
    add_common_arguments(p, "runs/bench/env-async", time_scale=0.05)


async def _batch_level(proxy: Any, envs: list[ScriptedLatencyEnv], codec: TinyCodec) -> float:
    import rollart as ra
    from rollart.engines.base import SamplingParams
    from rollart.rollout.types import GenerateRequest

    sampling = SamplingParams(max_new_tokens=2, stop_token_ids=[0])
    t0 = time.monotonic()
    obs = await asyncio.gather(*(e.reset(i) for i, e in enumerate(envs)))
    history = [codec.encode(o) for o, _ in obs]
    for turn in range(envs[0].max_steps):
        reqs = [
            GenerateRequest(request_id=f"b{i}:{turn}", prompt_token_ids=h, sampling=sampling)
            for i, h in enumerate(history)
        ]
        outs = await proxy.cluster.generate_batch(ra.Batch({"requests": reqs}))
        steps = await asyncio.gather(*(e.step(codec.decode(o.output_token_ids)) for e, o in zip(envs, outs)))
        history = [h + o.output_token_ids + codec.encode(s[0]) for h, o, s in zip(history, outs, steps)]
    return time.monotonic() - t0


async def _trajectory_level(proxy: Any, envs: list[ScriptedLatencyEnv], codec: TinyCodec) -> float:
    from rollart.rollout.config import RolloutConfig
    from rollart.rollout.env_manager import EnvManager
    from rollart.rollout.scheduler import RolloutScheduler

    groups = [[EnvManager(e, proxy, codec)] for e in envs]
    cfg = RolloutConfig(num_env_groups=len(envs), group_size=1, batch_groups=len(envs), alpha=0)
    sched = RolloutScheduler(groups, cfg)
    t0 = time.monotonic()
    sched.start()
    batch = await sched.get_batch()
    elapsed = time.monotonic() - t0
    await sched.stop()
    assert len(batch) == len(envs) and all(g[0].status == "ok" for g in batch)
    return elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    lat = np.clip(rng.normal(args.mean, args.std, size=(args.batch, args.turns)), 0.0, None)
    clock = ScaledClock(args.time_scale)
    rm, cluster = start_inference(
        {"rollout": {"hardware": "H20", "devices": args.workers}},
        {"*": ["H20"]},
        {"decode_base_s": 0.0005, "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0},
    )
    from rollart.rollout.llm_proxy import LLMProxy

    proxy = LLMProxy(cluster, batch_requests=args.batch_requests)
    codec = TinyCodec()

    async def both() -> tuple[float, float]:
        b = await _batch_level(proxy, [ScriptedLatencyEnv(row, clock) for row in lat], codec)
        t = await _trajectory_level(proxy, [ScriptedLatencyEnv(row, clock) for row in lat], codec)
        return b, t

    batch_s, traj_s = asyncio.run(both())
    cluster.shutdown()
    rm.shutdown()
    ideal = float(lat.max(axis=0).sum() / lat.sum(axis=1).max())
    speedup = batch_s / traj_s
    result = {
        "bench": "env-async",
        "mean": args.mean,
        "std": args.std,
        "batch": args.batch,
        "turns": args.turns,
        "batch_requests": args.batch_requests,
        "time_scale": args.time_scale,
        "batch_level_sim_s": clock.to_sim(batch_s),
        "trajectory_level_sim_s": clock.to_sim(traj_s),
        "speedup": speedup,
        "ideal_speedup": ideal,
        "fraction_of_ideal": speedup / ideal,
        "paper_figure": "2.46x at (10, 10), batch 512 (ROLL Flash Fig. 9)",
    }
    return write_report(
        args.out,
        f"env-async-mu{args.mean:g}-sd{args.std:g}",
        result,
        {"batch-level": result["batch_level_sim_s"], "trajectory-level": result["trajectory_level_sim_s"]},
        "step time (simulated s)",
        f"env-async μ={args.mean:g} σ={args.std:g}: {speedup:.2f}× (ideal {ideal:.2f}×)",
    )
