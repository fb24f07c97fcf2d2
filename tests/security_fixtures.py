"""Helpers of the hostile-input suite: processes by uid and by ancestry, a machine without bubblewrap,
waiting on a condition with a deadline, and a sandbox run by a server that is not root."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

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


_RUN_AS = r"""
import json, sys
from rollart.reward import sandbox
args = json.loads(sys.argv[1])
try:
    r = sandbox.run_python(args["code"], **args["limits"])
except sandbox.SandboxUnavailable as err:
    print(json.dumps({"unavailable": str(err)}))
    raise SystemExit(0)
print(json.dumps({"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "timed_out": r.timed_out,
                  "isolation": r.isolation, "killed_by": r.killed_by, "describe": sandbox.describe()}))
"""


def _traversable(path: str) -> bool:
    """Whether every folder above ``path`` lets others in and ``path`` lets others read and run it."""
    real = os.path.realpath(path)
    if not os.path.isfile(real) or os.stat(real).st_mode & 0o005 != 0o005:
        return False
    folder = os.path.dirname(real)
    while True:
        if not os.stat(folder).st_mode & 0o001:
            return False
        if folder == "/":
            return True
        folder = os.path.dirname(folder)


def python_for_everyone() -> str | None:
    """This Python, or the system's of the same version, where every user can run it."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if os.path.exists(exe) and _traversable(exe):
            return os.path.realpath(exe)
    return None


def run_python_as(server: str, code: str, *, unsafe: bool = False, **limits: object) -> dict[str, Any]:
    """:func:`rollart.reward.sandbox.run_python` in a server process running as ``server``: ``root``
    (this process, or with ``unsafe`` a new one) or ``nobody`` (a new process as uid/gid 65534, started
    with ``setpriv``: the sandbox is built without privileges). ``unsafe``: on a machine without
    bubblewrap, the operator having opted in to ``unsafe-no-sandbox``. The result as a dict
    (``returncode``, ``stdout``, ``stderr``, ``killed_by``, ``describe``...; ``unavailable`` with the
    message where the server refused to run code)."""
    if os.geteuid() != 0:
        pytest.skip("the hostile suite switches between root and nobody: it runs as root")
    if server == "root" and not unsafe:
        from rollart.reward import sandbox

        r = sandbox.run_python(code, **limits)  # type: ignore[arg-type]
        return {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "timed_out": r.timed_out,
                "isolation": r.isolation, "killed_by": r.killed_by, "describe": sandbox.describe()}  # fmt: skip
    python = python_for_everyone()
    if python is None:
        pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that every user can run")
    # this checkout and the packages of this environment, by path (a virtual environment under a folder
    # nobody cannot enter is not one nobody can start)
    paths = [str(Path(__file__).resolve().parents[1]), *site.getsitepackages()]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONPATH": os.pathsep.join(paths)}
    if unsafe:
        env |= {"PATH": "/nonexistent", isolation.SANDBOX_ENV: isolation.UNSAFE}
    argv = [python, "-c", _RUN_AS, json.dumps({"code": code, "limits": limits})]
    if server == "nobody":
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("the server-as-nobody case needs setpriv (util-linux) to switch to nobody")
        argv = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", *argv]  # fmt: skip
    done = subprocess.run(argv, cwd="/", env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"the server as {server} failed: {done.stderr[-3000:]}"
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return out
