"""The driver caps its glibc malloc arenas (rollart.resource_manager.allocator): with one arena per
thread a driver whose threads come and go kept growing under repeated worker restarts."""

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import ctypes, json, os, sys, threading

    def heaps():  # the arenas glibc reports (malloc_info's XML has one <heap> per arena)
        libc = ctypes.CDLL("libc.so.6")
        libc.open_memstream.restype = ctypes.c_void_p
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        fp = ctypes.c_void_p(libc.open_memstream(ctypes.byref(buf), ctypes.byref(size)))
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        return ctypes.string_at(buf, size.value).count(b"<heap nr=")

    cap = None
    if sys.argv[1] == "limit":
        from rollart.resource_manager.allocator import limit_malloc_arenas
        cap = limit_malloc_arenas()
    barrier = threading.Barrier(12)

    def work():
        keep = [bytearray(100_000) for _ in range(5)]  # noqa: F841  (allocated while all 12 live)
        barrier.wait()

    threads = [threading.Thread(target=work) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"cap": cap, "heaps": heaps(), "env": os.environ.get("MALLOC_ARENA_MAX")}))
    """
)


def probe(mode: str, env: dict[str, str]) -> dict:
    import json

    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def clean_env():
    if not os.path.exists("/usr/lib/x86_64-linux-gnu/libc.so.6") and not os.path.exists("/lib64/libc.so.6"):
        pytest.skip("glibc only")
    return {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}


def test_the_driver_caps_its_malloc_arenas_and_exports_the_cap(clean_env):
    assert probe("plain", clean_env)["heaps"] > 2  # glibc's default: an arena per thread, up to 8 per core
    capped = probe("limit", clean_env)
    assert capped == {"cap": 2, "heaps": 2, "env": "2"}  # and the processes it starts inherit it


def test_a_users_malloc_arena_max_is_kept(clean_env):
    assert probe("limit", {**clean_env, "MALLOC_ARENA_MAX": "4"}) == {"cap": 4, "heaps": 4, "env": "4"}
