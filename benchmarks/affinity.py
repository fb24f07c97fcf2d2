"""affinity: hardware-affinity mapping of a prefill-heavy and a decode-heavy task (RollArt paper §3.1, Fig. 4, Fig. 11a).

Two single-turn tasks through the real rollout path (EnvManagers, the RolloutScheduler with a quota
per task, the LLMProxy routing by tag through ``@hw_mapping``, inference workers on the simulated
engine with ``profile: auto``, i.e. each worker's step time is its own device's roofline from
:mod:`rollart.engines.hardware`: H800 989.5 TFLOPs / 3.35 TB/s, H20 148 TFLOPs / 4.0 TB/s, Qwen3-8B):

- ``Prefill``: a long prompt and a short answer (FrozenLake / SWE-bench-like: compute-bound);
- ``Decode``: a short prompt and a long answer (GEM-math-like: bandwidth-bound).

Modes, on pools of (about) the same cost (H800 2.85, H20 1.00 per device hour, seed Table 2):

- ``affinity``: a mixed pool (``--mixed`` H800,H20 devices), Prefill → H800, Decode → H20 (P1);
- ``reverse``: the same pool, Prefill → H20, Decode → H800;
- ``h800-only`` / ``h20-only``: a homogeneous pool with the mixed pool's cost (devices rounded), both
  tasks on every device (the Fig. 4 / Fig. 11a baselines);
- ``auto``: the mixed pool with no hint (every tag prefers H800, then H20) and automatic affinity
  (:mod:`rollart.rollout.affinity`, ``routing: {auto: true}`` in a pipeline): one batch learns each
  task's prompt/answer lengths (reported as ``learning_batch``, not counted), the measured batches
  run on the order it derived.

Each mode rolls out ``--repeats`` batches of ``--groups`` × ``--group-size`` trajectories per task.
Reported per mode: rollout time per batch, trajectories/s, tokens/s (prompt and generated), each
task's mean trajectory latency, all in simulated seconds (the engine sleeps its modelled time ×
``--time-scale``), the devices' modelled busy time, and the same figures from an analytic model of the
profiles (every request at t=0, least-loaded routing, one engine step per token), which is what the
measured shape is checked against.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollart.benchmarks.common import TinyCodec, write_report
from rollart.engines.hardware import HARDWARE, profile_for
from rollart.rollout.affinity import AutoAffinity
from rollart.rollout.config import RoutingConfig

log = logging.getLogger("rollart.bench")
MODES = ("affinity", "reverse", "h800-only", "h20-only", "auto")
PAPER_FIGURE = (
    "RollArt paper Fig. 4: 2 H800 vs 6 H20, rollout time H800/H20 down to 0.53 on FrozenLake, H20/H800 0.49-0.79 "
    "on GEM-math; Fig. 11a: affinity (64 H800 + 24 H20) 1.12-1.37x faster than 72 H800, 1.30-1.68x than 208 H20"
)


@dataclass(frozen=True)
class TaskShape:
    tag: str
    prompt: int
    answer: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-prompt", type=int, default=4096, help="Prefill task: prompt tokens")
    p.add_argument("--prefill-answer", type=int, default=32, help="Prefill task: answer tokens")
    p.add_argument("--decode-prompt", type=int, default=64, help="Decode task: prompt tokens")
    p.add_argument("--decode-answer", type=int, default=1024, help="Decode task: answer tokens")
    p.add_argument("--groups", type=int, default=4, help="env groups per task per batch")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--mixed", default="1,3", help="H800,H20 devices of the mixed pool (Fig. 4: 1,3 ~ 2 H800 ~ 6 H20)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=2, help="batches per mode")
    p.add_argument(
        "--quick", action="store_true", help="a small setting (2048/16 and 32/256 tokens, 2x4 per task, 1 batch)"
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="real seconds per simulated second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/affinity", help="output folder for JSON and PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.prefill_prompt, args.prefill_answer = 2048, 16
        args.decode_prompt, args.decode_answer = 32, 256
        args.groups, args.group_size, args.repeats = 2, 4, 1


def layouts(mixed: tuple[int, int]) -> dict[str, dict[str, Any]]:
    """Per mode: its devices per hardware type and its tag → hardware mapping. The homogeneous pools
    get the mixed pool's cost in whole devices (rounded, at least one)."""
    n800, n20 = mixed
    cost = n800 * HARDWARE["H800"].cost + n20 * HARDWARE["H20"].cost
    only800 = max(1, round(cost / HARDWARE["H800"].cost))
    only20 = max(1, round(cost / HARDWARE["H20"].cost))
    return {
        "affinity": {"devices": {"H800": n800, "H20": n20}, "mapping": {"Prefill": ["H800"], "Decode": ["H20"]}},
        "reverse": {"devices": {"H800": n800, "H20": n20}, "mapping": {"Prefill": ["H20"], "Decode": ["H800"]}},
        "h800-only": {"devices": {"H800": only800}, "mapping": {"*": ["H800"]}},
        "h20-only": {"devices": {"H20": only20}, "mapping": {"*": ["H20"]}},
        # no hint: every tag prefers H800, then H20; routing: auto reorders each tag by its measured shape
        "auto": {"devices": {"H800": n800, "H20": n20}, "mapping": {"*": ["H800", "H20"]}, "auto": True},
    }


def cost_of(devices: dict[str, int]) -> float:
    return sum(n * HARDWARE[hw].cost for hw, n in devices.items())


def model(layout: dict[str, Any], tasks: list[TaskShape], per_task: int) -> dict[str, Any]:
    """The profiles' prediction for one batch: requests spread evenly over the workers their tag maps
    to (least-loaded routing with every request arriving at once), each worker prefilling its prompts in
    its first step and then decoding one token per running sequence per step."""
    workers: list[tuple[str, list[TaskShape]]] = [(hw, []) for hw, n in layout["devices"].items() for _ in range(n)]
    for task in tasks:
        hws = layout["mapping"].get(task.tag, layout["mapping"].get("*", []))
        hw = next(h for h in hws if h in layout["devices"])
        mine = [w for w in workers if w[0] == hw]
        for _ in range(per_task):
            min(mine, key=lambda w: len(w[1]))[1].append(task)
    finish: dict[str, list[float]] = {t.tag: [] for t in tasks}
    busy: list[float] = []
    for hw, reqs in workers:
        prof = profile_for(hw)
        t, step, new = 0.0, 0, sum(r.prompt for r in reqs)
        while any(r.answer > step for r in reqs):
            running = [r for r in reqs if r.answer > step]
            context = sum(r.prompt + step for r in running)
            t += prof.step_s(new, len(running), context)
            new, step = 0, step + 1
            for r in running:
                if r.answer == step:
                    finish[r.tag].append(t)
        busy.append(t)
    makespan = max(busy)
    return {
        "rollout_s": makespan,
        "task_latency_s": {tag: statistics.fmean(v) for tag, v in finish.items()},
        "device_busy_s": busy,
    }


class _Task:
    """A single-turn env: a fixed-length prompt, an answer of exactly ``max_new_tokens`` tokens (the
    simulated engine generates up to the cap), reward 1. ``log`` gets (tag, latency) per trajectory."""

    max_steps = 1

    def __init__(self, shape: TaskShape, log_to: list[tuple[str, float]], clock_scale: float):
        self.tag, self.max_new_tokens = shape.tag, shape.answer
        self.prompt = "p" * shape.prompt
        self.log, self.scale = log_to, clock_scale
        self.t0 = 0.0

    async def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.t0 = time.monotonic()
        return self.prompt, {"seed": seed}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.log.append((self.tag, (time.monotonic() - self.t0) / self.scale))
        return "", 1.0, True, False, {}


def _seeds(first: int) -> Callable[[int, int], int]:
    return lambda group, _round: first + group


async def _batches(proxy: Any, args: argparse.Namespace, tasks: list[TaskShape]) -> dict[str, Any]:
    from rollart.engines.base import SamplingParams
    from rollart.rollout.config import RolloutConfig
    from rollart.rollout.env_manager import EnvManager
    from rollart.rollout.scheduler import RolloutScheduler

    codec = TinyCodec()
    latencies: list[tuple[str, float]] = []
    walls, prompt_tokens, output_tokens, trajectories = [], 0, 0, 0
    served: dict[str, Counter[str]] = {}  # tag -> hardware -> trajectories
    for k in range(args.repeats):
        groups = [
            [
                EnvManager(_Task(task, latencies, args.time_scale), proxy, codec, sampling=SamplingParams())
                for _ in range(args.group_size)
            ]
            for task in tasks
            for _ in range(args.groups)
        ]
        n = len(groups)
        cfg = RolloutConfig(num_env_groups=n, group_size=args.group_size, batch_groups=n, alpha=0)
        quotas = {t.tag: args.groups for t in tasks}
        sched = RolloutScheduler(groups, cfg, seed_fn=_seeds(args.seed + 1000 * k), quotas=quotas)
        t0 = time.monotonic()
        sched.start()
        batch = await sched.get_batch()
        walls.append((time.monotonic() - t0) / args.time_scale)
        await sched.stop()
        trajs = [t for g in batch for t in g]
        bad = [t.error for t in trajs if t.status != "ok"]
        if bad:
            raise RuntimeError(f"affinity bench: {len(bad)} trajectories failed, first: {bad[0]}")
        trajectories += len(trajs)
        for t in trajs:
            for hw in t.hardware:
                served.setdefault(t.tag, Counter())[hw] += 1
        prompt_tokens += sum(t.prompt_length for t in trajs)
        output_tokens += sum(t.num_action_tokens for t in trajs)
    total = sum(walls)
    return {
        "rollout_s": statistics.fmean(walls),
        "trajectories_per_s": trajectories / total,
        "prompt_tokens_per_s": prompt_tokens / total,
        "output_tokens_per_s": output_tokens / total,
        "task_latency_s": {t.tag: statistics.fmean(v for tag, v in latencies if tag == t.tag) for t in tasks},
        "hardware_by_tag": {tag: dict(c) for tag, c in sorted(served.items())},
    }


def _run_mode(layout: dict[str, Any], args: argparse.Namespace, tasks: list[TaskShape], name: str) -> dict[str, Any]:
    import rollart as ra
    from rollart.rollout.inference_worker import inference_worker_class
    from rollart.rollout.llm_proxy import LLMProxy

    pools = {"rollout": [{"hardware": hw, "devices": n} for hw, n in layout["devices"].items()]}
    rm = ra.ResourceManager(pools)
    engine = {"kind": "simulated", "options": {"profile": "auto", "time_scale": args.time_scale, "vocab_size": 64}}
    cluster = ra.Cluster(
        f"affinity-{name}",
        inference_worker_class(layout["mapping"]),
        rm,
        pool="rollout",
        worker_kwargs={"engine": engine},
    )

    async def metrics() -> list[dict[str, Any]]:
        return list(await cluster.metrics())

    learning: dict[str, Any] | None = None
    try:
        if layout.get("auto"):
            # the same routing as `routing: {auto: true}` in a pipeline; one batch to learn the shapes
            # (not counted), then the measured batches
            spec = cluster.methods["generate"].hw_mapping
            assert spec is not None
            auto = AutoAffinity(spec.preference, RoutingConfig(min_requests=max(1, args.group_size)))
            proxy = LLMProxy(cluster, affinity=auto)
            learning = asyncio.run(_batches(proxy, argparse.Namespace(**{**vars(args), "repeats": 1}), tasks))
            learning["routing"] = auto.mapping()
            before = {m["rank"]: m["engine_busy_s"] for m in asyncio.run(metrics())}
        else:
            proxy, before = LLMProxy(cluster), {}
        measured = asyncio.run(_batches(proxy, args, tasks))
        per_worker = asyncio.run(metrics())
    finally:
        cluster.shutdown()
        rm.shutdown()
    wrong = [m for m in per_worker if m["engine_profile"] != m["hardware"]]
    if wrong:
        raise RuntimeError(f"affinity bench: workers without their hardware's profile: {wrong}")
    if learning is not None:
        measured["learning_batch"] = learning
    busy = [(m["engine_busy_s"] - before.get(m["rank"], 0.0)) / args.time_scale / args.repeats for m in per_worker]
    measured["device_busy_s"] = {f"{m['hardware']}#{m['rank']}": b for m, b in zip(per_worker, busy)}
    measured["max_device_busy_s"] = max(busy)
    return measured


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from rollart.resource_manager.launcher import ensure_ray

    _apply_quick(args)
    mixed_parts = [int(x) for x in args.mixed.split(",")]
    if len(mixed_parts) != 2 or min(mixed_parts) < 1:
        raise ValueError(f"--mixed {args.mixed!r}: give H800,H20 device counts, both >= 1 (e.g. 1,3)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; use some of {list(MODES)}")
    all_layouts = layouts((mixed_parts[0], mixed_parts[1]))
    tasks = [
        TaskShape("Prefill", args.prefill_prompt, args.prefill_answer),
        TaskShape("Decode", args.decode_prompt, args.decode_answer),
    ]
    per_task = args.groups * args.group_size
    own_ray = not ray.is_initialized()
    if own_ray:
        need = {hw: max(lay["devices"].get(hw, 0) for lay in all_layouts.values()) for hw in HARDWARE}
        ensure_ray({**need, "CPU": 4})
    results: dict[str, Any] = {}
    try:
        for mode in modes:
            layout = all_layouts[mode]
            log.info("affinity: %s on %s, mapping %s", mode, layout["devices"], layout["mapping"])
            measured = _run_mode(layout, args, tasks, mode)
            # auto: the model of the mapping it learnt
            learnt = measured.get("learning_batch", {}).get("routing")
            mapping = {**layout["mapping"], **learnt} if learnt is not None else layout["mapping"]
            results[mode] = {
                "devices": layout["devices"],
                "cost": cost_of(layout["devices"]),
                "mapping": mapping,
                "measured": measured,
                "model": model({**layout, "mapping": mapping}, tasks, per_task),
            }
    finally:
        if own_ray:
            ray.shutdown()
    result: dict[str, Any] = {
        "bench": "affinity",
        "tasks": {t.tag: {"prompt": t.prompt, "answer": t.answer, "trajectories": per_task} for t in tasks},
        "profiles": {
            hw: {
                "tflops": h.tflops,
                "hbm_tb_s": h.hbm_tb_s,
                "cost": h.cost,
                "prefill_ms_per_1k_tokens": 1e6 * profile_for(hw).prefill_s_per_token,
                "decode_weights_ms": 1e3 * profile_for(hw).decode_weights_s,
            }
            for hw, h in HARDWARE.items()
        },
        "time_scale": args.time_scale,
        "modes": results,
        "paper_figure": PAPER_FIGURE,
    }
    if "affinity" in results:
        base = results["affinity"]
        result["affinity_speedup"] = {
            m: {
                "measured": r["measured"]["rollout_s"] / base["measured"]["rollout_s"],
                "model": r["model"]["rollout_s"] / base["model"]["rollout_s"],
            }
            for m, r in results.items()
            if m != "affinity"
        }
    _log_table(result)
    return write_report(
        args.out,
        "affinity",
        result,
        {m: r["measured"]["rollout_s"] for m, r in results.items()},
        "rollout time per batch (simulated s)",
        "prefill task + decode task, cost-equivalent pools",
    )


def _log_table(result: dict[str, Any]) -> None:
    lines = [
        "| mode | devices (cost) | rollout s (model) | traj/s | out tok/s | Prefill latency s | Decode latency s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in result["modes"].items():
        m, mo = r["measured"], r["model"]
        devs = " + ".join(f"{n} {hw}" for hw, n in r["devices"].items())
        lat, mlat = m["task_latency_s"], mo["task_latency_s"]
        lines.append(
            f"| {mode} | {devs} ({r['cost']:.2f}) | {m['rollout_s']:.2f} ({mo['rollout_s']:.2f}) "
            f"| {m['trajectories_per_s']:.1f} | {m['output_tokens_per_s']:.0f} "
            f"| {lat['Prefill']:.2f} ({mlat['Prefill']:.2f}) | {lat['Decode']:.2f} ({mlat['Decode']:.2f}) |"
        )
    result["table"] = "\n".join(lines)
    log.info("affinity:\n%s", result["table"])
