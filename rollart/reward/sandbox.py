"""Run untrusted Python in an isolated, limited child process: :func:`run_python`.

Isolation (:mod:`rollart.reward.isolation`): bubblewrap namespaces, the code as a uid of its own with no
capabilities, a read-only view of the system and Python, no network; without bubblewrap code runs only
when the operator opted in by name (``--unsafe-no-sandbox``), and otherwise :class:`SandboxUnavailable`
is raised.

Limits are the server's (:class:`SandboxLimits`, set once per process with :func:`configure`, e.g. by
``rollart serve rewards --sandbox-timeout-s ...``). A caller (a request's ``ground_truth``, an env's
kwargs) may only lower them: :meth:`SandboxLimits.lowered` refuses a value that is not a finite
positive number (:class:`SandboxLimitError`, a ``ValueError`` naming the field) and caps a larger one
at the server's. Each sandbox gets:

- ``timeout_s``: wall clock; the sandbox is killed past it (``RLIMIT_CPU`` is set a second above it);
- ``memory_mb``: address space per process (``RLIMIT_AS``);
- ``max_processes``: processes and threads of the sandbox's uid (``RLIMIT_NPROC``; with bubblewrap
  every sandbox has a uid of its own, so the count is per sandbox), so memory in all is at most
  ``max_processes * memory_mb``;
- ``disk_mb``: its only writable place is a tmpfs of that size (with bubblewrap);
- ``max_output_bytes``: stdout and stderr are files, each bounded (``RLIMIT_FSIZE``), read up to it.

A deadline kills: :func:`deadline` opens a scope (a context variable, so it reaches worker threads
started with :func:`asyncio.to_thread` or :func:`contextvars.copy_context`); every sandbox started in
it ends by the scope's deadline, and :meth:`Deadline.cancel` (a request that timed out or was
cancelled) kills every sandbox of the scope at once -- its whole process tree, namespace and all -- and
makes later :func:`run_python` calls of that scope raise :class:`SandboxCancelled` instead of starting.
:func:`running` counts the sandboxes alive in this process.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field

from rollart.reward import isolation as _iso
from rollart.reward.isolation import UNSAFE, Mode, SandboxUnavailable

log = logging.getLogger(__name__)

__all__ = [
    "Deadline",
    "SandboxCancelled",
    "SandboxLimitError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "check",
    "configure",
    "deadline",
    "describe",
    "isolation",
    "limits",
    "run_python",
    "running",
]


class SandboxLimitError(ValueError):
    """A limit asked for is not a finite positive number."""


class SandboxCancelled(RuntimeError):
    """The scope the sandbox ran in was cancelled or passed its deadline: its sandboxes were killed."""


class SandboxLimits(BaseModel):
    """The server's limits of one sandbox (see the module docstring); callers may only lower them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(default=5.0, gt=0, le=3600, allow_inf_nan=False)
    memory_mb: int = Field(default=256, ge=16, le=1 << 20)
    max_processes: int = Field(default=32, ge=1, le=4096)
    disk_mb: int = Field(default=64, ge=1, le=1 << 20)
    max_output_bytes: int = Field(default=1_000_000, ge=1, le=1 << 30)

    def lowered(self, where: str = "", **asked: Any) -> SandboxLimits:
        """These limits with the ``asked`` ones (None: keep the server's) lowered to at most the server's.
        A value that is not a finite number > 0 raises :class:`SandboxLimitError` naming ``where.field``."""
        out: dict[str, Any] = {}
        for name, value in asked.items():
            if value is None:
                continue
            if name not in SandboxLimits.model_fields:
                raise SandboxLimitError(f"{where}{name}: not a sandbox limit; use {sorted(SandboxLimits.model_fields)}")
            field = f"{where}{name}"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SandboxLimitError(
                    f"{field}={value!r}: give a number > 0 (the server's limit is {getattr(self, name)})"
                )
            if not math.isfinite(value) or value <= 0:
                raise SandboxLimitError(
                    f"{field}={value!r}: give a finite number > 0 (the server's limit is {getattr(self, name)})"
                )
            server = getattr(self, name)
            out[name] = min(server, value if name == "timeout_s" else max(1, int(value)))
        return self.model_copy(update=out)


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_by: str | None = None
    isolation: Mode = "bwrap"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


_limits = SandboxLimits()
_config_lock = threading.Lock()


def configure(server_limits: SandboxLimits | None = None, *, unsafe_no_sandbox: bool | None = None) -> None:
    """Set this process's sandbox limits and the operator's ``--unsafe-no-sandbox`` opt-in (servers do at
    start-up; None leaves a setting as it is)."""
    global _limits
    with _config_lock:
        if server_limits is not None:
            _limits = server_limits
    if unsafe_no_sandbox is not None:
        _iso.allow_unsafe(unsafe_no_sandbox)


def limits() -> SandboxLimits:
    """The server's limits in this process."""
    return _limits


def isolation() -> Mode:
    """``bwrap`` or, where the operator opted in and bubblewrap is not usable, ``unsafe-no-sandbox``;
    raises :class:`SandboxUnavailable` otherwise."""
    return _iso.layer().mode


def check() -> str:
    """Fail now (:class:`SandboxUnavailable`) when code could not run here; else describe the layer."""
    return _iso.layer().describe()


def describe() -> str:
    """One line for a server's start-up log: the layer in use (or why there is none) and the limits."""
    try:
        text = check()
    except SandboxUnavailable as err:
        return f"code sandbox: unavailable ({err})"
    lim = limits()
    return (
        f"{text}; limits per sandbox: {lim.timeout_s:g} s, {lim.memory_mb} MB per process, "
        f"{lim.max_processes} processes, {lim.disk_mb} MB of disk, {lim.max_output_bytes} bytes of output"
    )


# --- deadlines and cancellation ------------------------------------------------------------------------


class Deadline:
    """A scope whose sandboxes end by ``timeout_s`` from now (None: only by their own limits) and die at
    once on :meth:`cancel`. Thread-safe."""

    def __init__(self, timeout_s: float | None = None):
        self.at = None if timeout_s is None else time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._runs: set[_Run] = set()
        self.cancelled = False

    def left(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def cancel(self) -> None:
        """Kill every sandbox of this scope and refuse new ones."""
        with self._lock:
            self.cancelled = True
            runs = list(self._runs)
        for run in runs:
            run.cancel()

    def _enter(self, run: _Run) -> bool:
        with self._lock:
            if self.cancelled:
                return False
            self._runs.add(run)
            return True

    def _exit(self, run: _Run) -> None:
        with self._lock:
            self._runs.discard(run)


_scope: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("rollart_sandbox_deadline", default=None)


@contextlib.contextmanager
def deadline(timeout_s: float | None = None) -> Iterator[Deadline]:
    """Run the block (and what it hands to threads with its context) under a new :class:`Deadline`."""
    scope = Deadline(timeout_s)
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


_alive_lock = threading.Lock()
_alive: set[_Run] = set()


def running() -> int:
    """Sandboxes alive in this process now."""
    with _alive_lock:
        return len(_alive)


# --- one sandbox ------------------------------------------------------------------------------------------


class _Run:
    """One started sandbox: its process (bubblewrap's monitor, or the unsafe supervisor) and, with
    bubblewrap, the init of its PID namespace; :meth:`kill` may be called from any thread."""

    def __init__(self, mode: Mode):
        self.mode = mode
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pidfd = -1
        self.init_pidfd = -1
        self.cancelled = False

    def cancel(self) -> None:
        """Its scope was cancelled: kill it now (or as soon as it has started)."""
        with self.lock:
            self.cancelled = True
        self.kill()

    def kill(self) -> None:
        with self.lock:
            if self.pidfd < 0:
                return
            if self.mode == UNSAFE:  # the supervisor kills every process it started, then exits
                _signal(self.pidfd, signal.SIGTERM)
            else:  # the monitor and the namespace's init: every process of the namespace dies with it
                _signal(self.pidfd, signal.SIGKILL)
                if self.init_pidfd >= 0:
                    _signal(self.init_pidfd, signal.SIGKILL)

    def close(self) -> None:
        with self.lock:
            for fd in (self.pidfd, self.init_pidfd):
                if fd >= 0:
                    os.close(fd)
            self.pidfd = self.init_pidfd = -1


def _signal(pidfd: int, sig: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        pass


def _read(f: IO[bytes], limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode(errors="replace")


def _rlimits(lim: SandboxLimits) -> dict[str, int]:
    return {
        "RLIMIT_CPU": max(1, math.ceil(lim.timeout_s) + 1),
        "RLIMIT_AS": lim.memory_mb * 1024 * 1024,
        "RLIMIT_FSIZE": max(10_000_000, lim.max_output_bytes),
        "RLIMIT_NOFILE": 64,
        "RLIMIT_CORE": 0,
        "RLIMIT_NPROC": lim.max_processes,
    }


def _init_pidfd(info_r: int) -> int:
    """A pidfd of the sandbox's PID-namespace init, from bubblewrap's ``--info-fd`` (-1 if it never said)."""
    data, info = b"", None
    try:
        end = time.monotonic() + 30
        while info is None and select.select([info_r], [], [], max(0.0, end - time.monotonic()))[0]:
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            data += chunk
            with contextlib.suppress(ValueError):
                info = json.loads(data)
    except OSError:
        pass
    finally:
        os.close(info_r)
    pid = info.get("child-pid") if isinstance(info, dict) else None
    if not isinstance(pid, int):
        return -1
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1


def _wait_gone(pidfd: int, what: str) -> None:
    if pidfd >= 0 and not select.select([pidfd], [], [], 30.0)[0]:
        log.warning("sandbox %s still alive 30 s after SIGKILL", what)


_ENV = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}


def run_python(
    code: str,
    stdin: str = "",
    *,
    timeout_s: float | None = None,
    memory_mb: int | None = None,
    max_output_bytes: int | None = None,
    max_processes: int | None = None,
    disk_mb: int | None = None,
) -> SandboxResult:
    """Run ``code`` with ``stdin`` in a sandbox; a limit given lowers the server's (:func:`limits`).

    Never raises for the code's own failures. Raises :class:`SandboxUnavailable` (no isolation layer),
    :class:`SandboxLimitError` (a limit that is not a finite positive number) and
    :class:`SandboxCancelled` (the :func:`deadline` scope was cancelled or passed). Thread-safe."""
    lim = limits().lowered(
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
        max_processes=max_processes,
        disk_mb=disk_mb,
    )
    lay = _iso.layer()
    scope = _scope.get()
    wall = lim.timeout_s
    if scope is not None:
        left = scope.left()
        if scope.cancelled or (left is not None and left <= 0):
            raise SandboxCancelled("the request's deadline passed or it was cancelled: no new sandbox")
        if left is not None:
            wall = min(wall, left)
    run = _Run(lay.mode)
    if scope is not None and not scope._enter(run):
        raise SandboxCancelled("the request was cancelled: no new sandbox")
    with _alive_lock:
        _alive.add(run)
    try:
        timed_out, out, err, proc = _start_and_wait(run, lay, lim, code, stdin, wall)
    finally:
        with _alive_lock:
            _alive.discard(run)
        if scope is not None:
            scope._exit(run)
    if scope is not None and (run.cancelled or (timed_out and wall < lim.timeout_s)):
        raise SandboxCancelled("the request's deadline passed or it was cancelled: its sandbox was killed")
    rc = proc.returncode
    killed = signal.Signals(-rc).name if rc < 0 else ("SIGKILL" if lay.mode == UNSAFE and rc == 137 else None)
    return SandboxResult(rc, out, err, timed_out, killed, lay.mode)


def _start_and_wait(
    run: _Run, lay: _iso.Layer, lim: SandboxLimits, code: str, stdin: str, wall: float
) -> tuple[bool, str, str, subprocess.Popen[bytes]]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, contextlib.ExitStack() as stack:
        rlimits: dict[str, Any] = {**_rlimits(lim), "nice": 10, "uid": None}
        pass_fds: tuple[int, ...] = ()
        info_r = info_w = code_fd = -1
        if lay.mode == "bwrap":
            if lay.as_root:
                lease = _iso.UidLease.acquire()
                stack.callback(lease.release)  # after the namespace is gone (callbacks run last-in first-out)
                rlimits["uid"] = lease.uid
            code_fd = os.memfd_create("rollart-sandbox-solution")
            os.write(code_fd, code.encode())
            os.lseek(code_fd, 0, os.SEEK_SET)
            info_r, info_w = os.pipe()
            cmd = _iso.bwrap_argv(lay, code_fd=code_fd, info_fd=info_w, disk_bytes=lim.disk_mb * 1024 * 1024)
            cmd += [_iso.python(), "-I", "-S", "-c", _iso.BWRAP_LAUNCHER, json.dumps(rlimits), _iso.SOLUTION]
            pass_fds, cwd, env = (code_fd, info_w), "/", {**_ENV, "HOME": _iso.WORKDIR}
        else:
            work = stack.enter_context(tempfile.TemporaryDirectory(prefix="rollart-sandbox-"))
            path = os.path.join(work, "solution.py")
            with open(path, "w") as f:
                f.write(code)
            if os.geteuid() == 0 and _iso.world_readable_python():  # the code's process becomes nobody
                rlimits["uid"] = _iso.NOBODY
                os.chown(work, _iso.NOBODY, _iso.NOBODY)
            cmd = [_iso.python(), "-I", "-S", "-c", _iso.UNSAFE_LAUNCHER, json.dumps(rlimits), path]
            cwd, env = work, {**_ENV, "HOME": work}
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=pass_fds,
            )
        finally:
            for fd in (code_fd, info_w):
                if fd >= 0:
                    os.close(fd)
        with run.lock:
            run.proc, run.pidfd = proc, os.pidfd_open(proc.pid)
        if info_r >= 0:
            init = _init_pidfd(info_r)
            with run.lock:
                run.init_pidfd = init
        if run.cancelled:  # cancelled while starting
            run.kill()
        timed_out = False
        try:
            proc.communicate(stdin.encode(), timeout=wall)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            run.kill()  # the whole tree, also after a normal exit: nothing the code started outlives it
            if lay.mode == UNSAFE:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:  # the supervisor did not end: end its session by force
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            _wait_gone(run.init_pidfd, "PID namespace")
            run.close()
        return timed_out, _read(out, lim.max_output_bytes), _read(err, lim.max_output_bytes), proc
