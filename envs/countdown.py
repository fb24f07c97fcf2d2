"""Countdown: reach a target with some of the given numbers and ``+ - * /``: ``"3 4 5->12:"`` → ``"3*4"``.

Prompts: ``count`` numbers in ``[1, max_number]``; the target is the value of a random expression over
2 to ``count`` of them (exact integer division only, positive result), so every prompt has an answer
(kept as ``ground_truth["solution"]``).

Reward (:meth:`CountdownTask.verify`): 1 when the answer (the content of ``<answer>…</answer>`` if
present) is an arithmetic expression of integer literals, ``+ - * /`` and parentheses that uses each
given number at most once (as many times as it is given) and equals the target exactly (rational
arithmetic); an optional ``=value`` after it must equal the target too. Anything else (other syntax,
names, calls, a number not given or reused, division by zero) scores 0. The answer is parsed with
``ast`` and evaluated by walking the tree, never with ``eval``.
"""

from __future__ import annotations

import ast
import operator
import random
from fractions import Fraction
from typing import Any, ClassVar

from rollart.envs.actions import answer_text
from rollart.envs.base import check_positive, register_env
from rollart.envs.single_turn import VerifiableTask

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_ANSWER_CHARS = 512


def evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an expression tree of int literals and ``+ - * /``; appends each literal to
    ``used``. Raises ``ValueError`` on anything else and ``ZeroDivisionError`` on division by zero."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = evaluate(node.left, used), evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"only integers and + - * / are allowed, found {type(node).__name__}")


@register_env("countdown")
class CountdownTask(VerifiableTask):
    tag: ClassVar[str] = "countdown"
    inline_methods = frozenset({"reset", "step"})  # quick pure Python
    kwarg_limits: ClassVar[dict[str, tuple[float, float]]] = {"count": (2, 12), "max_number": (1, 10**6)}
    instructions: ClassVar[str] = (
        "Use the numbers before '->', each at most once, with + - * / and parentheses "
        "to make the number after it; answer with the expression, e.g. 3 4 5->12:3*4."
    )

    def __init__(self, count: int = 3, max_number: int = 20, with_instructions: bool = False):
        super().__init__(with_instructions)
        check_positive("countdown", max_number=max_number)
        if count < 2:
            raise ValueError(f"countdown: count must be >= 2 (an expression needs two numbers), got {count!r}")
        self.count, self.max_number = count, max_number
        self.max_new_tokens = 16

    def make(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        nums = [rng.randint(1, self.max_number) for _ in range(self.count)]
        while True:
            picked = rng.sample(nums, rng.randint(2, self.count))
            expr, value = str(picked[0]), Fraction(picked[0])
            for n in picked[1:]:
                op = rng.choice("+-*/")
                if op == "/" and value % n != 0:
                    op = "+"
                expr = f"({expr}){op}{n}" if op in "*/" and not expr.isdigit() else f"{expr}{op}{n}"
                value = _OPS[{"+": ast.Add, "-": ast.Sub, "*": ast.Mult, "/": ast.Div}[op]](value, Fraction(n))
            if value > 0 and value.denominator == 1:
                break
        target = int(value)
        return f"{' '.join(map(str, nums))}->{target}:", {"numbers": nums, "target": target, "solution": expr}

    @staticmethod
    def verify(response: str, ground_truth: dict[str, Any]) -> float:
        text = answer_text(response)
        if len(text) > _MAX_ANSWER_CHARS:
            return 0.0
        expr, _, claimed = text.partition("=")
        target = Fraction(int(ground_truth["target"]))
        try:
            used: list[int] = []
            value = evaluate(ast.parse(expr.strip(), mode="eval"), used)
            if claimed.strip() and Fraction(int(claimed.strip())) != target:
                return 0.0
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
            return 0.0
        pool = list(ground_truth["numbers"])
        for n in used:
            if n not in pool:
                return 0.0
            pool.remove(n)
        return float(value == target)
