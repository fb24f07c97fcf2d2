"""Arithmetic word problems, generated offline from a seed: ``make_task(seed)`` gives the question and
its answer. Half ask for a sum (someone *gets* more), half for a difference (someone *gives* some
away): the words say which operation the calculator must run. Names, things and numbers have fixed
widths, so a small model finds the numbers at the same places in every question."""

from __future__ import annotations

import random

NAMES = ["Ann", "Bob", "Cid", "Dee", "Eva", "Fox", "Gus", "Ida"]
THINGS = ["pens", "cups", "hats", "keys"]


def make_task(seed: int) -> dict:
    rng = random.Random(seed)
    a = rng.randint(5, 9)
    b = rng.randint(1, a - 1)
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    if rng.random() < 0.5:
        return {
            "question": f"{name} has {a} {thing}, gets {b} more. How many now?",
            "expression": f"{a}+{b}",
            "answer": a + b,
        }
    return {
        "question": f"{name} has {a} {thing}, gives {b} away. How many now?",
        "expression": f"{a}-{b}",
        "answer": a - b,
    }
