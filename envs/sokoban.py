"""Sokoban as text: push every box onto a target.

Levels come from the reset seed by *reverse play*: a walled room (optionally with inner walls, the
free cells kept connected), boxes placed on their targets, then the player walks backwards and
*pulls* boxes for ``pulls`` pulls. Every generated level is therefore solvable: replaying the reverse
moves backwards as forward moves (each pull becomes a push) solves it; that replay is
``info["reverse_solution"]`` and the shortest solution found by BFS is ``info["solution"]``.
``max_solution_steps`` (if set) rejects levels whose shortest solution is longer.

Rendering, one row a line: ``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``√`` box on target,
``P`` player, ``S`` player on a target; followed by ``push:``. Actions ``Up/Down/Left/Right``
(``U/D/L/R``, any case, read from noisy text by :func:`envs.actions.parse_direction`).

Rewards per step: ``-step_penalty``, plus ``box_reward`` for each box newly pushed onto a target (and
minus as much for one pushed off), plus ``success_reward`` when every box is on a target (terminated).
An unreadable action costs ``-format_penalty`` and changes nothing ("invalid action"). Every step
counts towards ``max_steps``; the step that reaches it without terminating is truncated.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, ClassVar

from rollart.envs.actions import DirectionGame
from rollart.envs.base import StepResult, check_positive, register_env

Cell = tuple[int, int]
MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
OPPOSITE = {"U": "D", "D": "U", "L": "R", "R": "L"}
_PULL_PROB = 0.7  # chance that a reverse move with a box behind the player pulls it
_MAX_ATTEMPTS = 1000


def push(walls: set[Cell], boxes: frozenset[Cell], player: Cell, a: str) -> tuple[frozenset[Cell], Cell] | None:
    """The state after a forward move ``a``, or None when the move is blocked (wall, or a box that
    cannot be pushed because a wall or another box is behind it)."""
    dr, dc = MOVES[a]
    nxt = (player[0] + dr, player[1] + dc)
    if nxt in walls:
        return None
    if nxt in boxes:
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if beyond in walls or beyond in boxes:
            return None
        boxes = (boxes - {nxt}) | {beyond}
    return boxes, nxt


def solve(
    walls: set[Cell], boxes: frozenset[Cell], targets: frozenset[Cell], player: Cell, limit: int = 200_000
) -> list[str] | None:
    """Shortest move list that puts every box on a target (BFS over (player, boxes)); None when none is
    found within ``limit`` visited states."""
    start = (player, boxes)
    prev: dict[tuple[Cell, frozenset[Cell]], tuple[tuple[Cell, frozenset[Cell]], str] | None] = {start: None}
    queue = deque([start])
    while queue and len(prev) <= limit:
        state = queue.popleft()
        if state[1] <= targets:
            path = []
            while (link := prev[state]) is not None:
                state, a = link
                path.append(a)
            return path[::-1]
        for a in MOVES:
            moved = push(walls, state[1], state[0], a)
            if moved is not None and (key := (moved[1], moved[0])) not in prev:
                prev[key] = (state, a)
                queue.append(key)
    return None


def _connected(cells: set[Cell]) -> bool:
    if not cells:
        return False
    first = next(iter(cells))
    seen, queue = {first}, deque([first])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            n = (r + dr, c + dc)
            if n in cells and n not in seen:
                seen.add(n)
                queue.append(n)
    return len(seen) == len(cells)


@register_env("sokoban")
class Sokoban(DirectionGame):
    name: ClassVar[str] = "sokoban"
    prompt: ClassVar[str] = "push:"
    tag: ClassVar[str] = "Sokoban"
    inline_methods = frozenset({"reset", "step"})  # quick pure Python
    kwarg_limits: ClassVar[dict[str, tuple[float, float]]] = {
        "size": (3, 32),
        "boxes": (1, 8),
        "pulls": (1, 10_000),
        "max_steps": (1, 10_000),
        "max_new_tokens": (1, 4096),
        "max_solution_steps": (1, 200),
    }
    instructions: ClassVar[str] = (
        "Sokoban: you are P. Push every box X onto a target O (a box on a target is √); # is a wall, _ is "
        "floor. Boxes can only be pushed. Answer with one move: Up, Down, Left or Right (U, D, L, R)."
    )

    def __init__(
        self,
        size: int = 6,
        boxes: int = 1,
        pulls: int = 8,
        wall_prob: float = 0.0,
        max_steps: int = 10,
        max_new_tokens: int = 4,
        box_reward: float = 0.5,
        success_reward: float = 1.0,
        step_penalty: float = 0.01,
        format_penalty: float = 0.05,
        max_solution_steps: int | None = None,
        with_instructions: bool = False,
    ):
        check_positive("sokoban", boxes=boxes, pulls=pulls, max_steps=max_steps, max_new_tokens=max_new_tokens)
        if (size - 2) ** 2 < boxes + 2:
            raise ValueError(
                f"sokoban: size={size} leaves {(max(size - 2, 0)) ** 2} inner cells, too few for "
                f"boxes={boxes}; use size >= {next(s for s in range(3, 99) if (s - 2) ** 2 >= boxes + 2)}"
            )
        if not 0.0 <= wall_prob < 0.5:
            raise ValueError(f"sokoban: wall_prob must be in [0, 0.5), got {wall_prob!r}")
        if max_solution_steps is not None:
            check_positive("sokoban", max_solution_steps=max_solution_steps)
        self.size, self.n_boxes, self.pulls, self.wall_prob = size, boxes, pulls, wall_prob
        self.max_steps, self.max_new_tokens = max_steps, max_new_tokens
        self.box_reward, self.success_reward = box_reward, success_reward
        self.step_penalty, self.format_penalty = step_penalty, format_penalty
        self.max_solution_steps = max_solution_steps
        self.with_instructions = with_instructions
        self.walls: set[Cell] = set()
        self.targets: frozenset[Cell] = frozenset()
        self.boxes: frozenset[Cell] = frozenset()
        self.player: Cell = (1, 1)
        self.steps = 0
        self.done = True

    def _room(self, rng: random.Random) -> tuple[set[Cell], list[Cell]]:
        n = self.size
        walls = {(r, c) for r in range(n) for c in range(n) if r in (0, n - 1) or c in (0, n - 1)}
        inner = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1)]
        for cell in inner:
            if rng.random() < self.wall_prob:
                free = set(inner) - walls - {cell}
                if len(free) >= self.n_boxes + 2 and _connected(free):
                    walls.add(cell)
        return walls, [p for p in inner if p not in walls]

    def _reverse_play(
        self, rng: random.Random
    ) -> tuple[set[Cell], frozenset[Cell], frozenset[Cell], Cell, list[str]] | None:
        """One reverse-play attempt: (walls, targets, boxes, player, forward solution) or None."""
        walls, free = self._room(rng)
        targets = frozenset(rng.sample(free, self.n_boxes))
        boxes = set(targets)
        player = rng.choice([p for p in free if p not in boxes])
        reverse: list[str] = []
        pulled = 0
        for _ in range(self.pulls * 25):
            # with a box beside the player, half of the moves step away from it (a pull)
            pullable = [a for a, (dr, dc) in MOVES.items() if (player[0] - dr, player[1] - dc) in boxes]
            a = rng.choice(pullable) if pullable and rng.random() < 0.5 else rng.choice("UDLR")
            dr, dc = MOVES[a]
            nxt = (player[0] + dr, player[1] + dc)
            if nxt in walls or nxt in boxes:
                continue
            behind = (player[0] - dr, player[1] - dc)
            if behind in boxes and rng.random() < _PULL_PROB:
                boxes.remove(behind)
                boxes.add(player)
                pulled += 1
            player = nxt
            reverse.append(a)
            if pulled >= self.pulls:
                break
        if frozenset(boxes) == targets:
            return None
        forward = [OPPOSITE[a] for a in reversed(reverse)]
        state: tuple[frozenset[Cell], Cell] = (frozenset(boxes), player)
        for i, a in enumerate(forward):  # keep the replay up to the first solved state
            state = push(walls, state[0], state[1], a) or state
            if state[0] <= targets:
                forward = forward[: i + 1]
                break
        return walls, targets, frozenset(boxes), player, forward

    def render(self) -> str:
        """The level, one row a line (symbols in the module docstring)."""
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
                else:
                    row.append("O" if p in self.targets else "_")
            rows.append("".join(row) + "\n")
        return "".join(rows)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        for _ in range(_MAX_ATTEMPTS):
            level = self._reverse_play(rng)
            if level is None:
                continue
            walls, targets, boxes, player, reverse_solution = level
            solution = solve(walls, boxes, targets, player) or reverse_solution
            if self.max_solution_steps is not None and len(solution) > self.max_solution_steps:
                continue
            break
        else:
            raise ValueError(
                f"sokoban: no level found in {_MAX_ATTEMPTS} tries (size={self.size}, "
                f"boxes={self.n_boxes}, pulls={self.pulls}, max_solution_steps="
                f"{self.max_solution_steps}); raise max_solution_steps or pulls, or lower boxes"
            )
        self.walls, self.targets, self.boxes, self.player = walls, targets, boxes, player
        self.steps, self.done = 0, False
        obs = self.render() + "push:"
        return (self.format_prompt(obs) if self.with_instructions else obs), {
            "solution": solution,
            "reverse_solution": reverse_solution,
            "boxes": sorted(boxes),
            "targets": sorted(targets),
        }

    def step(self, action: str) -> StepResult:
        a, truncated = self.take_turn(action)
        if a is None:
            return self.unreadable(truncated)
        before = len(self.boxes & self.targets)
        moved = push(self.walls, self.boxes, self.player, a)
        if moved is not None:
            self.boxes, self.player = moved
        on_target = len(self.boxes & self.targets)
        success = self.boxes <= self.targets
        reward = -self.step_penalty + self.box_reward * (on_target - before) + (self.success_reward if success else 0.0)
        self.done = success or truncated
        info = {
            "valid": True,
            "action": a,
            "moved": moved is not None,
            "boxes_on_target": on_target,
            "success": success,
            "steps": self.steps,
        }
        return self.render() + ("" if success else "push:"), reward, success, truncated and not success, info
