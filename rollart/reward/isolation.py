"""The code sandbox's isolation layer: which one this process uses, the commands that start a sandbox,
and the uids sandboxes run as. :mod:`rollart.reward.sandbox` is the API on top of it.

Two layers, chosen once per process (:func:`layer`):

- ``bwrap`` -- bubblewrap (Debian/Ubuntu package ``bubblewrap``; ``apt-get install bubblewrap``).
  A sandbox starts with :data:`PRELAUNCHER`, which (as the server's user) moves itself into the
  sandbox's memory cgroup where there is one (:mod:`rollart.reward.sandbox_cgroup`), enters a new IPC
  namespace and sets its limits there (SysV shared memory at most ``shm_mb`` in all, a few small message
  queues and semaphore sets; a server that is not root first enters a user namespace of its own, as
  its root, to be allowed to), then runs bubblewrap. The sandbox gets new PID, network, UTS, mount and
  cgroup namespaces and that IPC namespace; its root file system is built from scratch and read-only:
  ``/usr`` (and ``/bin``, ``/lib``...) and the Python installation read-only, a fresh ``/proc`` (its
  own processes only), a minimal read-only ``/dev``, the solution at ``/sandbox/solution.py``; the only
  writable places are two size-limited tmpfs, ``/tmp`` (``disk_mb``, its working directory) and
  ``/dev/shm`` (``shm_mb``). A seccomp filter (:mod:`rollart.reward.sandbox_seccomp`) denies new user
  namespaces and a few kernel interfaces; bubblewrap sets ``no_new_privs``. Output leaves through pipes.
  The user code never runs as root:

  * server running as root: bubblewrap runs without a user namespace and keeps only ``CAP_SETUID``
    and ``CAP_SETGID``, which the launcher uses to become a uid of the sandbox's own (a lease from
    ``ROLLART_SANDBOX_UID_BASE``, default 2 000 000 000, one uid per sandbox running on the machine)
    before the solution is read; that drops every capability. Each sandbox counts its processes
    (``RLIMIT_NPROC``) on its own uid.
  * server running as another user: bubblewrap creates an unprivileged user namespace (uid 65534
    inside, the server's uid outside) with every capability dropped, and ``--disable-userns``; the
    process limit counts in that namespace, so per sandbox too.

- ``unsafe-no-sandbox`` -- no isolation: resource limits only, under a supervisor that kills every
  process it started (double forks and ``setsid`` included: the supervisor is their subreaper). With a
  server running as root the code runs as a uid of its own per sandbox (the same leases as above): it
  cannot read the server's files, memory or other sandboxes' files, nor signal the supervisor, its
  process limit is its own, and at the end every process of that uid is killed; where that uid could
  not run this Python (a Python under ``/root``) the server refuses to run code. With a server running
  as another user the code runs as that user: it can read and write what the server can, kill it, and
  leave processes behind. Either way it can read world-readable files, write world-writable folders
  without a size limit and reach the network. Used only when the operator asks for it by name:
  ``--unsafe-no-sandbox`` on ``rollart serve rewards|env``, or ``ROLLART_SANDBOX=unsafe-no-sandbox``.
  Without bubblewrap and without that opt-in, running code raises :class:`SandboxUnavailable`.

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from rollart.reward import sandbox_seccomp

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


# Runs first, as the server's user, before bubblewrap (``python -I -S -c PRELAUNCHER CONFIG BWRAP ARGS...``):
# joins the sandbox's cgroup (CONFIG["cgroup"]: its cgroup.procs), enters a new IPC namespace (and, for
# a server that is not root, a user namespace of its own where it is root: needed to set the limits of
# that IPC namespace), sets those limits (CONFIG["sysctls"]), then becomes bubblewrap.
PRELAUNCHER = r"""
import ctypes, json, os, sys
cfg = json.loads(sys.argv[1])
def die(what):
    sys.stderr.write("sandbox: %s\n" % what)
    os._exit(126)
if cfg["cgroup"]:
    try:
        with open(cfg["cgroup"], "w") as f:
            f.write(str(os.getpid()))
    except OSError as err:
        die("cannot join the sandbox's cgroup: %s" % err)
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x08000000 | (0x10000000 if cfg["userns"] else 0)) != 0:
    die("no IPC namespace of its own: " + os.strerror(ctypes.get_errno()))
try:
    if cfg["userns"]:
        for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
    for name, value in cfg["sysctls"].items():
        with open("/proc/sys/" + name, "w") as f:
            f.write(value)
except OSError as err:
    die("cannot limit the sandbox's IPC namespace: %s" % err)
os.execv(sys.argv[2], sys.argv[2:])
"""

# Runs first in the sandbox (``python -I -S -c BWRAP_LAUNCHER LIMITS SOLUTION``): reads the solution,
# lowers its priority (nice 10: below the server where the kernel shares the CPU per process; with
# autogroups, it is shared per session first, and bubblewrap gives each sandbox a session of its own),
# sets hard limits, becomes the sandbox's uid (when started as root: a uid of its own, which drops every
# capability), then tells the server it started and executes the solution in a clean ``__main__``.
BWRAP_LAUNCHER = r"""
import json, os, resource, sys
limits = json.loads(sys.argv[1])
uid = limits.pop("uid")
nice = limits.pop("nice")
ready = limits.pop("ready")
path = sys.argv[2]
with open(path) as f:
    source = f.read()
os.nice(nice)
for name, (soft, hard) in limits.items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
if os.getuid() == 0 or os.geteuid() == 0:
    sys.stderr.write("sandbox: refusing to run code as root\n")
    os._exit(125)
os.write(ready, b"1")
os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # nothing of the launcher's is left to the code
sys.argv = [path]
exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

# Without isolation: a supervisor that is the subreaper of everything the code starts. It forks the
# code's process (limits; with a root server, the sandbox's own uid), waits for it, then kills every
# process left: orphans of double forks come back to it, and with a uid of its own every process of that
# uid is killed (``kill(-1)`` as that uid) wherever it went. SIGTERM (the server's timeout or
# cancellation) does the same at once. Its exit status is the code's: a code killed by a signal ends
# the supervisor by the same signal.
UNSAFE_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
limits = json.loads(sys.argv[1])
uid = limits.pop("uid")
nice = limits.pop("nice")
ready = limits.pop("ready")
path = sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
parent = os.getppid()
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: the server died -> clean up as on a timeout
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
def children():
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/children" % tid) as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out
def reap():
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
def kill_uid():
    # True while some process of the sandbox's uid was still there to be killed
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            os._exit(0)
        except BaseException:
            os._exit(2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0
def kill_all():
    for _ in range(100):
        left = kill_uid() if uid is not None else False
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            left = True
        reap()
        if not left:
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
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.write(ready, b"1")
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # nothing of the supervisor's is left to the code
    sys.argv = [path]
    exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
else:
    os.close(ready)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_all()
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        sig = -code
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not end a process by default
    os._exit(code)
"""

# The limits of a sandbox's IPC namespace (``/proc/sys/...``), besides SysV shared memory (``shm_mb``):
# a few small message queues (SysV and POSIX) and semaphore sets, next to nothing in kernel memory.
IPC_SYSCTLS = {
    "kernel/shmmni": "64",
    "kernel/msgmni": "8",
    "kernel/msgmnb": "16384",
    "kernel/sem": "250 4000 32 16",
    "fs/mqueue/queues_max": "8",
}


def ipc_sysctls(shm_bytes: int) -> dict[str, str]:
    """The IPC namespace limits of a sandbox whose SysV shared memory may total ``shm_bytes``."""
    page = os.sysconf("SC_PAGE_SIZE")
    return {"kernel/shmmax": str(shm_bytes), "kernel/shmall": str(max(1, shm_bytes // page)), **IPC_SYSCTLS}


@dataclass(frozen=True)
class Layer:
    """The isolation layer of this process."""

    mode: Mode
    bwrap: str | None = None  # absolute path of bubblewrap, found once: the probe and every run use it
    as_root: bool = False  # started by root: a leased uid per sandbox (bwrap, and unsafe-no-sandbox)
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
                "namespaces, read-only root, system and Python, size-limited tmpfs at /tmp and /dev/shm as "
                "the only writable places, SysV IPC limited in its namespace, no user namespace of its own "
                f"(seccomp), output through pipes; code runs as {who}"
            )
        if self.as_root:
            who = (
                f"a uid of its own per sandbox (from {uid_base()} up, its own process limit, every process "
                "of it killed at the end); it can read files every user can read, write world-writable "
                "folders without a size limit"
            )
        else:
            who = (
                "this server's own uid: it can read and write this server's files, read its memory and "
                "tokens, kill it and every process of that uid, leave processes running past the deadline, "
                "and all sandboxes share one process limit and see each other's files"
            )
        return (
            f"code sandbox: UNSAFE, NO ISOLATION (--unsafe-no-sandbox): untrusted code runs as {who}; it can "
            f"reach the network; resource limits per process only ({self.why_not or 'chosen by the operator'})"
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


def bwrap_argv(
    lay: Layer, *, code_fd: int, info_fd: int, seccomp_fd: int, disk_bytes: int, shm_bytes: int
) -> list[str]:
    """bubblewrap's arguments: a read-only root built from scratch, the system and Python read-only, the
    solution at :data:`SOLUTION` (copied from ``code_fd``), a tmpfs of ``disk_bytes`` at :data:`WORKDIR`
    and one of ``shm_bytes`` at ``/dev/shm``, the seccomp filter read from ``seccomp_fd``. The IPC
    namespace is the one :data:`PRELAUNCHER` made."""
    assert lay.bwrap is not None
    args = [lay.bwrap]
    if lay.as_root:  # no user namespace: the launcher switches to the leased uid with these two only
        args += ["--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        args += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL", "--disable-userns"]
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
    # /proc/sys read-only: under a server that is not root, the sandbox's uid is the root of its IPC
    # namespace's owner, to whom the kernel would let it raise that namespace's limits
    args += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev", "--remount-ro", "/dev"]
    args += ["--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]
    args += ["--perms", "1777", "--size", str(disk_bytes), "--tmpfs", WORKDIR]
    args += ["--perms", "0444", "--ro-bind-data", str(code_fd), SOLUTION, "--chdir", WORKDIR]
    args += ["--remount-ro", "/"]  # last: everything above is made on the root first
    args += ["--seccomp", str(seccomp_fd), "--info-fd", str(info_fd)]
    return args


def bwrap_command(
    lay: Layer,
    *,
    code_fd: int,
    info_fd: int,
    seccomp_fd: int,
    disk_bytes: int,
    shm_bytes: int,
    launcher_limits: Mapping[str, object],
    cgroup_procs: str | None,
) -> list[str]:
    """The whole command of a bubblewrap sandbox: :data:`PRELAUNCHER`, bubblewrap, :data:`BWRAP_LAUNCHER`."""
    cfg = {"cgroup": cgroup_procs, "userns": not lay.as_root, "sysctls": ipc_sysctls(shm_bytes)}
    argv = [python(), "-I", "-S", "-c", PRELAUNCHER, json.dumps(cfg)]
    argv += bwrap_argv(
        lay, code_fd=code_fd, info_fd=info_fd, seccomp_fd=seccomp_fd, disk_bytes=disk_bytes, shm_bytes=shm_bytes
    )
    argv += [python(), "-I", "-S", "-c", BWRAP_LAUNCHER, json.dumps(launcher_limits), SOLUTION]
    return argv


def _probe_bwrap(as_root: bool) -> tuple[str | None, str | None]:
    """(bubblewrap's absolute path, None) when a sandbox starts here, else (path or None, why not)."""
    path = shutil.which("bwrap")
    if path is None:
        return None, f"bwrap is not installed ({INSTALL_HINT})"
    path = os.path.realpath(path)
    try:
        seccomp_fd = sandbox_seccomp.memfd()
    except sandbox_seccomp.SeccompUnavailable as err:
        return path, str(err)
    lay = Layer("bwrap", bwrap=path, as_root=as_root)
    probe = "import os\nprint(os.getuid())\n"
    code_fd = os.memfd_create("rollart-sandbox-probe")
    info_r, info_w = os.pipe()
    ready_r, ready_w = os.pipe()
    lease = UidLease.acquire() if as_root else None
    try:
        os.write(code_fd, probe.encode())
        os.lseek(code_fd, 0, os.SEEK_SET)
        limits = {"uid": lease.uid if lease else None, "nice": 0, "ready": ready_w}
        argv = bwrap_command(
            lay,
            code_fd=code_fd,
            info_fd=info_w,
            seccomp_fd=seccomp_fd,
            disk_bytes=1 << 20,
            shm_bytes=1 << 20,
            launcher_limits=limits,
            cgroup_procs=None,
        )
        try:
            done = subprocess.run(
                argv,
                check=False,
                capture_output=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin"},
                pass_fds=(code_fd, info_w, seccomp_fd, ready_w),
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            return path, f"bwrap failed to start: {err}"
    finally:
        for fd in (code_fd, info_r, info_w, seccomp_fd, ready_w):
            os.close(fd)
        os.set_blocking(ready_r, False)
        try:
            started = os.read(ready_r, 1) == b"1"
        except BlockingIOError:
            started = False
        os.close(ready_r)
        if lease is not None:
            lease.release()
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()[-300:]
        return path, f"bwrap cannot build a sandbox here: {why}"
    uid = done.stdout.decode().strip()
    if uid == "0" or not started:
        return path, "bwrap ran the code as root" if uid == "0" else "the sandbox's launcher did not say it started"
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
            if as_root and not world_readable_python():
                raise SandboxUnavailable(
                    f"--unsafe-no-sandbox with a server running as root runs code as a uid of its own, which "
                    f"cannot run the Python at {python()} (a folder above it is closed to other users) -- and "
                    f"running it as root is refused; {INSTALL_HINT} (used because: {why}), or run the server "
                    "with a Python every user can run (e.g. /usr/bin/python3)"
                )
            _layer = Layer(UNSAFE, as_root=as_root, why_not=why)
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
    """Whether any user can run this Python and import its standard library (not so for a Python under
    ``/root``)."""
    for target, need in ((python(), stat.S_IXOTH | stat.S_IROTH), (os.path.realpath(os.__file__), stat.S_IROTH)):
        try:
            if os.stat(target).st_mode & need != need:
                return False
            path = os.path.dirname(target)
            while path not in ("/", ""):
                if not os.stat(path).st_mode & stat.S_IXOTH:
                    return False
                path = os.path.dirname(path)
        except OSError:
            return False
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
