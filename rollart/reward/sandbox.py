"""Run untrusted Python in a child process with resource limits and, where available, Linux namespaces.

What is isolated, exactly:

- **Always** (every platform this runs on): the child is started by ``subprocess`` with
  ``start_new_session=True`` (no ``preexec_fn``, so it is safe from thread-pool threads) and a small
  launcher that, before the untrusted code runs, sets hard resource limits it cannot raise again:
  ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space, ``memory_mb``), ``RLIMIT_FSIZE``
  (bytes per file written, output included), ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` = 0 and
  ``RLIMIT_NPROC`` (processes of the sandbox's user). A wall-clock timeout kills the whole session
  (``killpg``). stdout/stderr go to files (bounded by ``RLIMIT_FSIZE``), never to unbounded memory.
  The environment is cleared (``PATH``, ``HOME`` and thread counts only) and the working directory is
  a fresh temporary directory removed afterwards.
- **With bubblewrap** (``bwrap`` on ``PATH`` and user namespaces allowed; Debian package
  ``bubblewrap``): the child also runs in new user, PID, network, IPC, UTS and cgroup namespaces, as
  uid/gid 65534 with every capability dropped, and with ``--die-with-parent``. It has no network
  interface but loopback of its own (so ``127.0.0.1`` of the host is unreachable), sees only its own
  processes, and its file system is built from scratch: ``/usr`` (and ``/bin``, ``/lib``...) and the
  Python installation bound read-only, a fresh ``/proc``, a minimal ``/dev``, an empty tmpfs at
  ``/tmp``, and its working directory (the only host directory it can write). Home directories,
  ``/etc``, ``/work``, other processes' files are not visible.
- **Without bubblewrap** the limits above are all there is: the code can open network sockets and
  read and write whatever the server's user can. When that user is root, the launcher drops to
  ``nobody`` (65534, owner of the working directory only) if ``nobody`` can read the Python
  installation, else it stays root (``RLIMIT_NPROC`` does not bind root). A warning is logged once.
  Install ``bubblewrap`` on any machine that scores code from untrusted policies.

``ROLLART_SANDBOX=rlimits`` forces the fallback (for comparison); ``ROLLART_SANDBOX=bwrap`` makes a
missing or unusable bubblewrap an error instead of a warning.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import IO, Literal

log = logging.getLogger(__name__)

Isolation = Literal["bwrap", "rlimits"]
NOBODY = 65534

# Runs first in the child (``python -I -S -c _LAUNCHER LIMITS SOLUTION``): reads the solution, sets hard
# limits, drops root, then executes the solution in a clean ``__main__`` namespace.
_LAUNCHER = r"""
import json, os, resource, sys
limits = json.loads(sys.argv[1])
drop = limits.pop("drop_root")
path = sys.argv[2]
with open(path) as f:
    source = f.read()
for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), (value, value))
if drop and os.getuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
sys.argv = [path]
del json, os, resource, limits, drop, f, name, value
exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_by: str | None = None
    isolation: Isolation = "rlimits"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


_lock = threading.Lock()
_isolation: Isolation | None = None
_drop_warned = False


def _python() -> str:
    return os.path.realpath(sys.executable)


def _bwrap_prefix(work: str) -> list[str]:
    """bubblewrap arguments: a from-scratch root with the system and Python read-only, ``work`` writable."""
    args = [
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--cap-drop",
        "ALL",
        "--uid",
        str(NOBODY),
        "--gid",
        str(NOBODY),
        "--hostname",
        "sandbox",
    ]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefixes = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(_python()))}
    for prefix in sorted(prefixes):
        if not prefix.startswith("/usr/") and prefix != "/usr" and os.path.isdir(prefix):
            args += ["--ro-bind", prefix, prefix]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", work, work, "--chdir", work]
    return args


def _probe_bwrap() -> str | None:
    """None when bubblewrap works here, else why not."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory(prefix="rollart-sandbox-probe-") as work:
        try:
            done = subprocess.run(
                [*_bwrap_prefix(work), _python(), "-I", "-S", "-c", "pass"],
                check=False,
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"bwrap failed to start: {err}"
    if done.returncode != 0:
        return f"bwrap cannot create namespaces here: {done.stderr.decode(errors='replace').strip()[:300]}"
    return None


def isolation() -> Isolation:
    """The isolation layer this process uses (probed once)."""
    global _isolation
    with _lock:
        if _isolation is None:
            wanted = os.environ.get("ROLLART_SANDBOX", "").strip().lower()
            if wanted not in ("", "bwrap", "rlimits"):
                raise ValueError(f"ROLLART_SANDBOX={wanted!r}: use 'bwrap', 'rlimits' or leave it unset")
            if wanted == "rlimits":
                _isolation = "rlimits"
            else:
                why = _probe_bwrap()
                if why is None:
                    _isolation = "bwrap"
                elif wanted == "bwrap":
                    raise RuntimeError(f"ROLLART_SANDBOX=bwrap but {why}")
                else:
                    log.warning(
                        "code sandbox without namespaces (%s): untrusted code runs with resource limits "
                        "only and can reach the network and read the server's files",
                        why,
                    )
                    _isolation = "rlimits"
        return _isolation


def _world_readable_python() -> bool:
    """Whether user ``nobody`` can import the standard library (not so for a Python under ``/root``)."""
    path = os.path.dirname(os.path.realpath(os.__file__))
    while path not in ("/", ""):
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        path = os.path.dirname(path)
    return True


def _drop_root(layer: Isolation) -> bool:
    global _drop_warned
    if layer == "bwrap" or os.getuid() != 0:
        return False
    if _world_readable_python():
        return True
    if not _drop_warned:
        _drop_warned = True
        log.warning(
            "code sandbox runs as root: user nobody cannot read this Python's standard library (%s)",
            os.path.dirname(os.__file__),
        )
    return False


def _limits(
    timeout_s: float, memory_mb: int, max_file_bytes: int, max_processes: int, drop_root: bool
) -> dict[str, int]:
    cpu = max(1, int(timeout_s) + 1)
    return {
        "drop_root": drop_root,
        "RLIMIT_CPU": cpu,
        "RLIMIT_AS": memory_mb * 1024 * 1024,
        "RLIMIT_FSIZE": max_file_bytes,
        "RLIMIT_NOFILE": 64,
        "RLIMIT_CORE": 0,
        "RLIMIT_NPROC": max_processes,
    }


def _read(f: IO[bytes], limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode(errors="replace")


def _await_namespace_end(info_r: int) -> None:
    """Wait until the sandbox's PID namespace is empty: its init exits only after the kernel has killed
    and reaped every other process in it, so nothing the code forked outlives ``run_python``."""
    try:
        os.set_blocking(info_r, False)
        try:
            info = json.loads(os.read(info_r, 4096) or b"{}")
        except (BlockingIOError, ValueError):
            info = {}
    finally:
        os.close(info_r)
    pid = info.get("child-pid")
    if not isinstance(pid, int):
        return
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if not select.select([pidfd], [], [], 30.0)[0]:
            log.warning("sandbox PID namespace (init %d) still alive 30 s after SIGKILL", pid)
    finally:
        os.close(pidfd)


def run_python(
    code: str,
    stdin: str = "",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output_bytes: int = 1_000_000,
    max_processes: int = 64,
) -> SandboxResult:
    """Run ``code`` with ``stdin``; never raises for the code's own failures. Thread-safe."""
    layer = isolation()
    max_file_bytes = max(10_000_000, max_output_bytes)
    with (
        tempfile.TemporaryDirectory(prefix="rollart-sandbox-") as work,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        path = os.path.join(work, "solution.py")
        with open(path, "w") as f:
            f.write(code)
        drop = _drop_root(layer)
        if drop:  # the launcher drops to nobody: it may write here only
            os.chown(work, NOBODY, NOBODY)
        cmd = [
            _python(),
            "-I",
            "-S",
            "-c",
            _LAUNCHER,
            json.dumps(_limits(timeout_s, memory_mb, max_file_bytes, max_processes, drop)),
            path,
        ]
        info_r = info_w = -1
        if layer == "bwrap":  # bwrap writes {"child-pid": N}: the PID namespace's init, as seen from here
            info_r, info_w = os.pipe()
            cmd = [*_bwrap_prefix(work), "--info-fd", str(info_w), *cmd]
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=work,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=(info_w,) if info_w >= 0 else (),
            )
        finally:
            if info_w >= 0:
                os.close(info_w)
        timed_out = False
        try:
            proc.communicate(stdin.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:  # the whole session: forked children too (with bwrap the PID namespace dies with it)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            if info_r >= 0:
                _await_namespace_end(info_r)
        killed = signal.Signals(-proc.returncode).name if proc.returncode < 0 else None
        return SandboxResult(
            proc.returncode, _read(out, max_output_bytes), _read(err, max_output_bytes), timed_out, killed, layer
        )
