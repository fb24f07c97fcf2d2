"""Arithmetic word problems, generated offline from a seed: ``make_task(seed)`` gives the question, the
values of its quantities and the answer. Half ask for a sum (someone *gets* more), half for a
difference (someone *gives* some away): the words say which operation the calculator must run. The
question names its two quantities ``a`` and ``b``, which the calculator knows."""

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
        question = f"{name} has a={a} {thing}, gets b={b} more. How many now?"
        return {"question": question, "values": {"a": a, "b": b}, "expression": "a+b", "answer": a + b}
    question = f"{name} has a={a} {thing}, gives b={b} away. How many now?"
    return {"question": question, "values": {"a": a, "b": b}, "expression": "a-b", "answer": a - b}
