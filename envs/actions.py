"""Reading an agent's action out of noisy text.

:func:`answer_text` takes the content of the first ``<answer>…</answer>`` if there is one, else the
whole text. :func:`parse_direction` reads a grid move from it: the first direction word (``left``,
``down``, ``right``, ``up``, or ``west``/``south``/``east``/``north``, or an arrow) wins, in any case;
if there is no word, the first standalone letter ``L``/``D``/``R``/``U``. ``None`` means unreadable
(the env answers "invalid action" and charges its format penalty).
"""

from __future__ import annotations

import re
from abc import abstractmethod
from typing import ClassVar

from rollart.envs.base import EnvError, StepResult, TextEnv

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_WORD = re.compile(r"(?<![a-z])(left|down|right|up|west|south|east|north)(?![a-z])|([←↓→↑])", re.IGNORECASE)
_LETTER = re.compile(r"(?<![a-z])([ldru])(?![a-z])", re.IGNORECASE)
_WORD_TO_MOVE = {
    "left": "L",
    "down": "D",
    "right": "R",
    "up": "U",
    "west": "L",
    "south": "D",
    "east": "R",
    "north": "U",
    "←": "L",
    "↓": "D",
    "→": "R",
    "↑": "U",
}


def answer_text(text: str) -> str:
    """The content of the first ``<answer>…</answer>`` (stripped), else ``text`` stripped."""
    m = _ANSWER.search(text)
    return (m.group(1) if m else text).strip()


def parse_direction(text: str) -> str | None:
    """One of ``"L"``, ``"D"``, ``"R"``, ``"U"``, or ``None`` when no direction can be read."""
    span = answer_text(text)
    m = _WORD.search(span)
    if m:
        return _WORD_TO_MOVE[(m.group(1) or m.group(2)).lower()]
    m = _LETTER.search(span)
    return m.group(1).upper() if m else None


class DirectionGame(TextEnv):
    """A grid game played one direction per step (FrozenLake, Sokoban): the start every ``step`` shares.
    A subclass sets ``name`` (its registry name) and ``prompt`` (what its observations end with), and
    keeps ``steps``, ``done`` and ``format_penalty``."""

    name: ClassVar[str] = "grid"
    prompt: ClassVar[str] = "move:"
    steps: int
    done: bool
    format_penalty: float

    @abstractmethod
    def render(self) -> str:
        """The board as text."""

    def take_turn(self, action: str) -> tuple[str | None, bool]:
        """Count the step of ``action`` and read its direction: ``(direction or None, truncated)``, where
        ``truncated`` says this step is the last of the episode. A step after the end raises ``EnvError``."""
        if self.done:
            raise EnvError(f"{self.name}: step() after the episode ended; call reset() first")
        self.steps += 1
        return parse_direction(action), self.steps >= self.max_steps

    def unreadable(self, truncated: bool) -> StepResult:
        """The answer to an action with no direction in it: nothing moves, the format penalty is charged
        and the agent is asked again (unless the episode is over)."""
        self.done = truncated
        return (
            self.render() + f"invalid action; {self.prompt}",
            -self.format_penalty,
            False,
            truncated,
            {"valid": False, "steps": self.steps},
        )
