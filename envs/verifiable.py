"""Single-turn verifiable tasks: reverse a string, add two numbers, countdown.

Each is one step: the observation is the prompt, the action is the answer, the reward comes from a
pure verifier ``verify(response, ground_truth) -> float`` (also used by the reward service). Prompts
are deterministic functions of the seed; ``sample_prompts(n, seed)`` gives the same prompts as a
dataset for RLVR pipelines.
"""

from __future__ import annotations

import ast
import operator
import random
import string
from typing import Any, ClassVar

from envs.base import TextEnv, register_env


class VerifiableTask(TextEnv):
    max_steps = 1

    def __init__(self) -> None:
        self.ground_truth: Any = None

    def make(self, rng: random.Random) -> tuple[str, Any]:
        raise NotImplementedError

    @staticmethod
    def verify(response: str, ground_truth: Any) -> float:
        raise NotImplementedError

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        prompt, self.ground_truth = self.make(random.Random(seed))
        return prompt, {"ground_truth": self.ground_truth}

    def char_rewards(self, response: str) -> list[float] | None:
        """Optional dense credit: one score per character of the response (None: none)."""
        return None

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        reward = self.verify(action, self.ground_truth)
        info: dict[str, Any] = {"ground_truth": self.ground_truth, "response": action}
        dense = self.char_rewards(action)
        if dense is not None:
            info["char_rewards"] = dense
        return "", reward, True, False, info

    def sample_prompts(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return [dict(zip(("prompt", "ground_truth"), self.make(random.Random(seed + i))), tag=self.tag)
                for i in range(n)]


@register_env("reverse")
class ReverseTask(VerifiableTask):
    """``"abc="`` → ``"cba"``. Reward: the fraction of answer positions right, over the longer of the
    answer and the response (extra characters cost as much as missing ones): 1.0 only for an exact
    answer, and a random answer scores near 0."""

    tag: ClassVar[str] = "reverse"

    def __init__(self, length: int = 3, letters: str = string.ascii_lowercase):
        super().__init__()
        self.length, self.letters = length, letters
        self.max_new_tokens = length  # the answer has exactly ``length`` characters
        self.tag = f"reverse-{length}"  # type: ignore[misc]

    def make(self, rng: random.Random) -> tuple[str, str]:
        word = "".join(rng.choice(self.letters) for _ in range(self.length))
        return f"{word}=", word[::-1]

    def char_rewards(self, response: str) -> list[float]:
        """1 for each character in its right place, 0 otherwise (the per-position terms of ``verify``)."""
        gt = self.ground_truth or ""
        return [float(i < len(gt) and c == gt[i]) for i, c in enumerate(response)]

    @staticmethod
    def verify(response: str, ground_truth: str) -> float:
        response = response.strip()
        if not ground_truth:
            return float(response == "")
        right = sum(a == b for a, b in zip(response, ground_truth))
        return right / max(len(ground_truth), len(response))


@register_env("addition")
class AdditionTask(VerifiableTask):
    """``"12+34="`` → ``"46"``; reward 1 for the exact sum, else 0."""

    tag: ClassVar[str] = "addition"

    def __init__(self, digits: int = 2):
        super().__init__()
        self.digits = digits
        self.max_new_tokens = digits + 2

    def make(self, rng: random.Random) -> tuple[str, int]:
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return f"{a}+{b}=", a + b

    @staticmethod
    def verify(response: str, ground_truth: int) -> float:
        try:
            return float(int(response.strip()) == int(ground_truth))
        except ValueError:
            return 0.0


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST, used: list[int]) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        used.append(node.value)
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError
        return _OPS[type(node.op)](left, right)
    raise ValueError("only integers and + - * / are allowed")


@register_env("countdown")
class CountdownTask(VerifiableTask):
    """Numbers and a target: answer an arithmetic expression using each number at most once.
    Parsed with ``ast`` (never ``eval``); reward 1 if it hits the target exactly."""

    tag: ClassVar[str] = "countdown"

    def __init__(self, count: int = 3, max_number: int = 20):
        super().__init__()
        self.count, self.max_number = count, max_number
        self.max_new_tokens = 16

    def make(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        nums = [rng.randint(1, self.max_number) for _ in range(self.count)]
        a, b = rng.sample(nums, 2)
        target = a + b if rng.random() < 0.5 else a * b
        return f"{' '.join(map(str, nums))}->{target}:", {"numbers": nums, "target": target}

    @staticmethod
    def verify(response: str, ground_truth: dict[str, Any]) -> float:
        try:
            tree = ast.parse(response.strip(), mode="eval")
            used: list[int] = []
            value = _evaluate(tree, used)
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
            return 0.0
        pool = list(ground_truth["numbers"])
        for n in used:
            if n not in pool:
                return 0.0
            pool.remove(n)
        return float(abs(value - ground_truth["target"]) < 1e-9)
