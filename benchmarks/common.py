"""Shared pieces of the time-scaled benchmarks: a local Ray with logical devices, an inference
cluster on the simulated engine, latency-injected envs, and the JSON + PNG report."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("rollart.bench")


class ScaledClock:
    """Simulated seconds → real seconds (``scale`` real seconds per simulated second)."""

    def __init__(self, scale: float):
        self.scale = scale

    async def sleep(self, sim_seconds: float) -> None:
        if sim_seconds > 0:
            await asyncio.sleep(sim_seconds * self.scale)

    def to_sim(self, real_seconds: float) -> float:
        return real_seconds / self.scale


class ScriptedLatencyEnv:
    """A multi-turn text env whose reset/step latencies (simulated seconds) come from a fixed script,
    so two scheduling modes can be compared on the very same sampled latencies. ``None`` in the script
    is a fail-stop (the call never returns); the env is async so thousands run on one event loop."""

    tag = "Sim"
    max_new_tokens = 2

    def __init__(self, step_latencies: Sequence[float | None], clock: ScaledClock, reset_latency: float = 0.0):
        self.script = list(step_latencies)
        self.max_steps = len(self.script)
        self.clock = clock
        self.reset_latency = reset_latency
        self.t = 0

    async def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.t = 0
        await self.clock.sleep(self.reset_latency)
        return "go:", {"seed": seed}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        lat = self.script[self.t]
        self.t += 1
        if lat is None:
            await asyncio.Event().wait()  # fail-stop: never returns (the caller's timeout or abort ends it)
        await self.clock.sleep(lat)
        done = self.t >= self.max_steps
        return "ok:", float(done), done, False, {}


class TinyCodec:
    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [2 + (ord(c) % 60) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "a" * len(ids)


def start_inference(pools: dict, mapping: dict, engine_options: dict, name: str = "infer") -> Any:
    """A ResourceManager + inference Cluster on the simulated engine (local Ray started if needed)."""
    import rollart as ra
    from rollart.rollout.inference_worker import inference_worker_class

    rm = ra.ResourceManager(pools)
    cluster = ra.Cluster(
        name,
        inference_worker_class(mapping),
        rm,
        pool=next(iter(pools)),
        worker_kwargs={"engine": {"kind": "simulated", "options": engine_options}},
    )
    return rm, cluster


def write_report(
    out_dir: str | Path, name: str, result: dict[str, Any], bars: dict[str, float], ylabel: str, title: str
) -> dict[str, Any]:
    """``<out>/<name>.json`` and a bar chart ``<out>/<name>.png`` (the chart needs the ``plot`` extra)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=float))
    try:
        import matplotlib
    except ImportError:
        logging.getLogger(__name__).info(
            "%s.png skipped: matplotlib is not installed (pip install 'rollart[plot]')", name
        )
        result["files"] = [str(out / f"{name}.json")]
        return result
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(bars), list(bars.values()), color=["#999999", "#3b7dd8", "#58a55c", "#d8843b"][: len(bars)])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    for i, v in enumerate(bars.values()):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
    result["files"] = [str(out / f"{name}.json"), str(out / f"{name}.png")]
    return result


def add_common_arguments(p: argparse.ArgumentParser, out: str, time_scale: float = 0.05) -> None:
    p.add_argument(
        "--time-scale",
        type=float,
        default=time_scale,
        help="real seconds per simulated second (larger: less Ray call overhead relative to latencies)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out, help="output folder for JSON and PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")


class StochasticLatencyEnv:
    """A multi-turn env under the latency and failure model of ROLL Flash §5.2.2: each step takes
    ``N(mean, std)`` simulated seconds (clipped at 0); each episode is fail-slow with probability
    ``p_slow`` (every step ``slow_factor`` times longer) and fail-stop with probability ``p_stop`` (one
    step never returns; the EnvManager's step timeout ends it). Draws come from ``rng`` per episode."""

    tag = "Sim"
    max_new_tokens = 2

    def __init__(
        self,
        rng: Any,
        clock: ScaledClock,
        *,
        mean: float,
        std: float,
        turns: int,
        p_slow: float,
        slow_factor: float,
        p_stop: float,
    ):
        self.rng, self.clock = rng, clock
        self.mean, self.std, self.max_steps = mean, std, turns
        self.p_slow, self.slow_factor, self.p_stop = p_slow, slow_factor, p_stop
        self.t = 0
        self.factor = 1.0
        self.stop_at = -1

    async def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.t = 0
        self.factor = self.slow_factor if self.rng.random() < self.p_slow else 1.0
        self.stop_at = int(self.rng.integers(self.max_steps)) if self.rng.random() < self.p_stop else -1
        return "go:", {"seed": seed}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.t == self.stop_at:
            await asyncio.Event().wait()
        await self.clock.sleep(max(0.0, float(self.rng.normal(self.mean, self.std))) * self.factor)
        self.t += 1
        done = self.t >= self.max_steps
        return "ok:", float(done), done, False, {}


class SimVerifiableEnv:
    """A single-turn verifiable task: the response's reward is 1 with a per-prompt probability (drawn
    from ``Beta(a, b)`` by the prompt seed) and arrives after ``N(reward_mean, reward_std)`` simulated
    seconds — a reward model or sandbox answering as soon as the response ends. With ``member`` (the
    env's place in its group) an episode's draws come from its own generator, seeded by the prompt seed
    and the member: the same sample gets the same reward and reward time whatever order the episodes
    end in, so a run's outcome does not hang on the machine's timing."""

    tag = "Sim"
    max_steps = 1

    def __init__(
        self,
        clock: ScaledClock,
        rng: Any,
        *,
        max_new_tokens: int,
        reward_mean: float,
        reward_std: float,
        beta: tuple[float, float],
        member: int | None = None,
    ):
        self.clock, self.rng = clock, rng
        self.member = member
        self.max_new_tokens = max_new_tokens
        self.reward_mean, self.reward_std, self.beta = reward_mean, reward_std, beta
        self.p = 0.5

    async def reset(self, seed: int | None = None) -> tuple[str, dict]:
        import numpy as np

        self.p = float(np.random.default_rng(seed).beta(*self.beta))
        if self.member is not None and seed is not None:
            self.rng = np.random.default_rng((seed, self.member))
        return f"q{seed}:", {"seed": seed}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        await self.clock.sleep(max(0.0, float(self.rng.normal(self.reward_mean, self.reward_std))))
        return "", float(self.rng.random() < self.p), True, False, {}


def run_pipeline_once(cfg: Any, prepare: Callable[[Any], None] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Run the agentic pipeline of ``cfg`` to its end: (its step records, wall seconds). A local Ray the
    run started is shut down after it (a fresh one per run); one the caller started is left alone.
    ``prepare(pipeline)`` runs once the pipeline is built, before its steps (a bench's hooks)."""
    import time

    import ray

    from rollart.pipelines.agentic import AgenticPipeline

    own_ray = not ray.is_initialized()
    t0 = time.monotonic()
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        if prepare is not None:
            prepare(pipe)
        history = pipe.run()
    finally:
        pipe.shutdown()
        if own_ray:
            ray.shutdown()
    return list(history), time.monotonic() - t0
