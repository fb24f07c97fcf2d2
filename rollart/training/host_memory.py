"""How a train rank's host allocator hands memory back: glibc's mmap threshold.

glibc serves an allocation from ``mmap`` (given back to the OS when freed) only above its mmap threshold,
and it raises that threshold to the size of every mmapped block that is freed, up to 32 MB. A training
step frees many tensors of a few MB (gathered layers, activations, reduce-scatter buffers), so after
the first step such tensors come from the heap, whose freed memory stays resident and fragments: at the
Qwen2.5-0.5B shape on 4 FSDP CPU ranks a rank's peak RSS was 4.1-4.3 GiB with glibc's adaptive
threshold and 2.9 GiB with a fixed 1 MB one (docs/benchmarks.md, "Training memory").
:func:`set_mmap_threshold` fixes it (``train.host_mmap_threshold_mb``); a libc other than glibc is left
as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve allocations of at least ``nbytes`` from ``mmap`` and stop glibc from raising the threshold;
    True when glibc took it."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no glibc mallopt here: the host allocator keeps its own threshold")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, int(nbytes)))
    log.debug("glibc mmap threshold %d bytes: %s", nbytes, "set" if ok else "refused")
    return ok


__all__ = ["set_mmap_threshold"]
