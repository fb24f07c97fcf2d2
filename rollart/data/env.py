"""A single-turn env over a prompt dataset: ``reset(seed)`` shows the prompt of the row the sampler
picks for that seed, ``step(completion)`` ends the episode with the verifier's reward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollart.data.sampler import EpochSampler
from rollart.data.verifiers import Verifier, call_verifier
from rollart.envs.base import EnvError, StepResult, TextEnv


class PromptSet:
    """A loaded dataset with its prompt/answer columns, system prompt and verifier (shared, read-only)."""

    def __init__(
        self,
        rows: Any,
        *,
        tag: str,
        verifier: Verifier,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str | None = None,
        source: str = "",
    ):
        self.rows, self.tag, self.verifier = rows, tag, verifier
        self.prompt_key, self.answer_key, self.system_prompt = prompt_key, answer_key, system_prompt
        self.source = source

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> dict[str, Any]:
        return dict(self.rows[index])

    def prompt(self, row: dict[str, Any]) -> str:
        text = str(row[self.prompt_key])
        return f"{self.system_prompt}\n{text}" if self.system_prompt else text

    def score(self, completion: str, row: dict[str, Any]) -> float:
        return call_verifier(self.verifier, completion, row[self.answer_key], row, self.answer_key)


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
        reward = self.prompts.score(action, row)  # a verifier error fails the trajectory, never scores 0
        self.current = None
        return "", reward, True, False, {"ground_truth": row[self.prompts.answer_key], "response": action}
