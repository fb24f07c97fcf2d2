"""FrozenLake as a text grid: reach the goal G from the start S without falling into a hole H.

Maps are generated from the seed and always have a path (checked by BFS). Actions are ``Left``,
``Down``, ``Right``, ``Up`` (or ``L``/``D``/``R``/``U``, case-insensitive, first match in the text);
an unreadable action leaves the agent in place with a ``format_penalty`` and an "invalid action"
observation. Reward 1 on reaching the goal, 0 on a hole (the episode ends), ``step_penalty`` per move.
``slippery`` moves perpendicular with probability 1/3 each side.
"""

from __future__ import annotations

import random
import re
from collections import deque
from typing import Any, ClassVar

from envs.base import TextEnv, register_env

MOVES = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
_ACTION = re.compile(r"\b(left|down|right|up|[ldru])\b", re.IGNORECASE)


def solvable(grid: list[list[str]]) -> list[str] | None:
    """Shortest action list from S to G avoiding holes, or None."""
    n = len(grid)
    start = next((r, c) for r in range(n) for c in range(n) if grid[r][c] == "S")
    prev: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cur = queue.popleft()
        if grid[cur[0]][cur[1]] == "G":
            path = []
            while prev[cur] is not None:
                cur, a = prev[cur]  # type: ignore[misc]
                path.append(a)
            return path[::-1]
        for a, (dr, dc) in MOVES.items():
            nr, nc = cur[0] + dr, cur[1] + dc
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in prev and grid[nr][nc] != "H":
                prev[(nr, nc)] = (cur, a)
                queue.append((nr, nc))
    return None


@register_env("frozen_lake")
class FrozenLake(TextEnv):
    tag: ClassVar[str] = "FrozenLake"

    def __init__(self, size: int = 4, hole_prob: float = 0.2, slippery: bool = False, max_steps: int = 8,
                 max_new_tokens: int = 4, step_penalty: float = 0.0, format_penalty: float = 0.05):
        self.size, self.hole_prob, self.slippery = size, hole_prob, slippery
        self.max_steps, self.max_new_tokens = max_steps, max_new_tokens
        self.step_penalty, self.format_penalty = step_penalty, format_penalty
        self.grid: list[list[str]] = []
        self.pos = (0, 0)
        self.rng = random.Random(0)

    def _generate(self, rng: random.Random) -> list[list[str]]:
        while True:
            n = self.size
            grid = [["H" if rng.random() < self.hole_prob else "F" for _ in range(n)] for _ in range(n)]
            cells = [(r, c) for r in range(n) for c in range(n)]
            s, g = rng.sample(cells, 2)
            grid[s[0]][s[1]], grid[g[0]][g[1]] = "S", "G"
            if solvable(grid):
                return grid

    def render(self) -> str:
        rows = []
        for r, row in enumerate(self.grid):
            rows.append("".join("P" if (r, c) == self.pos else ch for c, ch in enumerate(row)))
        return "\n".join(rows) + "\n"

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.rng = random.Random(seed)
        self.grid = self._generate(self.rng)
        self.pos = next((r, c) for r in range(self.size) for c in range(self.size) if self.grid[r][c] == "S")
        return self.render() + "move:", {"solution": solvable(self.grid)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        m = _ACTION.search(action)
        if m is None:
            return self.render() + "invalid action; move:", -self.format_penalty, False, False, {"valid": False}
        a = m.group(1)[0].upper()
        if self.slippery:
            side = {"L": "UD", "R": "UD", "U": "LR", "D": "LR"}[a]
            a = self.rng.choice([a, side[0], side[1]])
        dr, dc = MOVES[a]
        r, c = self.pos[0] + dr, self.pos[1] + dc
        if 0 <= r < self.size and 0 <= c < self.size:
            self.pos = (r, c)
        cell = self.grid[self.pos[0]][self.pos[1]]
        if cell == "G":
            return self.render(), 1.0, True, False, {"valid": True, "success": True}
        if cell == "H":
            return self.render(), 0.0, True, False, {"valid": True, "success": False}
        return self.render() + "move:", -self.step_penalty, False, False, {"valid": True}
