"""The benchmarks behind ``rollart bench``, and their registry.

Each bench is a module of this package with ``add_arguments(parser)`` and ``run(args) -> dict`` (see
:class:`Bench`). :data:`BENCHES` names them; :func:`load_bench` imports one (benches import torch and
Ray, so only the one that runs is imported) and :func:`bench_summary` gives a bench's one-line summary
without importing it. Importing this package imports no bench.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any, Protocol, cast


@dataclass(frozen=True)
class BenchEntry:
    """A bench of ``rollart bench``: its module in this package and a complete one-line summary for
    ``rollart bench --help`` (the modules' docstrings run over several lines)."""

    module: str
    summary: str


BENCHES: dict[str, BenchEntry] = {
    "reward-service": BenchEntry(
        "reward_service", "the reward service's requests/s and latency next to an in-process call"
    ),
    "shared-reward": BenchEntry(
        "shared_reward", "three jobs sharing one reward service against a dedicated service each"
    ),
    "engine": BenchEntry(
        "engine_throughput",
        "decode tokens/s of the torch engine against Hugging Face generate; at a real shape, its roofline fraction",
    ),
    "train-step": BenchEntry(
        "train_step", "the training step's tokens/s and MFU of the torch strategy, at the tiny model or a real shape"
    ),
    "train-memory": BenchEntry(
        "train_memory",
        "per-rank memory and tokens/s of DDP, FSDP, FSDP with CPU offload and tensor parallelism at 1, 2, 4 ranks",
    ),
    "env-async": BenchEntry("env_async", "trajectory-level against batch-level environment interaction"),
    "redundant-env": BenchEntry(
        "redundant_env", "more env groups and bigger groups than the batch needs, under failing envs"
    ),
    "env-service": BenchEntry(
        "env_service", "env calls over the session protocol under injected failures, with redundant groups"
    ),
    "queue-scheduling": BenchEntry("queue_scheduling", "queue scheduling with dynamic filtering against batch rollout"),
    "affinity": BenchEntry("affinity", "a prefill-heavy and a decode-heavy task on H800 / H20 pools of the same cost"),
    "prompt-replication": BenchEntry(
        "prompt_replication", "a prompt's samples as independent requests against one n-sample request"
    ),
    "async-train": BenchEntry(
        "async_train", "asynchronous (alpha 1, 2) against synchronous step time on the real pipeline"
    ),
    "weight-sync": BenchEntry("weight_sync", "Mooncake background publish/fetch against a blocking weight transfer"),
    "quickstart": BenchEntry("quickstart", "the quickstart config once per seed: steps to a reward of 0.9"),
    "startup": BenchEntry(
        "startup", "rollart run to its first trained step, in phases (Ray, workers, model load, first rollout)"
    ),
    "throughput": BenchEntry("throughput", "samples/s of generation and training on reverse-3, optionally beside TRL"),
    "chaos": BenchEntry("chaos", "a run on three namespace hosts under a seeded schedule of faults (needs root)"),
    "elastic": BenchEntry(
        "elastic", "rollout tokens/s over time as a host joins a running job and is drained (needs root)"
    ),
    "autopilot": BenchEntry(
        "autopilot", "a job that sizes its own rollout pool against each fixed size; a second job queues (needs root)"
    ),
    "soak": BenchEntry("soak", "the chaos run for many minutes with random faults, sampling memory (needs root)"),
    "traces": BenchEntry(
        "traces", "the step time with trajectory traces on against off, in alternating blocks of one run"
    ),
    "agent-endpoint": BenchEntry(
        "agent_endpoint", "the OpenAI-compatible endpoint's calls/s and added latency against a direct LLMProxy call"
    ),
    "history": BenchEntry("history", "the ratios the benches report, recorded per commit, with drops flagged"),
}


class Bench(Protocol):
    """What a bench module provides."""

    __doc__: str | None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> dict[str, Any]: ...


def bench_module(name: str) -> str:
    """The full module name of bench ``name``; ``KeyError`` for an unknown one."""
    return f"{__name__}.{BENCHES[name].module}"


def load_bench(name: str) -> Bench:
    """Import bench ``name`` (its ``ImportError`` propagates: a bench may need an optional extra)."""
    return cast(Bench, importlib.import_module(bench_module(name)))


def bench_summary(name: str) -> str:
    """The one-line summary of bench ``name`` (``rollart bench --help``); ``KeyError`` for an unknown one."""
    return BENCHES[name].summary
