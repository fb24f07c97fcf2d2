"""Single-turn verifiable tasks: the observation is the prompt, the action is the answer, and the only
step ends the episode with the reward of a pure verifier ``verify(response, ground_truth) -> float``
(the same function the reward service calls, so a trajectory scores the same in both places).

A prompt is a deterministic function of its seed: ``reset(s)`` gives the prompt of
``sample_prompts(n, seed=s)[0]``, and ``sample_prompts(n, seed)[i]`` is the prompt of seed ``seed + i``.
"""

from __future__ import annotations

import random
from typing import Any

from rollart.envs.base import EnvError, StepResult, TextEnv


class VerifiableTask(TextEnv):
    """Base of the single-turn tasks; subclasses give :meth:`make` and :meth:`verify`."""

    max_steps = 1

    def __init__(self, with_instructions: bool = False) -> None:
        self.with_instructions = with_instructions
        self.ground_truth: Any = None
        self.done = True

    def make(self, rng: random.Random) -> tuple[str, Any]:
        """``(prompt, ground_truth)`` drawn from ``rng``."""
        raise NotImplementedError

    @staticmethod
    def verify(response: str, ground_truth: Any) -> float:
        """Reward in [0, 1] of ``response`` against ``ground_truth``; never raises on bad responses."""
        raise NotImplementedError

    def char_rewards(self, response: str) -> list[float] | None:
        """Optional dense credit: one score per character of the response (None: none)."""
        return None

    def score(self, response: str) -> float:
        """This episode's reward for ``response``: :meth:`verify` against the ground truth (a task may
        add shaping of its own, e.g. ``reverse``'s ``format_credit``)."""
        return self.verify(response, self.ground_truth)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        prompt, self.ground_truth = self.make(random.Random(seed))
        self.done = False
        return (self.format_prompt(prompt) if self.with_instructions else prompt), {"ground_truth": self.ground_truth}

    def step(self, action: str) -> StepResult:
        if self.done:
            raise EnvError(f"{self.tag}: step() after the episode ended; call reset() first")
        self.done = True
        reward = self.score(action)
        info: dict[str, Any] = {"ground_truth": self.ground_truth, "response": action}
        dense = self.char_rewards(action)
        if dense is not None:
            info["char_rewards"] = dense
        return "", reward, True, False, info

    def sample_prompts(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """``n`` dataset rows ``{"prompt", "ground_truth", "tag"}``; row ``i`` is the prompt of seed ``seed + i``."""
        if n < 0:
            raise ValueError(f"sample_prompts: n must be >= 0, got {n}")
        rows = []
        for i in range(n):
            prompt, truth = self.make(random.Random(seed + i))
            rows.append(
                {
                    "prompt": self.format_prompt(prompt) if self.with_instructions else prompt,
                    "ground_truth": truth,
                    "tag": self.tag,
                }
            )
        return rows
