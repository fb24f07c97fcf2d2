"""Start and stop a ``mooncake_master`` process (RollArt paper §5.2, cross-cluster weights).

The master only keeps metadata (which client segment holds which key); the bytes live in the
segments that clients mount. rollart starts one master per job when the config gives no address,
bound to the driver's node IP (the head host; 127.0.0.1 on a one-machine Ray) on two free ports
there (RPC and metrics), and stops it by its process id when the job ends. Every host of the
cluster must reach the RPC port.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from rollart.resource_manager.net import free_port

logger = logging.getLogger(__name__)


class MooncakeUnavailable(RuntimeError):
    """The Mooncake package or one of its system libraries is missing."""


# shared libraries the Mooncake binaries link, and the Debian/Ubuntu package that installs each
DEBIAN_PACKAGES = {
    "libibverbs.so.1": "libibverbs1",
    "librdmacm.so.1": "librdmacm1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "libjsoncpp.so.25": "libjsoncpp25",
}


def missing_library(output: str) -> str | None:
    """The shared library the dynamic loader could not load, from a program's output
    (``error while loading shared libraries: libibverbs.so.1: cannot open shared object file``)."""
    found = re.search(r"error while loading shared libraries: ([^:\s]+)", output)
    return Path(found.group(1)).name if found else None


def library_fix(library: str) -> str:
    """How to install ``library``: the Debian/Ubuntu package when known."""
    package = DEBIAN_PACKAGES.get(library)
    if package is not None:
        return f"install it (Debian/Ubuntu: apt-get install {package}; the Mooncake store needs it even over TCP)"
    return f"install the package that provides it (Debian/Ubuntu: apt-file search {library})"


def find_master_binary() -> str:
    """The ``mooncake_master`` executable of the installed ``mooncake-transfer-engine`` package."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    try:
        import mooncake
    except ImportError as err:
        raise MooncakeUnavailable(
            "weights.channel=mooncake needs the Mooncake store: pip install 'rollart[mooncake]' "
            "(mooncake-transfer-engine-non-cuda on CPU machines) and apt-get install libibverbs1"
        ) from err
    candidate = Path(mooncake.__file__).parent / "mooncake_master"
    if candidate.exists():
        return str(candidate)
    raise MooncakeUnavailable("the mooncake package is installed but ships no mooncake_master binary")


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class MooncakeMaster:
    """A ``mooncake_master`` bound to ``host`` (an address of this machine every client can reach;
    default 127.0.0.1). ``address`` is what clients pass as ``master_server_address``."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        lease_ttl_ms: int = 5000,
        log_dir: str | Path | None = None,
    ):
        self.host = host
        self.port = port or free_port(host)
        self.metrics_port = free_port(host)
        self.lease_ttl_ms = lease_ttl_ms
        self.log_dir = Path(log_dir) if log_dir else None
        self._proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        cmd = [
            find_master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
        ]
        env = dict(os.environ)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / "mooncake_master.log", "ab+")  # noqa: SIM115 (owned by the process)
        else:  # kept (warnings and errors only) so that a failed start can say why
            out = tempfile.TemporaryFile()  # noqa: SIM115 (owned by the process)
            env.setdefault("GLOG_minloglevel", "1")
        start_at = out.seek(0, os.SEEK_END)
        # same process group as the job: a signal that ends the job ends its master too
        self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while not _accepts(self.host, self.port):
            if self._proc.poll() is not None:
                out.seek(start_at)
                raise MooncakeUnavailable(self._start_failure(cmd, out.read().decode(errors="replace")))
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mooncake_master did not listen on {self.address} within {timeout_s} s")
            time.sleep(delay)  # polling a port that is not open yet; bounded by the deadline
            delay = min(delay * 2, 0.5)
        logger.info("mooncake_master pid %d on %s", self._proc.pid, self.address)
        return self

    def _start_failure(self, cmd: list[str], output: str) -> str:
        """Why the master exited at start, with the fix when it is a missing shared library (exit 127)."""
        code = self._proc.returncode if self._proc is not None else None
        head = f"mooncake_master exited with code {code} at start"
        library = missing_library(output)
        if library is not None:
            return f"{head}: it cannot load the shared library {library}; {library_fix(library)}"
        last = " | ".join(line for line in output.strip().splitlines()[-3:] if line.strip())
        return f"{head} (command: {' '.join(cmd)})" + (f": {last}" if last else "")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self._proc.pid, 9)
                self._proc.wait(timeout=10)
        self._proc = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
