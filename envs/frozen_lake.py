"""FrozenLake as a text grid: walk from the start ``S`` to the goal ``G`` without falling into a hole ``H``.

Maps are generated from the reset seed: each cell is a hole with probability ``hole_prob``, start and
goal are two distinct random cells, and if no path joins them a random monotone path between them is
cleared of holes, so every map is solvable (the shortest plan is in ``info["solution"]``). Rendering is
one row per line with ``F`` frozen floor and ``P`` the player, followed by ``move:``.

Actions: ``Left``/``Down``/``Right``/``Up`` or ``L``/``D``/``R``/``U`` in any case, read by
:func:`envs.actions.parse_direction` out of noisy text. ``slippery`` moves in the intended direction with
probability 1/3 and to either perpendicular side with 1/3 each (drawn from the reset seed).

Rewards: 1 on reaching the goal (terminated), 0 on a hole (terminated), ``-step_penalty`` for any other
move (walking into the edge leaves the player in place), ``-format_penalty`` for an unreadable action
(nothing moves; the observation says "invalid action"). Every step counts towards ``max_steps``; the step
that reaches it without terminating is truncated.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, ClassVar

from rollart.envs.actions import DirectionGame
from rollart.envs.base import StepResult, check_positive, register_env

MOVES = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
WORDS = {"L": "Left", "D": "Down", "R": "Right", "U": "Up"}
_SIDES = {"L": "UD", "R": "UD", "U": "LR", "D": "LR"}


def solvable(grid: list[list[str]]) -> list[str] | None:
    """Shortest action list (``L``/``D``/``R``/``U``) from ``S`` to ``G`` avoiding ``H`` (BFS), or None."""
    n = len(grid)
    start = next((r, c) for r in range(n) for c in range(n) if grid[r][c] == "S")
    prev: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cur = queue.popleft()
        if grid[cur[0]][cur[1]] == "G":
            path = []
            while (link := prev[cur]) is not None:
                cur, a = link
                path.append(a)
            return path[::-1]
        for a, (dr, dc) in MOVES.items():
            nr, nc = cur[0] + dr, cur[1] + dc
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in prev and grid[nr][nc] != "H":
                prev[(nr, nc)] = (cur, a)
                queue.append((nr, nc))
    return None


def generate_map(size: int, hole_prob: float, rng: random.Random) -> list[list[str]]:
    """A ``size × size`` map with a path from ``S`` to ``G`` (see the module docstring)."""
    grid = [["H" if rng.random() < hole_prob else "F" for _ in range(size)] for _ in range(size)]
    cells = [(r, c) for r in range(size) for c in range(size)]
    s, g = rng.sample(cells, 2)
    grid[s[0]][s[1]], grid[g[0]][g[1]] = "S", "G"
    if solvable(grid) is None:
        dr, dc = g[0] - s[0], g[1] - s[1]
        steps = ["v" if dr > 0 else "^"] * abs(dr) + [">" if dc > 0 else "<"] * abs(dc)
        rng.shuffle(steps)
        r, c = s
        for st in steps[:-1]:  # the last step lands on G
            r += {"v": 1, "^": -1}.get(st, 0)
            c += {">": 1, "<": -1}.get(st, 0)
            grid[r][c] = "F"
    return grid


@register_env("frozen_lake")
class FrozenLake(DirectionGame):
    name: ClassVar[str] = "frozen_lake"
    prompt: ClassVar[str] = "move:"
    tag: ClassVar[str] = "FrozenLake"
    inline_methods = frozenset({"reset", "step"})  # quick pure Python
    kwarg_limits: ClassVar[dict[str, tuple[float, float]]] = {
        "size": (2, 64),
        "max_steps": (1, 10_000),
        "max_new_tokens": (1, 4096),
    }
    instructions: ClassVar[str] = (
        "FrozenLake: you are P on a grid. Reach G; a hole H ends the game; F is safe ice. "
        "Answer with one move: Left, Down, Right or Up (L, D, R, U)."
    )

    def __init__(
        self,
        size: int = 4,
        hole_prob: float = 0.2,
        slippery: bool = False,
        max_steps: int = 8,
        max_new_tokens: int = 4,
        step_penalty: float = 0.0,
        format_penalty: float = 0.05,
        with_instructions: bool = False,
    ):
        if size < 2:
            raise ValueError(f"frozen_lake: size must be >= 2 (start and goal need two cells), got {size!r}")
        if not 0.0 <= hole_prob < 1.0:
            raise ValueError(f"frozen_lake: hole_prob must be in [0, 1), got {hole_prob!r}")
        check_positive("frozen_lake", max_steps=max_steps, max_new_tokens=max_new_tokens)
        self.size, self.hole_prob, self.slippery = size, hole_prob, slippery
        self.max_steps, self.max_new_tokens = max_steps, max_new_tokens
        self.step_penalty, self.format_penalty = step_penalty, format_penalty
        self.with_instructions = with_instructions
        self.grid: list[list[str]] = []
        self.pos = (0, 0)
        self.steps = 0
        self.done = True
        self.rng = random.Random(0)

    def render(self) -> str:
        """The grid, one row a line, ``P`` at the player's cell."""
        return "".join(
            "".join("P" if (r, c) == self.pos else ch for c, ch in enumerate(row)) + "\n"
            for r, row in enumerate(self.grid)
        )

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.rng = random.Random(seed)
        self.grid = generate_map(self.size, self.hole_prob, self.rng)
        self.pos = next((r, c) for r in range(self.size) for c in range(self.size) if self.grid[r][c] == "S")
        self.steps, self.done = 0, False
        obs = self.render() + "move:"
        return (self.format_prompt(obs) if self.with_instructions else obs), {"solution": solvable(self.grid)}

    def step(self, action: str) -> StepResult:
        a, truncated = self.take_turn(action)
        if a is None:
            return self.unreadable(truncated)
        intended = a
        if self.slippery:
            a = self.rng.choice([a, _SIDES[a][0], _SIDES[a][1]])
        dr, dc = MOVES[a]
        r, c = self.pos[0] + dr, self.pos[1] + dc
        if 0 <= r < self.size and 0 <= c < self.size:
            self.pos = (r, c)
        info: dict[str, Any] = {"valid": True, "action": intended, "moved": a, "steps": self.steps}
        cell = self.grid[self.pos[0]][self.pos[1]]
        if cell in "GH":
            self.done = True
            info["success"] = cell == "G"
            return self.render(), float(cell == "G"), True, False, info
        self.done = truncated
        return self.render() + "move:", -self.step_penalty, False, truncated, info
