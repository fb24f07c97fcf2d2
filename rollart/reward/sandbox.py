"""Run untrusted code in a subprocess: time and memory limits, no network, a throw-away directory.

Limits: ``RLIMIT_CPU`` (CPU seconds) and a wall-clock timeout (the whole process group is killed),
``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (files written), ``RLIMIT_NPROC`` where allowed. No
network: the child runs in a new network namespace (``unshare --net``) when the machine allows it,
and in every case a Python audit hook refuses ``socket.*`` and ``subprocess``/``os.system`` events.
The working directory is a fresh temporary directory removed afterwards.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_GUARD = r'''
import sys
def _deny(event, args):
    if event.startswith("socket.") or event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork"):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_deny)
del _deny
source = open(sys.argv[1]).read()
exec(compile(source, "solution.py", "exec"), {"__name__": "__main__"})
'''


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_by: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--net", "--map-root-user", "true"], capture_output=True,
                              timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_UNSHARE = None


def run_python(code: str, stdin: str = "", *, timeout_s: float = 5.0, memory_mb: int = 256,
               max_output_bytes: int = 1_000_000) -> SandboxResult:
    """Run ``code`` with ``stdin``; never raises for the code's own failures."""
    global _UNSHARE
    if _UNSHARE is None:
        _UNSHARE = _unshare_available()

    def limits() -> None:
        os.setsid()
        cpu = max(1, int(timeout_s) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000_000, 10_000_000))

    with tempfile.TemporaryDirectory(prefix="rollart-sandbox-") as work:
        path = os.path.join(work, "solution.py")
        with open(path, "w") as f:
            f.write(code)
        cmd = [sys.executable, "-I", "-S", "-c", _GUARD, path]
        if _UNSHARE:
            cmd = ["unshare", "--net", "--map-root-user", *cmd]
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, cwd=work, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, preexec_fn=limits)
        try:
            out, err = proc.communicate(stdin.encode(), timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
        killed = None
        if proc.returncode is not None and proc.returncode < 0:
            killed = signal.Signals(-proc.returncode).name
        return SandboxResult(proc.returncode if proc.returncode is not None else -9,
                             out[:max_output_bytes].decode(errors="replace"),
                             err[:max_output_bytes].decode(errors="replace"), timed_out, killed)
