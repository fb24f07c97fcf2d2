"""Built-in reward functions: ``fn(trajectory: dict) -> float`` (or a dict with ``score``).

A trajectory dict has ``prompt``, ``response``, ``ground_truth``, ``tag`` and ``metadata``. Serve any of
them with ``rollart serve rewards rollart.reward.builtin:math_answer ...``. The verifiers of the built-in
tasks (reverse, addition, countdown) are in :mod:`rollart.envs.rewards`.
"""

from rollart.reward.builtin.code import code_tests
from rollart.reward.builtin.judge import llm_judge
from rollart.reward.builtin.text import exact_match, math_answer

__all__ = ["code_tests", "exact_match", "llm_judge", "math_answer"]
