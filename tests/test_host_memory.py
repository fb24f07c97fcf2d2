"""A train rank's host allocator gives freed tensors back: glibc's mmap threshold, fixed
(``train.host_mmap_threshold_mb``). Each case runs in a fresh process (the threshold is per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollart.training.config import TrainConfig

# allocate and free one 8 MB block (glibc's adaptive threshold rises to 8 MB), then 64 blocks of 4 MB,
# touch them and free every other one (the ones kept stop the heap from shrinking): how much of the
# 128 MB freed goes back to the system is what a training step's freed tensors give back
_PROBE = r"""
import ctypes, json, sys
if sys.argv[1] == "fixed":
    from rollart.training.host_memory import set_mmap_threshold
    assert set_mmap_threshold(1 << 20)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
libc.free(libc.malloc(8 << 20))
blocks = []
for _ in range(64):
    p = libc.malloc(4 << 20)
    ctypes.memset(p, 1, 4 << 20)
    blocks.append(p)
peak = rss()
for p in blocks[::2]:
    libc.free(p)
print(json.dumps({"returned_mb": (peak - rss()) / 2**20}))
"""


def _returned_mb(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)["returned_mb"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_fixed_mmap_threshold_gives_freed_large_blocks_back():
    adaptive, fixed = _returned_mb("adaptive"), _returned_mb("fixed")
    assert adaptive < 16, adaptive  # glibc's own threshold: the freed blocks stay resident
    assert fixed > 120, fixed  # the fixed 1 MB threshold: they went back to the system


def test_the_threshold_is_checked_by_name():
    assert TrainConfig().host_mmap_threshold_mb == 1
    assert TrainConfig(host_mmap_threshold_mb=None).host_mmap_threshold_mb is None
    for bad in (0, 64):
        with pytest.raises(ValueError, match="host_mmap_threshold_mb"):
            TrainConfig(host_mmap_threshold_mb=bad)
