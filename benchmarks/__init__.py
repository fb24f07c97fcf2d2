"""The benchmarks behind ``rollart bench``, and their registry.

Each bench is a module of this package with ``add_arguments(parser)`` and ``run(args) -> dict`` (see
:class:`Bench`). :data:`BENCHES` names them; :func:`load_bench` imports one (benches import torch and
Ray, so only the one that runs is imported) and :func:`bench_summary` reads a bench's first docstring
line without importing it. Importing this package imports no bench.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from typing import Any, Protocol, cast

# bench name -> its module in this package
BENCHES: dict[str, str] = {
    "reward-service": "reward_service",
    "shared-reward": "shared_reward",
    "engine": "engine_throughput",
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


def bench_summary(name: str) -> str | None:
    """The first docstring line of bench ``name``, read from its source without importing it."""
    try:
        spec = importlib.util.find_spec(bench_module(name))
    except ImportError:
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    return doc.strip().splitlines()[0] if doc else None
