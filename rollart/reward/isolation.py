"""The code sandbox's isolation layer: which one this process uses, the command that starts a sandbox,
and the uids sandboxes run as. :mod:`rollart.reward.sandbox` is the API on top of it.

Two layers, chosen once per process (:func:`layer`):

- ``bwrap`` -- bubblewrap (Debian/Ubuntu package ``bubblewrap``; ``apt-get install bubblewrap``).
  The sandbox gets new PID, network, IPC, UTS, mount and cgroup namespaces; its root file system is
  built from scratch: ``/usr`` (and ``/bin``, ``/lib``...) and the Python installation read-only, a
  fresh ``/proc`` (its own processes only), a minimal ``/dev`` and one size-limited tmpfs at ``/tmp``
  (its working directory and the only place it can write: the total-disk limit). The solution is
  copied in read-only at ``/sandbox/solution.py``. bubblewrap sets ``no_new_privs`` (setuid binaries
  give nothing). The user code never runs as root:

  * server running as root: bubblewrap runs without a user namespace and keeps only ``CAP_SETUID``
    and ``CAP_SETGID``, which the launcher uses to become a uid of the sandbox's own (a lease from
    ``ROLLART_SANDBOX_UID_BASE``, default 2 000 000 000, one uid per sandbox running on the machine)
    before the solution is read; that drops every capability. Each sandbox counts its processes
    (``RLIMIT_NPROC``) on its own uid.
  * server running as another user: bubblewrap creates an unprivileged user namespace (uid 65534
    inside, the server's uid outside) with every capability dropped.

- ``unsafe-no-sandbox`` -- no isolation: the code runs as the server's user (``nobody`` when the
  server is root and ``nobody`` can read the Python installation) with resource limits only, under a
  supervisor that kills every process it started (double forks and ``setsid`` included: the supervisor
  is their subreaper). It can read what the server's user can read and reach the network. Used only
  when the operator asks for it by name: ``--unsafe-no-sandbox`` on ``rollart serve rewards|env``,
  or ``ROLLART_SANDBOX=unsafe-no-sandbox``. Without bubblewrap and without that opt-in, running code
  raises :class:`SandboxUnavailable`.

``ROLLART_SANDBOX=bwrap`` is the default made explicit (bubblewrap or an error).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

Mode = Literal["bwrap", "unsafe-no-sandbox"]
UNSAFE: Mode = "unsafe-no-sandbox"
SANDBOX_ENV = "ROLLART_SANDBOX"
UID_BASE_ENV = "ROLLART_SANDBOX_UID_BASE"
DEFAULT_UID_BASE = 2_000_000_000
UID_SLOTS = 65_536
NOBODY = 65534
SOLUTION = "/sandbox/solution.py"  # where bubblewrap puts the solution (read-only)
WORKDIR = "/tmp"  # the sandbox's working directory: its size-limited tmpfs
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"
OPT_IN_HINT = "or accept running untrusted code unisolated with --unsafe-no-sandbox (ROLLART_SANDBOX=unsafe-no-sandbox)"


class SandboxUnavailable(RuntimeError):
    """No isolation layer is usable here and the operator did not opt in to running code without one."""


# The launcher runs first in the sandbox (``python -I -S -c BWRAP_LAUNCHER LIMITS SOLUTION``): reads the
# solution, lowers its priority, sets hard limits, becomes the sandbox's uid (when started as root: a
# uid of its own, which drops every capability), then executes the solution in a clean ``__main__``.
BWRAP_LAUNCHER = r"""
import json, os, resource, sys
limits = json.loads(sys.argv[1])
uid = limits.pop("uid")
nice = limits.pop("nice")
path = sys.argv[2]
with open(path) as f:
    source = f.read()
os.nice(nice)
for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), (value, value))
if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
if os.getuid() == 0 or os.geteuid() == 0:
    sys.stderr.write("sandbox: refusing to run code as root\n")
    os._exit(125)
sys.argv = [path]
exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

# Without isolation: a supervisor that is the subreaper of everything the code starts. It forks the
# code's process (limits, nobody when it can), waits for it, then kills every process left (orphans of
# double forks come back to it); SIGTERM (the server's timeout or cancellation) does the same at once.
UNSAFE_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
limits = json.loads(sys.argv[1])
uid = limits.pop("uid")
nice = limits.pop("nice")
path = sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
parent = os.getppid()
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: the server died -> clean up as on a timeout
def children():
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/children" % tid) as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out
def kill_all():
    while True:
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
def stop(signum, frame):
    kill_all()
    os._exit(137)
signal.signal(signal.SIGTERM, stop)
if os.getppid() != parent:
    stop(0, None)
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    with open(path) as f:
        source = f.read()
    os.nice(nice)
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    sys.argv = [path]
    exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
else:
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    kill_all()
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)
"""


@dataclass(frozen=True)
class Layer:
    """The isolation layer of this process."""

    mode: Mode
    bwrap: str | None = None  # absolute path of bubblewrap, found once: the probe and every run use it
    as_root: bool = False  # bwrap started by root: a leased uid per sandbox
    why_not: str | None = None  # unsafe: why bubblewrap is not used

    def describe(self) -> str:
        if self.mode == "bwrap":
            who = (
                f"a uid of its own from {uid_base()} up, no capabilities"
                if self.as_root
                else f"uid {NOBODY} in a user namespace (the server's uid outside), no capabilities"
            )
            return (
                f"code sandbox: bubblewrap ({self.bwrap}): new PID, network, IPC, UTS, mount and cgroup "
                f"namespaces, read-only system and Python, size-limited tmpfs as the only writable place; "
                f"code runs as {who}"
            )
        return (
            "code sandbox: UNSAFE, NO ISOLATION (--unsafe-no-sandbox): untrusted code runs as this server's "
            f"user{' (nobody where it can)' if os.geteuid() == 0 else ''}, can read its files and reach the "
            f"network; resource limits only ({self.why_not or 'chosen by the operator'})"
        )


def python() -> str:
    return os.path.realpath(sys.executable)


def uid_base() -> int:
    raw = os.environ.get(UID_BASE_ENV, "")
    try:
        base = int(raw) if raw else DEFAULT_UID_BASE
    except ValueError:
        raise SandboxUnavailable(f"{UID_BASE_ENV}={raw!r}: give a number (the first uid of sandboxes)") from None
    if not 1000 <= base <= 2**31 - 1 - UID_SLOTS:
        raise SandboxUnavailable(f"{UID_BASE_ENV}={base}: use a uid range above 1000 that no user of this machine has")
    return base


def _python_prefixes() -> list[str]:
    prefixes = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(python()))}
    return sorted(p for p in prefixes if p != "/usr" and not p.startswith("/usr/") and os.path.isdir(p))


def bwrap_argv(lay: Layer, *, code_fd: int, info_fd: int, disk_bytes: int) -> list[str]:
    """bubblewrap's arguments: a root built from scratch, the system and Python read-only, the solution
    at :data:`SOLUTION` (copied from ``code_fd``), a tmpfs of ``disk_bytes`` at :data:`WORKDIR`."""
    assert lay.bwrap is not None
    args = [lay.bwrap]
    if lay.as_root:  # no user namespace: the launcher switches to the leased uid with these two only
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL"]
    args += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    made: set[str] = set()
    for prefix in _python_prefixes():
        # bubblewrap creates the parents of a bind; make them traversable by the sandbox's uid even where
        # the host's are not (a Python under /root)
        parts = prefix.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            parent = "/" + "/".join(parts[: i + 1])
            if parent not in made and parent not in ("/usr", "/tmp", "/proc", "/dev", "/sandbox"):
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", prefix, prefix]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--size", str(disk_bytes), "--tmpfs", WORKDIR]
    args += ["--perms", "0444", "--ro-bind-data", str(code_fd), SOLUTION, "--chdir", WORKDIR]
    args += ["--info-fd", str(info_fd)]
    return args


def _probe_bwrap(as_root: bool) -> tuple[str | None, str | None]:
    """(bubblewrap's absolute path, None) when a sandbox starts here, else (path or None, why not)."""
    path = shutil.which("bwrap")
    if path is None:
        return None, f"bwrap is not installed ({INSTALL_HINT})"
    path = os.path.realpath(path)
    lay = Layer("bwrap", bwrap=path, as_root=as_root)
    probe = "import os\nprint(os.getuid())\n"
    code_fd = os.memfd_create("rollart-sandbox-probe")
    info_r, info_w = os.pipe()
    lease = UidLease.acquire() if as_root else None
    try:
        os.write(code_fd, probe.encode())
        os.lseek(code_fd, 0, os.SEEK_SET)
        limits = {"uid": lease.uid if lease else None, "nice": 0}
        argv = bwrap_argv(lay, code_fd=code_fd, info_fd=info_w, disk_bytes=1 << 20)
        argv += [python(), "-I", "-S", "-c", BWRAP_LAUNCHER, json.dumps(limits), SOLUTION]
        try:
            done = subprocess.run(
                argv,
                check=False,
                capture_output=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin"},
                pass_fds=(code_fd, info_w),
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            return path, f"bwrap failed to start: {err}"
    finally:
        os.close(code_fd)
        os.close(info_r)
        os.close(info_w)
        if lease is not None:
            lease.release()
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()[-300:]
        return path, f"bwrap cannot build a sandbox here: {why}"
    uid = done.stdout.decode().strip()
    if uid == "0":
        return path, "bwrap ran the code as root"
    return path, None


_lock = threading.Lock()
_layer: Layer | None = None
_allow_unsafe: bool | None = None  # set by the servers' --unsafe-no-sandbox; None: the environment says


def allow_unsafe(allowed: bool) -> None:
    """The operator's opt-in (``--unsafe-no-sandbox``) to run code without isolation when none is usable."""
    global _allow_unsafe, _layer
    with _lock:
        _allow_unsafe = allowed
        if _layer is not None and _layer.mode == UNSAFE and not _unsafe_allowed():
            _layer = None  # probe again: refuse now


def _unsafe_allowed() -> bool:
    if _allow_unsafe is not None:
        return _allow_unsafe
    return os.environ.get(SANDBOX_ENV, "").strip().lower() == UNSAFE


def layer() -> Layer:
    """The isolation layer of this process (probed once); :class:`SandboxUnavailable` when there is none
    and the operator did not opt in to running without one."""
    global _layer
    with _lock:
        if _layer is not None:
            return _layer
        wanted = os.environ.get(SANDBOX_ENV, "").strip().lower()
        if wanted not in ("", "bwrap", UNSAFE):
            raise SandboxUnavailable(
                f"{SANDBOX_ENV}={wanted!r}: use 'bwrap' (the default: bubblewrap or an error) or "
                f"'{UNSAFE}' (run untrusted code without isolation)"
            )
        as_root = os.geteuid() == 0
        path, why = _probe_bwrap(as_root)
        if why is None:
            _layer = Layer("bwrap", bwrap=path, as_root=as_root)
        elif _unsafe_allowed() and wanted != "bwrap":
            _layer = Layer(UNSAFE, why_not=why)
        else:
            raise SandboxUnavailable(f"no isolation layer for untrusted code: {why}; {INSTALL_HINT}, {OPT_IN_HINT}")
        if _layer.mode == UNSAFE:
            log.error("%s", _layer.describe())
        else:
            log.debug("%s", _layer.describe())
        return _layer


def reset() -> None:
    """Forget the probed layer (tests; a process whose environment changed)."""
    global _layer
    with _lock:
        _layer = None


def world_readable_python() -> bool:
    """Whether user ``nobody`` can import the standard library (not so for a Python under ``/root``)."""
    path = os.path.dirname(os.path.realpath(os.__file__))
    while path not in ("/", ""):
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        path = os.path.dirname(path)
    return True


class UidLease:
    """A uid for one sandbox, held (an exclusive ``flock`` on a file named after it, in a root-only
    folder) until the sandbox's last process is gone; so two sandboxes on one machine, in one server
    process or several, never share a uid."""

    def __init__(self, uid: int, fd: int):
        self.uid, self._fd = uid, fd

    @staticmethod
    def _folder() -> str:
        for folder in ("/run/rollart-sandbox", os.path.join(tempfile.gettempdir(), f"rollart-sandbox-{os.geteuid()}")):
            try:
                os.makedirs(folder, mode=0o700, exist_ok=True)
                st = os.lstat(folder)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
                return folder
        raise SandboxUnavailable("no private folder for sandbox uid leases (/run/rollart-sandbox or the temp folder)")

    @classmethod
    def acquire(cls) -> UidLease:
        folder, base = cls._folder(), uid_base()
        for slot in range(UID_SLOTS):
            uid = base + slot
            fd = os.open(os.path.join(folder, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(uid, fd)
        raise SandboxUnavailable(f"all {UID_SLOTS} sandbox uids from {base} are in use")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = -1
