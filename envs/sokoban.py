"""Sokoban as text: push every box onto a target.

Levels are generated from the seed by reverse play: boxes start on their targets and the player
*pulls* them around for a number of moves, so every level is solvable by construction (replaying
the pulls backwards as pushes solves it). Rendering: ``#`` wall, ``_`` floor, ``O`` target, ``X`` box,
``√`` box on target, ``P`` player (``S`` player on a target). Actions ``Up/Down/Left/Right``
(``U/D/L/R``). Reward: ``box_reward`` per box newly on a target (minus as much when pushed off),
``success_reward`` when all are on targets, ``step_penalty`` per step; unreadable actions cost
``format_penalty`` and change nothing.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from envs.base import TextEnv, register_env

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
_ACTION = re.compile(r"\b(up|down|left|right|[udlr])\b", re.IGNORECASE)


@register_env("sokoban")
class Sokoban(TextEnv):
    tag: ClassVar[str] = "Sokoban"

    def __init__(self, size: int = 6, boxes: int = 1, pulls: int = 8, max_steps: int = 10, max_new_tokens: int = 4,
                 box_reward: float = 0.5, success_reward: float = 1.0, step_penalty: float = 0.01,
                 format_penalty: float = 0.05):
        self.size, self.n_boxes, self.pulls = size, boxes, pulls
        self.max_steps, self.max_new_tokens = max_steps, max_new_tokens
        self.box_reward, self.success_reward = box_reward, success_reward
        self.step_penalty, self.format_penalty = step_penalty, format_penalty
        self.walls: set[tuple[int, int]] = set()
        self.targets: set[tuple[int, int]] = set()
        self.boxes: set[tuple[int, int]] = set()
        self.player = (1, 1)

    def _generate(self, rng: random.Random) -> list[str]:
        n = self.size
        while True:
            walls = {(r, c) for r in range(n) for c in range(n) if r in (0, n - 1) or c in (0, n - 1)}
            inner = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1)]
            targets = set(rng.sample(inner, self.n_boxes))
            boxes = set(targets)
            free = [p for p in inner if p not in boxes]
            player = rng.choice(free)
            pulls: list[str] = []
            for _ in range(self.pulls * 4):
                a = rng.choice("UDLR")
                dr, dc = MOVES[a]
                nxt = (player[0] + dr, player[1] + dc)
                if nxt in walls or nxt in boxes:
                    continue
                behind = (player[0] - dr, player[1] - dc)  # a box behind the player is pulled along
                if behind in boxes and rng.random() < 0.7:
                    boxes.remove(behind)
                    boxes.add(player)
                    pulls.append(a)
                player = nxt
                pulls.append("move")
                if len([p for p in pulls if p != "move"]) >= self.pulls:
                    break
            if boxes != targets:
                self.walls, self.targets, self.boxes, self.player = walls, targets, boxes, player
                return pulls

    def render(self) -> str:
        rows = []
        for r in range(self.size):
            row = []
            for c in range(self.size):
                p = (r, c)
                if p in self.walls:
                    row.append("#")
                elif p == self.player:
                    row.append("S" if p in self.targets else "P")
                elif p in self.boxes:
                    row.append("√" if p in self.targets else "X")
                elif p in self.targets:
                    row.append("O")
                else:
                    row.append("_")
            rows.append("".join(row))
        return "\n".join(rows) + "\n"

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._generate(random.Random(seed))
        return self.render() + "push:", {"boxes": sorted(self.boxes), "targets": sorted(self.targets)}

    def _on_target(self) -> int:
        return len(self.boxes & self.targets)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        m = _ACTION.search(action)
        if m is None:
            return self.render() + "invalid action; push:", -self.format_penalty, False, False, {"valid": False}
        dr, dc = MOVES[m.group(1)[0].upper()]
        before = self._on_target()
        nxt = (self.player[0] + dr, self.player[1] + dc)
        if nxt in self.walls:
            return self.render() + "push:", -self.step_penalty, False, False, {"valid": True, "moved": False}
        if nxt in self.boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if beyond in self.walls or beyond in self.boxes:
                return self.render() + "push:", -self.step_penalty, False, False, {"valid": True, "moved": False}
            self.boxes.remove(nxt)
            self.boxes.add(beyond)
        self.player = nxt
        reward = -self.step_penalty + self.box_reward * (self._on_target() - before)
        done = self.boxes <= self.targets
        if done:
            reward += self.success_reward
        return self.render() + ("" if done else "push:"), reward, done, False, {"valid": True, "success": done}
