"""Run untrusted Python in an isolated, limited child process: :func:`run_python`.

Isolation (:mod:`rollart.reward.isolation`): bubblewrap namespaces, the code as a uid of its own with no
capabilities, a read-only view of the system and Python, no network, no user namespace of its own;
without bubblewrap code runs only when the operator opted in by name (``--unsafe-no-sandbox``), and
otherwise :class:`SandboxUnavailable` is raised. ``docs/security.md`` says which limit holds through
which mechanism, and where it does not.

Limits are the server's (:class:`SandboxLimits`, set once per process with :func:`configure`, e.g. by
``rollart serve rewards --sandbox-timeout-s ...``). A caller (a request's ``ground_truth``, an env's
kwargs) may only lower them: :meth:`SandboxLimits.lowered` refuses a value that is not a finite
positive number (:class:`SandboxLimitError`, a ``ValueError`` naming the field) and caps a larger one
at the server's. Each sandbox gets:

- ``timeout_s``: the CPU seconds its code may use (``RLIMIT_CPU`` per process, and counted for the whole
  sandbox at a timeout); the wall clock allows ``wall_factor`` times as long, then the sandbox is killed;
- ``memory_mb``: address space per process (``RLIMIT_AS``); where a memory cgroup holds
  (:mod:`rollart.reward.sandbox_cgroup`), the whole sandbox's memory, its tmpfs and shared memory
  included, is at most ``memory_mb + disk_mb + 2 * shm_mb``;
- ``max_processes``: processes and threads (``RLIMIT_NPROC`` on a uid or user namespace of its own);
- ``disk_mb``: its working directory, a tmpfs of that size;
- ``shm_mb``: ``/dev/shm`` (a tmpfs of that size) and, separately, SysV shared memory in all;
- ``max_output_bytes``: stdout and stderr each, read from pipes; past it the pipe is closed (the code's
  next write fails) and :attr:`SandboxResult.output_truncated` is set.

What a timeout means (typed, so that no caller turns a busy machine into a score):

- the code used its CPU time (``timeout_s``), or sat blocked or asleep until the wall clock ran out:
  its own verdict, :attr:`SandboxResult.timed_out` (a test that fails);
- the wall clock ran out while the code was kept waiting for a CPU (other sandboxes, other tenants, a
  busy machine), before it had used its CPU time: no verdict at all, :class:`SandboxContended` is
  raised -- the caller retries or counts a failed reward, never a 0;
- the sandbox itself did not start (bubblewrap or its set-up failed): :class:`SandboxError`.

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
import selectors
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart.reward import isolation as _iso
from rollart.reward import sandbox_cgroup as _cgroup
from rollart.reward import sandbox_seccomp as _seccomp
from rollart.reward.isolation import UNSAFE, Mode, SandboxUnavailable

log = logging.getLogger(__name__)

__all__ = [
    "Deadline",
    "SandboxCancelled",
    "SandboxContended",
    "SandboxError",
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


class SandboxContended(RuntimeError):
    """The sandbox ran out of wall-clock time while kept waiting for a CPU, before its code had used its
    CPU time: the machine was too busy to judge the code. Not a verdict on it: retry, or count the
    reward as failed (never as 0)."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (it did not start the code): not a verdict on the code."""


class SandboxLimits(BaseModel):
    """The server's limits of one sandbox (see the module docstring); callers may only lower them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(default=5.0, gt=0, le=3600, allow_inf_nan=False)  # CPU seconds
    memory_mb: int = Field(default=256, ge=16, le=1 << 20)
    max_processes: int = Field(default=32, ge=1, le=4096)
    disk_mb: int = Field(default=64, ge=1, le=1 << 20)
    shm_mb: int = Field(default=16, ge=1, le=1 << 20)
    max_output_bytes: int = Field(default=1_000_000, ge=1, le=1 << 30)
    # the wall clock a sandbox may take, as a multiple of timeout_s (the server's: callers cannot change it)
    wall_factor: float = Field(default=3.0, ge=1, le=100, allow_inf_nan=False)

    @property
    def wall_s(self) -> float:
        """Seconds of wall clock a sandbox may take."""
        return self.timeout_s * self.wall_factor

    def lowered(self, where: str = "", **asked: Any) -> SandboxLimits:
        """These limits with the ``asked`` ones (None: keep the server's) lowered to at most the server's.
        A value that is not a finite number > 0 raises :class:`SandboxLimitError` naming ``where.field``."""
        out: dict[str, Any] = {}
        for name, value in asked.items():
            if value is None:
                continue
            if name not in LOWERABLE:
                raise SandboxLimitError(f"{where}{name}: not a sandbox limit a caller sets; use {sorted(LOWERABLE)}")
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


LOWERABLE = ("timeout_s", "memory_mb", "max_processes", "disk_mb", "shm_mb", "max_output_bytes")


@dataclass
class SandboxResult:
    """What the code did. ``returncode`` is negative when a signal ended it (``killed_by`` names it:
    ``SIGXCPU`` when it used its CPU time); ``timed_out``: the sandbox was killed at its wall clock,
    the code having used its CPU time or sat blocked (its own verdict: see :class:`SandboxContended`
    for the other case)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_by: str | None = None
    isolation: Mode = "bwrap"
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def out_of_time(self) -> bool:
        """Killed for time: at its wall clock, or for its CPU time (``SIGXCPU``)."""
        return self.timed_out or self.killed_by == "SIGXCPU"


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
    text += (
        f"; limits per sandbox: {lim.timeout_s:g} CPU s ({lim.wall_s:g} s of wall clock), {lim.memory_mb} MB per "
        f"process, {lim.max_processes} processes, {lim.disk_mb} MB of disk, {lim.shm_mb} MB of shared memory, "
        f"{lim.max_output_bytes} bytes of output"
    )
    if isolation() == "bwrap":
        found = _cgroup.support()
        text += (
            f"; memory cgroup per sandbox (at most {lim.memory_mb + lim.disk_mb + 2 * lim.shm_mb} MB in all, "
            f"CPU shared per sandbox) under {found.parent}"
            if found.parent
            else f"; no memory cgroup ({found.reason}): memory is limited per process, "
            + (
                "CPU shared per sandbox (each its own session's autogroup)"
                if _autogroups()
                else "CPU shared per process at nice 10 (no autogroups)"
            )
        )
    return text


def _autogroups() -> bool:
    """Whether the kernel shares the CPU between sessions first (``kernel.sched_autogroup_enabled``)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


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
    """One started sandbox: its process (bubblewrap's monitor, or the unsafe supervisor), with
    bubblewrap the init of its PID namespace, and its cgroup if any; :meth:`kill` may be called from
    any thread."""

    def __init__(self, mode: Mode):
        self.mode = mode
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pidfd = -1
        self.init_pid = -1
        self.init_pidfd = -1
        self.cgroup: _cgroup.SandboxCgroup | None = None
        self.cancelled = False

    def cancel(self) -> None:
        """Its scope was cancelled: kill it now (or as soon as it has started)."""
        with self.lock:
            self.cancelled = True
        self.kill()

    def kill(self) -> None:
        with self.lock:
            if self.cgroup is not None:
                self.cgroup.kill()
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


def _rlimits(lim: SandboxLimits) -> dict[str, tuple[int, int]]:
    cpu = max(1, math.ceil(lim.timeout_s))
    out = {
        "RLIMIT_CPU": (cpu, cpu + 1),  # SIGXCPU when its CPU time is used; SIGKILL a second later
        "RLIMIT_AS": lim.memory_mb * 1024 * 1024,
        "RLIMIT_FSIZE": max(10_000_000, lim.max_output_bytes),
        "RLIMIT_NOFILE": 64,
        "RLIMIT_CORE": 0,
        "RLIMIT_NPROC": lim.max_processes,
        "RLIMIT_MSGQUEUE": 65536,  # POSIX message queues: 64 KB in all
        "RLIMIT_MEMLOCK": 1 << 20,
    }
    return {k: v if isinstance(v, tuple) else (v, v) for k, v in out.items()}


def _init_pid(info_r: int) -> int:
    """The pid of the sandbox's PID-namespace init, from bubblewrap's ``--info-fd`` (-1 if it never said)."""
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
    return pid if isinstance(pid, int) else -1


def _wait_gone(pidfd: int, what: str) -> None:
    if pidfd >= 0 and not select.select([pidfd], [], [], 30.0)[0]:
        log.warning("sandbox %s still alive 30 s after SIGKILL", what)


def _tree_usage(root: int) -> tuple[float, float] | None:
    """(CPU seconds, seconds spent runnable but waiting for a CPU) of ``root`` and every process below
    it, their reaped children included; None when some process of it could not be read (the code may
    hide its children: then no claim that the machine kept it waiting)."""
    cpu = waited = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    todo, seen = [root], set()
    try:
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # gone meanwhile
                continue
            cpu += (int(fields[13]) + int(fields[14])) / tick  # cutime, cstime: its reaped children
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        ran, wait, _ = f.read().split()
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        todo += [int(c) for c in f.read().split()]
                except FileNotFoundError:
                    continue
                cpu += int(ran) / 1e9
                waited += int(wait) / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return cpu, waited


def _contended(run: _Run, lim: SandboxLimits, wall: float) -> bool:
    """At the wall clock: was the sandbox kept waiting for a CPU (rather than using its CPU time, or
    sitting blocked)? Measured before it is killed."""
    usage = run.cgroup.usage() if run.cgroup is not None else None
    if usage is None:
        root = run.init_pid if run.init_pid > 0 else (run.proc.pid if run.proc is not None else -1)
        usage = _tree_usage(root) if root > 0 else None
    if usage is None:
        return False
    cpu, waited = usage
    log.debug("sandbox at its wall clock (%.2f s): %.2f CPU s, %.2f s waiting for a CPU", wall, cpu, waited)
    return cpu < lim.timeout_s and waited >= 0.25 * wall


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
    shm_mb: int | None = None,
) -> SandboxResult:
    """Run ``code`` with ``stdin`` in a sandbox; a limit given lowers the server's (:func:`limits`).

    Never raises for the code's own failures. Raises :class:`SandboxUnavailable` (no isolation layer),
    :class:`SandboxLimitError` (a limit that is not a finite positive number), :class:`SandboxCancelled`
    (the :func:`deadline` scope was cancelled or passed), :class:`SandboxContended` (the machine kept
    the code waiting for a CPU until the wall clock ran out: no verdict) and :class:`SandboxError`
    (the sandbox did not start the code). Thread-safe."""
    lim = limits().lowered(
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
        max_processes=max_processes,
        disk_mb=disk_mb,
        shm_mb=shm_mb,
    )
    lay = _iso.layer()
    scope = _scope.get()
    wall = lim.wall_s
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
        done = _start_and_wait(run, lay, lim, code, stdin, wall)
    finally:
        with _alive_lock:
            _alive.discard(run)
        if scope is not None:
            scope._exit(run)
    if scope is not None and (run.cancelled or (done.timed_out and wall < lim.wall_s)):
        raise SandboxCancelled("the request's deadline passed or it was cancelled: its sandbox was killed")
    if done.contended:
        raise SandboxContended(
            f"the sandbox reached its wall clock ({wall:g} s) while kept waiting for a CPU, before its code had "
            f"used its {lim.timeout_s:g} CPU s: the machine was too busy to judge it; retry, or count it as failed"
        )
    rc = done.returncode
    if not done.started:
        raise SandboxError(f"the sandbox did not start the code (exit {rc}): {done.stderr.strip()[-500:]}")
    if lay.mode == "bwrap" and rc > 128 and rc - 128 in _SIGNALS:  # bubblewrap says 128+N for signal N
        rc = -(rc - 128)
    killed = signal.Signals(-rc).name if rc < 0 and -rc in _SIGNALS else None
    if lay.mode == UNSAFE and rc == 137 and done.timed_out:  # the supervisor, ended by us
        killed = "SIGKILL"
    return SandboxResult(rc, done.stdout, done.stderr, done.timed_out, killed, lay.mode, done.truncated)


_SIGNALS = {s.value for s in signal.Signals}


@dataclass
class _Done:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    contended: bool
    started: bool
    truncated: bool


def _start_and_wait(run: _Run, lay: _iso.Layer, lim: SandboxLimits, code: str, stdin: str, wall: float) -> _Done:
    with contextlib.ExitStack() as stack:
        launcher: dict[str, Any] = {**_rlimits(lim), "nice": 10, "uid": None}
        ready_r, ready_w = os.pipe()  # the launcher writes one byte on it just before the code runs
        stack.callback(os.close, ready_r)
        launcher["ready"] = ready_w
        fds = [ready_w]  # passed to the child; closed here once it started
        lease = None
        if lay.as_root:
            lease = _iso.UidLease.acquire()
            stack.callback(lease.release)  # after every process of the uid is gone (callbacks run last-in first-out)
            launcher["uid"] = lease.uid
        if lay.mode == "bwrap":
            cmd, cwd, env, info_r = _bwrap_launch(stack, run, lay, lim, code, launcher, fds)
        else:
            info_r = -1
            cmd, cwd, env = _unsafe_launch(stack, lease, code, launcher)
        proc = _spawn(run, cmd, cwd, env, fds, info_r)
        contended = False
        try:
            pumped = _pump(proc, stdin.encode(), ready_r, lim.max_output_bytes, time.monotonic() + wall, run.pidfd)
            if pumped.timed_out:
                contended = not run.cancelled and _contended(run, lim, wall)
        finally:
            _reap(run, lay, proc)
    return _Done(
        proc.returncode,
        pumped.out.decode(errors="replace"),
        pumped.err.decode(errors="replace"),
        pumped.timed_out,
        contended,
        pumped.started,
        pumped.truncated,
    )


def _bwrap_launch(
    stack: contextlib.ExitStack,
    run: _Run,
    lay: _iso.Layer,
    lim: SandboxLimits,
    code: str,
    launcher: dict[str, Any],
    fds: list[int],
) -> tuple[list[str], str, dict[str, str], int]:
    """The bubblewrap command line, its cwd and env, and the read end of its ``--info-fd`` pipe: creates the
    run's cgroup (removed by ``stack``) and the fds the child gets (appended to ``fds``)."""
    found = _cgroup.support()
    if found.parent is not None:
        memory = (lim.memory_mb + lim.disk_mb + 2 * lim.shm_mb) << 20
        run.cgroup = _cgroup.SandboxCgroup.create(found, memory_bytes=memory, max_processes=lim.max_processes)
        stack.callback(run.cgroup.remove)
    code_fd = os.memfd_create("rollart-sandbox-solution")
    fds.append(code_fd)
    os.write(code_fd, code.encode())
    os.lseek(code_fd, 0, os.SEEK_SET)
    seccomp_fd = _seccomp.memfd()
    fds.append(seccomp_fd)
    info_r, info_w = os.pipe()
    fds.append(info_w)
    cmd = _iso.bwrap_command(
        lay,
        code_fd=code_fd,
        info_fd=info_w,
        seccomp_fd=seccomp_fd,
        disk_bytes=lim.disk_mb << 20,
        shm_bytes=lim.shm_mb << 20,
        launcher_limits=launcher,
        cgroup_procs=run.cgroup.procs if run.cgroup is not None else None,
    )
    return cmd, "/", {**_ENV, "HOME": _iso.WORKDIR}, info_r


def _unsafe_launch(
    stack: contextlib.ExitStack, lease: _iso.UidLease | None, code: str, launcher: dict[str, Any]
) -> tuple[list[str], str, dict[str, str]]:
    """The unsafe launcher's command line, cwd and env: writes the code in a temporary folder (removed by
    ``stack``) that only the code's uid may enter."""
    work = stack.enter_context(tempfile.TemporaryDirectory(prefix="rollart-sandbox-"))
    path = os.path.join(work, "solution.py")
    with open(path, "w") as f:
        f.write(code)
    if lease is not None:  # the code's uid owns its folder, no one else may enter it
        os.chown(path, lease.uid, lease.uid)
        os.chown(work, lease.uid, lease.uid)
    os.chmod(work, 0o700)
    cmd = [_iso.python(), "-I", "-S", "-c", _iso.UNSAFE_LAUNCHER, json.dumps(launcher), path]
    return cmd, work, {**_ENV, "HOME": work}


def _spawn(
    run: _Run, cmd: list[str], cwd: str, env: dict[str, str], fds: list[int], info_r: int
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with ``fds`` (closed here once it started) and record its process (and, with ``info_r``,
    its PID namespace's init) on ``run``; killed at once if ``run`` was cancelled meanwhile."""
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(fds),
        )
    finally:
        for fd in fds:
            os.close(fd)
    with run.lock:
        run.proc, run.pidfd = proc, os.pidfd_open(proc.pid)
    if info_r >= 0:
        init = _init_pid(info_r)
        init_fd = -1
        if init > 0:
            with contextlib.suppress(ProcessLookupError):
                init_fd = os.pidfd_open(init)
        with run.lock:
            run.init_pid, run.init_pidfd = init, init_fd
    if run.cancelled:  # cancelled while starting
        run.kill()
    return proc


def _reap(run: _Run, lay: _iso.Layer, proc: subprocess.Popen[bytes]) -> None:
    """Kill the run's whole tree, also after a normal exit (nothing the code started outlives it), wait for
    it to be gone and close its fds and pipes."""
    run.kill()
    if lay.mode == UNSAFE:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # the supervisor did not end: end its session by force
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _wait_gone(run.init_pidfd, "PID namespace")
    run.close()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


@dataclass
class _Pumped:
    out: bytes
    err: bytes
    timed_out: bool
    started: bool
    truncated: bool


def _pump(
    proc: subprocess.Popen[bytes], data: bytes, ready: int, limit: int, deadline_at: float, pidfd: int
) -> _Pumped:
    """Feed stdin, read stdout and stderr (each up to ``limit`` bytes: past it the pipe is closed, so the
    code's next write fails) and the launcher's start byte, until the output ends after the process
    exited, or the wall clock ``deadline_at`` (``timed_out``)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    streams = {out_fd: proc.stdout, err_fd: proc.stderr}
    bufs = {fd: bytearray() for fd in streams}
    sel = selectors.DefaultSelector()
    for fd in streams:
        sel.register(fd, selectors.EVENT_READ)
    sel.register(ready, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)  # readable once the process has exited
    win = proc.stdin.fileno()
    pending = memoryview(data)
    if pending:
        os.set_blocking(win, False)
        sel.register(win, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    started = truncated = timed_out = False
    exited_at: float | None = None
    try:
        while any(fd in streams for fd in sel.get_map()):
            now = time.monotonic()
            # after the process exited, what it left in the pipes is read for at most 2 s more
            until = deadline_at if exited_at is None else min(deadline_at, exited_at + 2.0)
            if until <= now:
                timed_out = exited_at is None
                break
            for key, _ in sel.select(until - now):
                fd = key.fd
                if fd == pidfd:
                    exited_at = time.monotonic()
                    sel.unregister(fd)
                elif fd == ready:
                    started = started or bool(os.read(ready, 1))
                    sel.unregister(fd)
                elif fd == win:
                    try:
                        pending = pending[os.write(win, pending[:65536]) :]
                    except BlockingIOError:
                        continue
                    except (BrokenPipeError, ConnectionResetError):  # the code closed its stdin
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(win)
                        proc.stdin.close()
                else:
                    chunk = os.read(fd, 65536)
                    buf = bufs[fd]
                    room = limit - len(buf)
                    buf += chunk[:room]
                    if not chunk or len(chunk) > room:
                        sel.unregister(fd)
                        if chunk:  # past the limit: close the pipe, the code's next write fails
                            truncated = True
                            streams.pop(fd).close()
    finally:
        sel.close()
    if not started:  # the byte may have come with the last of the output
        with contextlib.suppress(OSError):
            os.set_blocking(ready, False)
            started = bool(os.read(ready, 1))
    return _Pumped(bytes(bufs[out_fd]), bytes(bufs[err_fd]), timed_out, started, truncated)
