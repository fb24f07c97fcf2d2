"""Giving the pages of removed objects in a process's own Mooncake segment back to the system.

A process's segment is one anonymous mapping; the master places objects in it and reuses the space of
removed ones, but the pages an object once used stay resident after its removal. A publisher whose
readers hold leases keeps versions past their removal (until the lease runs out), so the master's
allocations spread over more and more of the segment, and without this the process's resident memory
climbs towards the whole segment (``weights.segment_mb``) however little is stored at any moment.

:func:`release` drops the whole pages inside removed ranges (``MADV_DONTNEED``: they read as zeros and
take no memory until written again). Only for a TCP segment: an RDMA segment is registered with the
NIC, which would keep the old pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
from collections.abc import Iterable

logger = logging.getLogger(__name__)

MADV_DONTNEED = 4  # linux/mman.h
_libc: ctypes.CDLL | None = None


def _madvise() -> ctypes._NamedFuncPointer:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def listening_ports() -> set[int]:
    """The TCP ports this process listens on (its own sockets, not only its network namespace's)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]  # noqa: SIM115 (read at once)
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def is_own_endpoint(endpoint: str) -> bool:
    """Whether a Mooncake transport endpoint (``host:port``) is this process's: it listens on that port.
    A segment's buffer addresses mean something in this process only when the segment is its own."""
    try:
        port = int(endpoint.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return False
    return port in listening_ports()


def whole_pages(addr: int, size: int) -> tuple[int, int]:
    """The page-aligned part of ``[addr, addr + size)``: start and length (0 when no whole page)."""
    page = mmap.PAGESIZE
    start = (addr + page - 1) // page * page
    end = (addr + size) // page * page
    return start, max(0, end - start)


def release(ranges: Iterable[tuple[int, int]]) -> int:
    """Drop the resident pages wholly inside each ``(address, size)`` of this process (removed objects:
    nothing reads or writes them any more); returns the bytes given back."""
    madvise = _madvise()
    released = 0
    for addr, size in ranges:
        start, length = whole_pages(addr, size)
        if not length:
            continue
        if madvise(start, length, MADV_DONTNEED) != 0:
            logger.debug("madvise(%#x, %d) failed: errno %d", start, length, ctypes.get_errno())
            continue
        released += length
    return released


__all__ = ["is_own_endpoint", "listening_ports", "release", "whole_pages"]
