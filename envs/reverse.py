"""Reverse a string of ``length`` letters: ``"abc="`` → ``"cba"`` (``reverse-3`` is the quickstart task).

Reward (:meth:`ReverseTask.verify`): the number of answer positions right, divided by the longer of
the answer and the (stripped) response, so extra characters cost as much as missing ones; 1.0 only for
the exact answer, and a random answer scores near 0. Dense credit (:meth:`ReverseTask.char_rewards`):
1 for each response character in its right place, 0 otherwise. ``format_credit`` (default 0) shapes
the episode's reward: that share for a well-formed answer (``length`` characters of ``letters``), the
rest for :meth:`ReverseTask.verify`; with ``length: 1, format_credit: 0.5`` a random tiny model scores
~0.04 and learns the well-formed half within a few steps.
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping
from typing import Any, ClassVar

from rollart.envs.base import check_positive, register_env
from rollart.envs.single_turn import VerifiableTask


@register_env("reverse")
class ReverseTask(VerifiableTask):
    tag: ClassVar[str] = "reverse"
    inline_methods = frozenset({"reset", "step"})  # quick pure Python
    kwarg_limits: ClassVar[dict[str, tuple[float, float]]] = {"length": (1, 4096)}
    instructions: ClassVar[str] = "Reverse the letters before '=' and write them after it, e.g. abc=cba."

    def __init__(
        self,
        length: int = 3,
        letters: str = string.ascii_lowercase,
        with_instructions: bool = False,
        format_credit: float = 0.0,
    ):
        super().__init__(with_instructions)
        check_positive("reverse", length=length)
        if not 0.0 <= format_credit <= 1.0:
            raise ValueError(
                f"reverse: format_credit must be between 0 and 1 (a share of the reward), got {format_credit}"
            )
        self.format_credit = format_credit
        if not letters or "=" in letters:
            raise ValueError(f"reverse: letters must be a non-empty string without '=', got {letters!r}")
        self.length, self.letters = length, letters
        self.max_new_tokens = length  # the answer has exactly ``length`` characters
        # the tag the class declares (a subclass's tag_for too): the config reads it without building one
        self.tag = self.tag_for(  # type: ignore[misc]
            dict(length=length, letters=letters, with_instructions=with_instructions, format_credit=format_credit)
        )

    @classmethod
    def tag_for(cls, kwargs: Mapping[str, Any]) -> str:
        """``reverse-{length}`` (``reverse-3`` is the quickstart task)."""
        return f"reverse-{kwargs['length']}"

    def make(self, rng: random.Random) -> tuple[str, str]:
        word = "".join(rng.choice(self.letters) for _ in range(self.length))
        return f"{word}=", word[::-1]

    def char_rewards(self, response: str) -> list[float]:
        gt = self.ground_truth or ""
        return [float(i < len(gt) and c == gt[i]) for i, c in enumerate(response)]

    def score(self, response: str) -> float:
        accuracy = self.verify(response, self.ground_truth or "")
        if not self.format_credit:
            return accuracy
        answer = response.strip()
        well_formed = len(answer) == self.length and all(c in self.letters for c in answer)
        return self.format_credit * well_formed + (1.0 - self.format_credit) * accuracy

    @staticmethod
    def verify(response: str, ground_truth: str) -> float:
        response = response.strip()
        if not ground_truth:
            return float(response == "")
        right = sum(a == b for a, b in zip(response, ground_truth))
        return right / max(len(ground_truth), len(response))
