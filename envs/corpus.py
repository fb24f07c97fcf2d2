"""Text for training the tiny tokenizer: what the built-in envs show and what an agent answers.

``task_corpus(n, seed)`` starts with the instructions of every env, one line of every letter, digit
and symbol the envs use, and the "invalid action" observations; then ``n`` samples drawn in turn from
``reverse`` (lengths 1-8) prompt+answer, ``addition`` prompt+sum, ``countdown`` prompt+solution, and
FrozenLake and Sokoban episodes (reset rendering, a move word, the next rendering). Deterministic in
``seed``.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from rollart.envs.addition import AdditionTask
from rollart.envs.countdown import CountdownTask
from rollart.envs.frozen_lake import WORDS, FrozenLake
from rollart.envs.reverse import ReverseTask
from rollart.envs.sokoban import Sokoban

SYMBOLS = "#_OX√PSFHG=+-*/()<>:;.,'?! \n"


def _reverse(rng: random.Random) -> str:
    prompt, answer = ReverseTask(length=rng.randint(1, 8)).make(rng)
    return prompt + answer


def _addition(rng: random.Random) -> str:
    prompt, answer = AdditionTask(digits=rng.randint(1, 3)).make(rng)
    return f"{prompt}{answer}"


def _countdown(rng: random.Random) -> str:
    prompt, truth = CountdownTask(count=rng.randint(2, 4)).make(rng)
    return prompt + truth["solution"]


def _grid_episode(env: FrozenLake | Sokoban, rng: random.Random) -> str:
    obs, _ = env.reset(rng.randrange(2**31))
    move = rng.choice("LDRU")
    text = rng.choice([move, WORDS[move]])
    nxt = env.step(text)[0]
    return f"{obs}{text}\n{nxt}"


def task_corpus(n: int, seed: int = 0) -> list[str]:
    """The fixed header lines followed by ``n`` generated samples (module docstring)."""
    if n < 0:
        raise ValueError(f"task_corpus: n must be >= 0, got {n}")
    rng = random.Random(seed)
    lake, sokoban = FrozenLake(size=4), Sokoban(size=6, boxes=2, pulls=4)
    header = [
        string.ascii_lowercase,
        string.ascii_uppercase,
        string.digits,
        SYMBOLS,
        FrozenLake.instructions,
        Sokoban.instructions,
        ReverseTask.instructions,
        AdditionTask.instructions,
        CountdownTask.instructions,
        "invalid action; move:",
        "invalid action; push:",
    ]
    makers: list[Callable[[random.Random], str]] = [
        _reverse,
        _addition,
        _countdown,
        lambda r: _grid_episode(lake, r),
        lambda r: _grid_episode(sokoban, r),
    ]
    return header + [makers[i % len(makers)](rng) for i in range(n)]
