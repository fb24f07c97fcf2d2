"""Answer checkers over text."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _as_number(text: str) -> Fraction | None:
    t = text.strip().replace(",", "").replace("$", "")
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", t)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2)))
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> str | None:
    """``\\boxed{...}`` if present, else the last number in the text."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def math_answer(trajectory: dict[str, Any]) -> float:
    """1.0 if the final answer equals ``ground_truth`` numerically (fractions and decimals compared
    exactly: ``1/2 == 0.5``), else string equality after trimming; 0.0 otherwise."""
    answer = extract_answer(trajectory["response"])
    if answer is None:
        return 0.0
    truth = str(trajectory["ground_truth"])
    a, b = _as_number(answer), _as_number(truth)
    if a is not None and b is not None:
        return float(a == b)
    return float(answer.strip() == truth.strip())


def exact_match(trajectory: dict[str, Any]) -> float:
    return float(trajectory["response"].strip() == str(trajectory["ground_truth"]).strip())
