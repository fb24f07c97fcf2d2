"""Held-out evaluation with the current policy: ``samples_per_prompt`` episodes per prompt of every eval
set, run by EnvManagers through the pipeline's LLMProxy (the same inference workers as training), at
the eval temperature. Metrics: ``accuracy`` (fraction of samples with reward >= the success threshold),
``mean_reward`` and the unbiased ``pass@k`` (Chen et al. 2021: per prompt with ``n`` samples of which
``c`` are correct, ``1 - C(n-c, k) / C(n, k)``, averaged over prompts), overall and per tag."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from math import comb
from typing import Any

from rollart.data.config import EvalConfig
from rollart.engines.base import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EvalSet:
    """One held-out set: ``make_env()`` gives a fresh env per episode; ``seeds`` are its prompts' reset seeds."""

    tag: str
    make_env: Callable[[], Any]
    seeds: list[int]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn without replacement from ``n`` samples,
    ``c`` of them correct, is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarise(rewards_by_prompt: list[list[float]], ks: list[int], threshold: float) -> dict[str, float | int]:
    """Metrics of one set of prompts, each a list of its samples' rewards. pass@k averages over the
    prompts with at least ``k`` samples."""
    flat = [r for rs in rewards_by_prompt for r in rs]
    out: dict[str, float | int] = {
        "accuracy": sum(r >= threshold for r in flat) / len(flat) if flat else 0.0,
        "mean_reward": sum(flat) / len(flat) if flat else 0.0,
        "prompts": len(rewards_by_prompt),
        "samples": len(flat),
    }
    for k in ks:
        vals = [pass_at_k(len(rs), sum(r >= threshold for r in rs), k) for rs in rewards_by_prompt if len(rs) >= k]
        out[f"pass@{k}"] = sum(vals) / len(vals) if vals else 0.0
    return out


class Evaluator:
    """Runs every eval set on the proxy; ``manager_fn(env, sampling)`` builds the EnvManager of one
    episode (the pipeline's: same proxy, codec, reward function and fault handling as training)."""

    def __init__(
        self,
        cfg: EvalConfig,
        sets: list[EvalSet],
        manager_fn: Callable[[Any, SamplingParams], Any],
        sampling: SamplingParams,
    ):
        self.cfg, self.sets, self.manager_fn = cfg, sets, manager_fn
        self.sampling = sampling.model_copy(update={"temperature": cfg.temperature})

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate after ``step``: every ``every`` steps and after the last one."""
        return (step + 1) % self.cfg.every == 0 or step == last_step

    async def run(self, step: int) -> dict[str, Any]:
        t0 = time.monotonic()
        gate = asyncio.Semaphore(self.cfg.concurrency)
        failed = 0

        async def episode(s: EvalSet, i: int, j: int, seed: int) -> tuple[str, int, float | None]:
            async with gate:
                env = s.make_env()
                try:
                    mgr = self.manager_fn(env, self.sampling)
                    traj = await mgr.run(seed, f"eval:{s.tag}:{i}", f"eval:{step}:{s.tag}:{i}:{j}")
                finally:
                    env.close()
            if traj.status != "ok" or traj.reward is None:
                log.warning("eval %s prompt %d sample %d: %s %s", s.tag, i, j, traj.status, traj.error or "")
                return s.tag, i, None
            return s.tag, i, float(traj.reward)

        jobs = [
            episode(s, i, j, seed)
            for s in self.sets
            for i, seed in enumerate(s.seeds)
            for j in range(self.cfg.samples_per_prompt)
        ]
        by_tag: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for tag, i, reward in await asyncio.gather(*jobs):
            if reward is None:
                failed += 1
            else:
                by_tag[tag][i].append(reward)
        ks, thr = self.cfg.ks, self.cfg.success_threshold
        everything = [rs for prompts in by_tag.values() for rs in prompts.values()]
        out: dict[str, Any] = summarise(everything, ks, thr)
        out["failed"] = failed
        out["by_tag"] = {tag: summarise(list(p.values()), ks, thr) for tag, p in sorted(by_tag.items())}
        out["time_s"] = time.monotonic() - t0
        return out
