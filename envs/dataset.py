"""A single-turn env over a prompt dataset (``data:`` tasks, :mod:`rollart.data`): ``reset(seed)``
shows the prompt of the row its sampler picks for that seed, ``step(completion)`` ends the episode with
the verifier's reward (a verifier that raises fails the trajectory; it is never scored 0)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollart.data.prompts import PromptSet
from rollart.data.sampler import EpochSampler
from rollart.envs.base import EnvError, StepResult, TextEnv


class DatasetEnv(TextEnv):
    """Plays row ``sampler.index(position_of(seed))`` of ``prompts``. ``position_of`` defaults to the
    seed itself (eval: seed ``i`` is row ``i`` with an unshuffled sampler)."""

    max_steps = 1

    def __init__(
        self,
        prompts: PromptSet,
        sampler: EpochSampler,
        *,
        position_of: Callable[[int], int] | None = None,
        max_new_tokens: int = 32,
    ):
        self.prompts, self.sampler = prompts, sampler
        self.position_of = position_of or (lambda seed: seed)
        self.tag = prompts.tag  # type: ignore[misc]
        self.max_new_tokens = max_new_tokens
        self.current: dict[str, Any] | None = None
        # picking the row is quick; scoring it is the verifier's, quick by the task's word only
        self.inline_methods = frozenset({"reset", "step"} if prompts.inline_verifier else {"reset"})

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if seed is None:
            raise EnvError(f"{self.tag}: a dataset env needs a reset seed (it picks the prompt)")
        position = self.position_of(seed)
        index = self.sampler.index(position)
        row = self.prompts.row(index)
        self.current = row
        info = {
            "ground_truth": row[self.prompts.answer_key],
            "index": index,
            "position": position,
            "epoch": position // self.sampler.size,
        }
        return self.prompts.prompt(row), info

    def step(self, action: str) -> StepResult:
        row = self.current
        if row is None:
            raise EnvError(f"{self.tag}: step() after the episode ended; call reset() first")
        reward = self.prompts.score(action, row)
        self.current = None
        return "", reward, True, False, {"ground_truth": row[self.prompts.answer_key], "response": action}
