"""Failures a user can act on: the first of each kind at once, with the user's own code, repeats counted.

An episode that fails (an agent or env that raises, a verifier without a reward, an agent that never
calls its session) is played again, so one bug in a user's harness fails hundreds of episodes. A
:class:`FailureLog` (one per rollout scheduler, shared by its env managers) logs the *first* failure of
each kind as an error with the frames of the traceback that are the user's (their agent, env or
verifier: not rollart's, not the standard library's, not an installed package's), then only counts
repeats, logging the count at 10, 100, 1000... A kind is where (``agent``, ``reset``, ``step``,
``reward``...), the exception's type and the user's innermost frame, or the message for a failure without
an exception. :meth:`FailureLog.cause` names the most frequent kind in one line, for the error that ends
a rollout.
"""

from __future__ import annotations

import logging
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_ROLLART = str(Path(__file__).resolve().parents[1])
_LIBRARY = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)


def user_frames(err: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``err``'s traceback (and of the exceptions it was raised from) in the user's own files."""
    frames: list[traceback.FrameSummary] = []
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        frames += getattr(cur, "user_frames", [])  # an error from another process brings the user's frames along
        for frame in traceback.extract_tb(cur.__traceback__):
            path = str(Path(frame.filename).resolve()) if frame.filename and not frame.filename.startswith("<") else ""
            if path and not path.startswith(_ROLLART) and not path.startswith(_LIBRARY):
                frames.append(frame)
        cur = cur.__cause__ or cur.__context__
    return frames


@dataclass
class FailureKind:
    """One kind of failure: what the first one said, where in the user's code, and how often it came."""

    where: str
    message: str
    location: str  # "file:line" of the user's innermost frame, or ""
    count: int = 0

    def line(self) -> str:
        at = f" at {self.location}" if self.location else ""
        return f"{self.where}: {self.message}{at} ({self.count} time{'s' if self.count != 1 else ''})"


class FailureLog:
    """The failures of one rollout, by kind (see the module)."""

    def __init__(self) -> None:
        self.kinds: dict[tuple[str, str, str], FailureKind] = {}

    def record(self, where: str, message: str, err: BaseException | None = None, *, tag: str = "") -> FailureKind:
        """Count a failure of an episode; log it if it is the first of its kind (with the user's frames)."""
        frames = user_frames(err) if err is not None else []
        location = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        kind_of = getattr(err, "type_name", type(err).__name__)  # an error from another process keeps its class's name
        key = (where, kind_of if err is not None else message, location)
        kind = self.kinds.get(key)
        if kind is None:
            kind = self.kinds[key] = FailureKind(where, message, location)
        kind.count += 1
        who = f"{tag} " if tag else ""
        if kind.count == 1:
            shown = "".join(traceback.format_list(frames)).rstrip()
            log.error(
                "%sepisode failed: %s: %s%s%s",
                who,
                where,
                message,
                "\n  your code (innermost last):\n" + shown if shown else "",
                "\n  (further failures of this kind are counted, not logged)",
            )
        elif _round(kind.count):
            log.warning("%sthe same failure, %d times now: %s", who, kind.count, kind.line())
        return kind

    def cause(self) -> str | None:
        """The most frequent kind in one line, or None when nothing failed."""
        if not self.kinds:
            return None
        return max(self.kinds.values(), key=lambda k: k.count).line()

    def summary(self) -> list[str]:
        """Every kind, most frequent first."""
        return [k.line() for k in sorted(self.kinds.values(), key=lambda k: -k.count)]


def _round(n: int) -> bool:
    while n % 10 == 0 and n >= 10:
        n //= 10
    return n == 1


__all__ = ["FailureKind", "FailureLog", "user_frames"]
