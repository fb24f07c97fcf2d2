"""glibc malloc arenas of rollart's processes.

glibc gives a thread its own malloc arena (up to 8 per core); memory freed in one arena is reused
only by the threads of that arena. A driver whose threads come and go (Ray's, the restarts of
workers) spreads its allocations over many arenas and its resident memory creeps up. Measured
(README, "Soak"): 19 SIGKILLs of an inference worker in 10 minutes grew the driver +0.31 MB/min with
glibc's default, +0.09 MB/min (the no-fault level) with two arenas.

rollart therefore caps the arenas at ``MALLOC_ARENA_MAX`` = 2 unless the variable is set: in the
driver through ``mallopt`` (glibc reads the variable only when a process starts), and for the
processes of a local Ray (they inherit it). A cluster started with ``ray start`` takes the variable
from the environment of ``ray start``. Set ``MALLOC_ARENA_MAX`` yourself to choose another cap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

DEFAULT_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def limit_malloc_arenas(default: int = DEFAULT_ARENAS) -> int | None:
    """Cap this process's malloc arenas (``MALLOC_ARENA_MAX`` if set, else ``default``) and export the
    variable for the processes it starts. Returns the cap in force, or None where the C library is not
    glibc. Call it before many threads exist: glibc fixes its limit once it has more than 8 arenas."""
    env = os.environ.get("MALLOC_ARENA_MAX")
    if env is not None:
        try:
            return int(env)  # glibc applied it when this process started
        except ValueError:
            log.warning("MALLOC_ARENA_MAX=%r is not a number; glibc ignores it", env)
            return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to cap
        return None
    if mallopt(_M_ARENA_MAX, default) != 1:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", default)
        return None
    os.environ["MALLOC_ARENA_MAX"] = str(default)
    return default
