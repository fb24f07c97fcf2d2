"""The benchmarks behind ``rollart bench``, and their registry.

Each bench is a module of this package with ``add_arguments(parser)`` and ``run(args) -> dict`` (see
:class:`Bench`). :data:`BENCHES` names them; :func:`load_bench` imports one (benches import torch and
Ray, so only the one that runs is imported) and :func:`bench_summary` gives a bench's one-line summary
without importing it. Importing this package imports no bench.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any, Protocol, cast

# bench name -> its module in this package
BENCHES: dict[str, str] = {
    "reward-service": "reward_service",
    "shared-reward": "shared_reward",
    "engine": "engine_throughput",
    "train-step": "train_step",
    "env-async": "env_async",
    "redundant-env": "redundant_env",
    "env-service": "env_service",
    "queue-scheduling": "queue_scheduling",
    "affinity": "affinity",
    "prompt-replication": "prompt_replication",
    "async-train": "async_train",
    "weight-sync": "weight_sync",
    "quickstart": "quickstart",
    "throughput": "throughput",
    "chaos": "chaos",
    "soak": "soak",
}


# one complete line per bench for `rollart bench --help` (the modules' docstrings run over several lines)
SUMMARIES: dict[str, str] = {
    "reward-service": "the reward service's requests/s and latency next to an in-process call",
    "shared-reward": "three jobs sharing one reward service against a dedicated service each",
    "engine": "the built-in torch engine's tokens/s against Hugging Face generate",
    "env-async": "trajectory-level against batch-level environment interaction",
    "redundant-env": "more env groups and bigger groups than the batch needs, under failing envs",
    "env-service": "env calls over the session protocol under injected failures, with redundant groups",
    "queue-scheduling": "queue scheduling with dynamic filtering against batch rollout",
    "affinity": "a prefill-heavy and a decode-heavy task on H800 / H20 pools of the same cost",
    "prompt-replication": "a prompt's samples as independent requests against one n-sample request",
    "async-train": "asynchronous (alpha 1, 2) against synchronous step time on the real pipeline",
    "weight-sync": "Mooncake background publish/fetch against a blocking weight transfer",
    "quickstart": "the quickstart config once per seed: steps to a reward of 0.9",
    "throughput": "samples/s of generation and training on reverse-3, optionally beside TRL",
    "chaos": "a run on three namespace hosts under a seeded schedule of faults (needs root)",
    "soak": "the chaos run for many minutes with random faults, sampling memory (needs root)",
}


class Bench(Protocol):
    """What a bench module provides."""

    __doc__: str | None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> dict[str, Any]: ...


def bench_module(name: str) -> str:
    """The full module name of bench ``name``; ``KeyError`` for an unknown one."""
    return f"{__name__}.{BENCHES[name]}"


def load_bench(name: str) -> Bench:
    """Import bench ``name`` (its ``ImportError`` propagates: a bench may need an optional extra)."""
    return cast(Bench, importlib.import_module(bench_module(name)))


def bench_summary(name: str) -> str:
    """The one-line summary of bench ``name`` (``rollart bench --help``); ``KeyError`` for an unknown one."""
    return SUMMARIES[name]
