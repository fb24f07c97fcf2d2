"""The task of the throughput comparison (issue #17): reverse-3 in chat form, ``Reverse: abc`` → ``cba``.

Standard library only: the TRL side of ``rollart bench throughput --trl`` imports this file from its
own virtual environment, where rollart is not installed, so both frameworks score with the very same
function on the very same prompts.

Reward (:func:`score`): 1 for the exact answer, else 0.8 · (letters in place) / 3 + 0.1 · (the model
stopped after 3 characters). The completion is the decoded text without special tokens, so a model
that closed its turn right after three letters has a completion of length 3.
"""

from __future__ import annotations

import random
import string
from typing import Any

LENGTH = 3
PROMPT = "Reverse: {word}"


def make_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt", "answer"}`` of random lowercase words of :data:`LENGTH` letters."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(LENGTH))
        rows.append({"prompt": PROMPT.format(word=word), "answer": word[::-1]})
    return rows


def score(completion: str, answer: Any, **row: Any) -> float:
    """1.0 for the exact answer; else 0.8 · letters in place / 3 + 0.1 · (stopped after 3 characters)."""
    answer = str(answer)
    if completion.strip() == answer:
        return 1.0
    in_place = sum(a == b for a, b in zip(completion, answer))
    return 0.8 * in_place / len(answer) + 0.1 * float(len(completion) == len(answer))
