"""prompt-replication: n samples of a prompt as n independent requests vs one n-sample request
(seed 000 §5.1.2).

``prompts × samples`` (default 64 × 16) on ``workers`` inference workers whose decode step costs
``base + per_seq * running`` (simulated s). Prompts differ in difficulty (their expected response
length is the median times a per-prompt lognormal factor). Without replication a prompt's samples are
one request pinned to one worker (``generate_n``), so a worker that drew hard prompts finishes last;
with replication (``is_num_return_sequences_expand``) every sample is routed on its own to the
least-loaded worker.

The model bound uses the same lengths: the step-time integral of each worker under both assignments
(least-loaded by count for replication), no system cost.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np

from rollart.benchmarks.common import ScaledClock, add_common_arguments, start_inference, write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--length-median", type=float, default=60.0)
    p.add_argument("--length-sigma", type=float, default=0.3, help="spread of samples of one prompt")
    p.add_argument("--difficulty-sigma", type=float, default=1.5, help="spread of prompt difficulty")
    p.add_argument("--step-base", type=float, default=0.005)
    p.add_argument("--step-per-seq", type=float, default=0.002)
    add_common_arguments(p, "runs/bench/prompt-replication", time_scale=0.2)


def _difficulty_tokens(args: argparse.Namespace, rng: Any) -> list[int]:
    # the first prompt token carries the difficulty factor, in units of 1/16
    factors = rng.lognormal(0.0, args.difficulty_sigma, args.prompts)
    return [max(1, int(round(f * 16))) for f in factors]


def _step_time(args: argparse.Namespace, running: int) -> float:
    return args.step_base + args.step_per_seq * running


def _worker_time(args: argparse.Namespace, lengths: list[int]) -> float:
    if not lengths:
        return 0.0
    ls = np.sort(np.asarray(lengths))
    total, prev = 0.0, 0
    for i, length in enumerate(ls):  # between consecutive finishes, len(ls) - i sequences run
        total += (length - prev) * _step_time(args, len(ls) - i)
        prev = length
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart.engines.base import SamplingParams
    from rollart.rollout.llm_proxy import LLMProxy
    from rollart.rollout.types import GenerateRequest

    clock = ScaledClock(args.time_scale)
    engine = {
        "decode_base_s": args.step_base,
        "decode_per_seq_s": args.step_per_seq,
        "prefill_per_token_s": 0.0,
        "time_scale": args.time_scale,
        "length_lognormal": (args.length_median, args.length_sigma),
        "difficulty_from_first_token": 1 / 16,
    }
    rm, cluster = start_inference({"rollout": {"hardware": "H20", "devices": args.workers}}, {"*": ["H20"]}, engine)
    proxy = LLMProxy(cluster)
    rng = np.random.default_rng(args.seed)
    tokens = _difficulty_tokens(args, rng)
    sampling = SamplingParams(max_new_tokens=100_000)

    async def pinned() -> tuple[float, list]:
        t0 = time.monotonic()
        outs = await asyncio.gather(
            *(
                cluster.generate_n(
                    GenerateRequest(request_id=f"p{i}", prompt_token_ids=[tok, 7, 7], sampling=sampling),
                    args.samples,
                    tag_name="Sim",
                )
                for i, tok in enumerate(tokens)
            )
        )
        return time.monotonic() - t0, [o for group in outs for o in group]

    async def replicated() -> tuple[float, list]:
        t0 = time.monotonic()
        outs = await asyncio.gather(
            *(
                proxy.generate(
                    GenerateRequest(request_id=f"p{i}#{s}", prompt_token_ids=[tok, 7, 7], sampling=sampling), "Sim"
                )
                for i, tok in enumerate(tokens)
                for s in range(args.samples)
            )
        )
        return time.monotonic() - t0, list(outs)

    pin_s, pin_out = asyncio.run(pinned())
    rep_s, rep_out = asyncio.run(replicated())
    cluster.shutdown()
    rm.shutdown()
    # model bound from the very lengths the engine produced, per assignment
    by_rank_pin: dict[int, list[int]] = {}
    for o in pin_out:
        by_rank_pin.setdefault(o.rank, []).append(len(o.output_token_ids))
    by_rank_rep: dict[int, list[int]] = {}
    for o in rep_out:
        by_rank_rep.setdefault(o.rank, []).append(len(o.output_token_ids))
    model_pin = max(_worker_time(args, v) for v in by_rank_pin.values())
    model_rep = max(_worker_time(args, v) for v in by_rank_rep.values())
    speedup = pin_s / rep_s
    result = {
        "bench": "prompt-replication",
        "config": f"{args.prompts}x{args.samples} on {args.workers} workers",
        "without_replication_sim_s": clock.to_sim(pin_s),
        "with_replication_sim_s": clock.to_sim(rep_s),
        "speedup": speedup,
        "model_speedup": model_pin / model_rep,
        "seed_figure": "1.84x at 64x16 (seed 000 §5.1.2)",
    }
    return write_report(
        args.out,
        "prompt-replication",
        result,
        {"n samples / request": result["without_replication_sim_s"], "replicated": result["with_replication_sim_s"]},
        "generation time (simulated s)",
        f"prompt replication: {speedup:.2f}x (model {model_pin / model_rep:.2f}x)",
    )
