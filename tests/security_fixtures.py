"""Helpers of the hostile-input suite: processes by uid and by ancestry, a machine without bubblewrap,
and waiting on a condition with a deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rollart.reward import isolation


def processes_of_uid(uid: int) -> list[int]:
    """Processes whose real, effective or saved uid is ``uid``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids:
            out.append(int(pid))
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (by parent links, zombies excluded)."""
    children: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(p))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``cond`` (a state read from /proc or an HTTP endpoint) until it holds; fail naming ``what``."""
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)


@contextmanager
def no_bwrap(tmp_path: Path, *, opt_in: bool) -> Iterator[None]:
    """This process as on a machine without bubblewrap (``PATH`` without it), with or without the
    operator's ``unsafe-no-sandbox`` opt-in; the environment and the probed layer are restored after."""
    empty = tmp_path / "no-bwrap-bin"
    empty.mkdir(exist_ok=True)
    saved = {k: os.environ.get(k) for k in ("PATH", isolation.SANDBOX_ENV)}
    os.environ["PATH"] = str(empty)
    if opt_in:
        os.environ[isolation.SANDBOX_ENV] = isolation.UNSAFE
    else:
        os.environ.pop(isolation.SANDBOX_ENV, None)
    isolation.reset()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        isolation.reset()
