"""The single-turn verifiable tasks (``reverse``, ``addition``, ``countdown``) and name-based access
for RLVR pipelines and the reward service, which need prompts and verifiers without an env instance:
``sample_prompts(name, n, seed, **kwargs)`` and ``verify(name, response, ground_truth)``.
"""

from __future__ import annotations

from typing import Any

from rollart.envs.addition import AdditionTask
from rollart.envs.countdown import CountdownTask
from rollart.envs.reverse import ReverseTask
from rollart.envs.single_turn import VerifiableTask

TASKS: dict[str, type[VerifiableTask]] = {"reverse": ReverseTask, "addition": AdditionTask, "countdown": CountdownTask}


def _task(name: str) -> type[VerifiableTask]:
    if name not in TASKS:
        raise ValueError(f"verifiable task {name!r} is unknown; known: {sorted(TASKS)}")
    return TASKS[name]


def sample_prompts(name: str, n: int, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt", "ground_truth", "tag"}`` of task ``name`` built with ``kwargs``."""
    return _task(name)(**kwargs).sample_prompts(n, seed)


def verify(name: str, response: str, ground_truth: Any) -> float:
    """The reward of ``response`` under task ``name``'s pure verifier."""
    return _task(name).verify(response, ground_truth)


__all__ = ["TASKS", "AdditionTask", "CountdownTask", "ReverseTask", "VerifiableTask", "sample_prompts", "verify"]
