"""prompt-replication: n samples of a prompt as n independent requests vs one n-sample request
(ROLL Flash §5.1.2, Fig. 8).

The default is ROLL Flash's setting as far as it states it: Qwen3-8B (ROLL Flash §3, Appendix A) on 16
inference devices (``actor_infer: device_mapping: list(range(0,16))``), responses capped at 30 720
tokens (``response_length``), an average length of about 2k tokens (Qwen3-8B-Base) with the longest
responses more than 20× the median (§1), 64 prompts × 16 samples per step, the mean step time over
several steps. The engine is the simulated one with the H800 roofline of ``rollart.engines.hardware``
(bandwidth-bound decode reads the weights and every running sequence's KV cache) and vLLM-style paged-KV
batching: a device holds what fits next to its weights at 90% memory use, and preempts and recomputes
the newest sequence when it runs out (ROLL Flash does not name its GPU; H800 is the RollArt paper's).

A response length is ``median · difficulty(prompt) · noise(sample)``, two lognormals: prompts differ in
difficulty (``--difficulty-sigma``) and the samples of one prompt around it (``--length-sigma``). The
seed gives the mean and the tail, not how the spread splits between them; the split is what decides
the speedup (the README shows both ends). Without replication a prompt's samples are one request pinned
to one worker (``generate_n``), so the worker that drew the hard prompt decodes all its long samples
side by side, each step reading their KV caches; with replication (``is_num_return_sequences_expand``)
each sample is routed on its own to the least-loaded worker.

The model uses the same engine offline (no sleeping, no system cost) on the very lengths and worker
assignments of the run. ``--sweep`` runs only the model over the other configurations of Fig. 8.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

import numpy as np

from rollart.benchmarks.common import ScaledClock, add_common_arguments, start_inference, write_report

log = logging.getLogger("rollart.bench")

SEED_FIG8 = {"64x16": 149 / 81, "32x16": 116 / 89, "16x32": 162 / 83, "16x64": 1.84}
SWEEP = [(4, 16), (8, 16), (16, 16), (32, 16), (64, 16), (16, 4), (16, 8), (16, 32), (16, 64)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="rollout steps (fresh prompts each); the mean step time")
    p.add_argument("--profile", default="H800", help="hardware profile of the simulated engine")
    p.add_argument("--length-median", type=float, default=1200.0, help="median response length (tokens)")
    p.add_argument("--difficulty-sigma", type=float, default=1.05, help="lognormal spread of prompt difficulty")
    p.add_argument("--length-sigma", type=float, default=0.15, help="lognormal spread of one prompt's samples")
    p.add_argument("--max-new-tokens", type=int, default=30720)
    p.add_argument("--prompt-tokens", type=int, default=192)
    p.add_argument("--token-scale", type=int, default=32, help="real tokens per simulated token")
    p.add_argument(
        "--kv-capacity",
        type=_kv_capacity,
        default="auto",
        help="KV cache tokens per device: auto (from the profile), a number, or none",
    )
    p.add_argument("--sweep", action="store_true", help="only the model, over the configurations of Fig. 8")
    add_common_arguments(p, "runs/bench/prompt-replication", time_scale=0.03)


def _kv_capacity(text: str) -> int | str | None:
    """``--kv-capacity``: ``auto``, ``none`` or a number of tokens."""
    if text.lower() in ("auto", "none"):
        return None if text.lower() == "none" else "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give auto, none or a number of tokens") from None


def _engine_options(args: argparse.Namespace, time_scale: float) -> dict[str, Any]:
    s = args.token_scale
    return {
        "profile": args.profile,
        "kv_capacity_tokens": args.kv_capacity,
        "token_scale": s,
        "time_scale": time_scale,
        "length_lognormal": (args.length_median / s, args.length_sigma),
        # the first prompt token carries the prompt's difficulty factor, in units of 1/64
        "difficulty_from_first_token": 1 / 64,
    }


def _prompts(args: argparse.Namespace, rng: Any, prompts: int) -> list[list[int]]:
    factors = rng.lognormal(0.0, args.difficulty_sigma, prompts)
    body = max(1, args.prompt_tokens // args.token_scale - 1)
    return [[max(1, int(round(f * 64)))] + [7] * body for f in factors]


def _sampling(args: argparse.Namespace) -> Any:
    from rollart.engines.base import SamplingParams

    return SamplingParams(max_new_tokens=max(1, args.max_new_tokens // args.token_scale))


def _model_step_s(args: argparse.Namespace, per_worker: list[list[tuple[list[int], int]]]) -> float:
    """The step time the engine model gives these workers (each a list of (prompt, length) in arrival
    order): the slowest worker's modelled time, run offline."""
    from rollart.engines.base import EngineRequest, SamplingParams
    from rollart.engines.simulated import SimulatedEngine

    opts = _engine_options(args, 0.0)
    opts.pop("length_lognormal"), opts.pop("difficulty_from_first_token")
    worst = 0.0
    for reqs in per_worker:
        eng = SimulatedEngine(**opts)
        for k, (prompt, length) in enumerate(reqs):
            eng.add_request(EngineRequest(f"m{k}", prompt, SamplingParams(max_new_tokens=length)))
        while eng.has_unfinished():
            eng.step()
        worst = max(worst, eng.sim_s)
    return worst


def _model_pair(args: argparse.Namespace, prompts: int, samples: int, workers: int, step: int) -> tuple[float, float]:
    """Model step times (pinned, replicated) of one step's prompts, assigned the way the routers do
    when every request arrives at once: prompt i to worker i mod N; sample k to worker k mod N."""
    from rollart.engines.base import EngineRequest
    from rollart.engines.simulated import SimulatedEngine

    rng = np.random.default_rng([args.seed, step])
    toks = _prompts(args, rng, prompts)
    sampler = SimulatedEngine(**_engine_options(args, 0.0))
    sampling = _sampling(args)
    lengths = [
        [sampler.target_length(EngineRequest(f"s{step}p{i}#{s}", t, sampling)) for s in range(samples)]
        for i, t in enumerate(toks)
    ]
    pinned: list[list[tuple[list[int], int]]] = [[] for _ in range(workers)]
    replicated: list[list[tuple[list[int], int]]] = [[] for _ in range(workers)]
    k = 0
    for i, t in enumerate(toks):
        for s in range(samples):
            pinned[i % workers].append((t, lengths[i][s]))
            replicated[k % workers].append((t, lengths[i][s]))
            k += 1
    return _model_step_s(args, pinned), _model_step_s(args, replicated)


def _sweep(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for prompts, samples in SWEEP:
        pairs = [_model_pair(args, prompts, samples, args.workers, step) for step in range(args.steps)]
        pin, rep = float(np.mean([p for p, _ in pairs])), float(np.mean([r for _, r in pairs]))
        key = f"{prompts}x{samples}"
        rows[key] = {
            "without_replication_sim_s": pin,
            "with_replication_sim_s": rep,
            "model_speedup": pin / rep,
            "paper_figure": SEED_FIG8.get(key),
        }
        log.info("prompt-replication model %s: %.0f s vs %.0f s, %.2fx", key, pin, rep, pin / rep)
    result = {
        "bench": "prompt-replication",
        "mode": "model sweep",
        "config": f"{args.workers} workers, {args.steps} steps each, {args.profile}",
        "rows": rows,
    }
    return write_report(
        args.out,
        "prompt-replication-sweep",
        result,
        {k: v["model_speedup"] for k, v in rows.items()},
        "speedup of prompt replication (model)",
        "prompt replication, Fig. 8 configurations (model)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.sweep:
        return _sweep(args)
    from rollart.rollout.llm_proxy import LLMProxy
    from rollart.rollout.types import GenerateRequest

    clock = ScaledClock(args.time_scale)
    rm, cluster = start_inference(
        {"rollout": {"hardware": args.profile, "devices": args.workers}},
        {"*": [args.profile]},
        _engine_options(args, args.time_scale),
    )
    proxy = LLMProxy(cluster, batch_requests=True)  # as a pipeline sends them (engine.batch_requests)
    sampling = _sampling(args)

    async def pinned(step: int, toks: list[list[int]]) -> tuple[float, list]:
        t0 = time.monotonic()
        outs = await asyncio.gather(
            *(
                cluster.generate_n(
                    GenerateRequest(request_id=f"s{step}p{i}", prompt_token_ids=t, sampling=sampling),
                    args.samples,
                    tag_name="Sim",
                )
                for i, t in enumerate(toks)
            )
        )
        return time.monotonic() - t0, [o for group in outs for o in group]

    async def replicated(step: int, toks: list[list[int]]) -> tuple[float, list]:
        t0 = time.monotonic()
        outs = await asyncio.gather(
            *(
                proxy.generate(
                    GenerateRequest(request_id=f"s{step}p{i}#{s}", prompt_token_ids=t, sampling=sampling), "Sim"
                )
                for i, t in enumerate(toks)
                for s in range(args.samples)
            )
        )
        return time.monotonic() - t0, list(outs)

    def by_worker(outs: list, toks: list[list[int]]) -> list[list[tuple[list[int], int]]]:
        # request ids are s<step>p<prompt>#<sample>: each worker's requests in submission order
        ranks: dict[int, list[tuple[int, int, int]]] = {}
        for o in outs:
            prompt, sample = (int(x) for x in o.request_id.split("p", 1)[1].split("#"))
            ranks.setdefault(o.rank, []).append((prompt, sample, len(o.output_token_ids)))
        return [[(toks[i], n) for i, _, n in sorted(v)] for v in ranks.values()]

    steps = []
    try:
        for step in range(args.steps):
            toks = _prompts(args, np.random.default_rng([args.seed, step]), args.prompts)
            pin_s, pin_out = asyncio.run(pinned(step, toks))
            rep_s, rep_out = asyncio.run(replicated(step, toks))
            lengths = [len(o.output_token_ids) * args.token_scale for o in rep_out]
            row = {
                "without_replication_sim_s": clock.to_sim(pin_s),
                "with_replication_sim_s": clock.to_sim(rep_s),
                "model_without_s": _model_step_s(args, by_worker(pin_out, toks)),
                "model_with_s": _model_step_s(args, by_worker(rep_out, toks)),
                "samples": [len(pin_out), len(rep_out)],
                "mean_length": float(np.mean(lengths)),
                "max_over_median_length": float(np.max(lengths) / np.median(lengths)),
            }
            steps.append(row)
            log.info(
                "prompt-replication step %d/%d: %.0f s vs %.0f s (model %.0f vs %.0f)",
                step + 1,
                args.steps,
                row["without_replication_sim_s"],
                row["with_replication_sim_s"],
                row["model_without_s"],
                row["model_with_s"],
            )
    finally:
        cluster.shutdown()
        rm.shutdown()
    mean = {k: float(np.mean([s[k] for s in steps])) for k in steps[0] if k != "samples"}
    speedup = mean["without_replication_sim_s"] / mean["with_replication_sim_s"]
    model = mean["model_without_s"] / mean["model_with_s"]
    result = {
        "bench": "prompt-replication",
        "config": f"{args.prompts}x{args.samples} on {args.workers} {args.profile} workers, {args.steps} steps",
        "without_replication_sim_s": mean["without_replication_sim_s"],
        "with_replication_sim_s": mean["with_replication_sim_s"],
        "speedup": speedup,
        "model_speedup": model,
        "step_speedups": [s["without_replication_sim_s"] / s["with_replication_sim_s"] for s in steps],
        "mean_length": mean["mean_length"],
        "max_over_median_length": max(s["max_over_median_length"] for s in steps),
        "steps": steps,
        "paper_figure": "1.84x at 64x16 (ROLL Flash §5.1.2: 149 s -> 81 s mean step time)",
    }
    return write_report(
        args.out,
        "prompt-replication",
        result,
        {"n samples / request": result["without_replication_sim_s"], "replicated": result["with_replication_sim_s"]},
        "mean step time (simulated s)",
        f"prompt replication: {speedup:.2f}x (model {model:.2f}x)",
    )
