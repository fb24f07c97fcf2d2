"""Arithmetic word problems, generated offline from a seed: ``make_task(seed)`` gives the question and
its answer. Half ask for a sum (someone *gets* more), half for a difference (someone *gives away*
some): the words say which operation the calculator must run."""

from __future__ import annotations

import random

NAMES = ["Ann", "Bob", "Cid", "Dee", "Eva", "Fox", "Gus", "Ida"]
THINGS = ["apples", "books", "coins", "pens"]


def make_task(seed: int, low: int = 5, high: int = 9) -> dict:
    rng = random.Random(seed)
    a = rng.randint(low, high)
    b = rng.randint(1, a - 1)
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    if rng.random() < 0.5:
        question = f"{name} has {a} {thing} and gets {b} more. How many now?"
        return {"question": question, "expression": f"{a}+{b}", "answer": a + b}
    question = f"{name} has {a} {thing} and gives away {b}. How many now?"
    return {"question": question, "expression": f"{a}-{b}", "answer": a - b}
