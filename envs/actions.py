"""Reading an agent's action out of noisy text.

:func:`answer_text` takes the content of the first ``<answer>…</answer>`` if there is one, else the
whole text. :func:`parse_direction` reads a grid move from it: the first direction word (``left``,
``down``, ``right``, ``up``, or ``west``/``south``/``east``/``north``, or an arrow) wins, in any case;
if there is no word, the first standalone letter ``L``/``D``/``R``/``U``. ``None`` means unreadable
(the env answers "invalid action" and charges its format penalty).
"""

from __future__ import annotations

import re

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
