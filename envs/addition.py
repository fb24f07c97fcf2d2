"""Add two numbers of at most ``digits`` digits: ``"12+34="`` → ``"46"``.

Reward (:meth:`AdditionTask.verify`): 1 when the answer (the content of ``<answer>…</answer>`` if
present, stripped, one trailing ``.`` allowed) is the sum written in ASCII digits with an optional
sign, else 0.
"""

from __future__ import annotations

import random
import re
from typing import ClassVar

from rollart.envs.actions import answer_text
from rollart.envs.base import check_positive, register_env
from rollart.envs.single_turn import VerifiableTask

_INT = re.compile(r"[+-]?[0-9]+")


@register_env("addition")
class AdditionTask(VerifiableTask):
    tag: ClassVar[str] = "addition"
    inline_methods = frozenset({"reset", "step"})  # quick pure Python
    kwarg_limits: ClassVar[dict[str, tuple[float, float]]] = {"digits": (1, 1000)}
    instructions: ClassVar[str] = "Add the two numbers and write the sum after '=', e.g. 12+34=46."

    def __init__(self, digits: int = 2, with_instructions: bool = False):
        super().__init__(with_instructions)
        check_positive("addition", digits=digits)
        self.digits = digits
        self.max_new_tokens = digits + 2

    def make(self, rng: random.Random) -> tuple[str, int]:
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return f"{a}+{b}=", a + b

    @staticmethod
    def verify(response: str, ground_truth: int | str) -> float:
        text = answer_text(response).removesuffix(".").strip()
        return float(_INT.fullmatch(text) is not None and int(text) == int(ground_truth))
