"""Built-in reward functions: ``fn(trajectory: dict) -> float`` (or a dict with ``score``).

A trajectory dict has ``prompt``, ``response``, ``ground_truth``, ``tag`` and ``metadata``. Serve any of
them with ``rollart serve rewards rollart.reward.builtin:math_answer ...``.
"""

from rollart.reward.builtin.code import code_tests
from rollart.reward.builtin.judge import llm_judge
from rollart.reward.builtin.text import addition, countdown, exact_match, math_answer, reverse

__all__ = ["addition", "code_tests", "countdown", "exact_match", "llm_judge", "math_answer", "reverse"]
