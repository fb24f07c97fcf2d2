"""Hostile code against the code sandbox's memory and disk limits (rollart.reward.sandbox): SysV shared
memory filled and detached, ``fallocate`` on the captured output, a user namespace of its own with a
fresh tmpfs, and plain writes to every place of its file system -- each with the server running as root
and as an unprivileged user (``nobody``). Sizes stay modest (a few hundred MB tried at most)."""

from __future__ import annotations

import json
import platform
import shutil

import pytest
from security_fixtures import run_python_as

from rollart.reward import sandbox, sandbox_cgroup

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="the sandbox's isolation layer needs bubblewrap (apt-get install bubblewrap)",
    ),
]

SERVERS = ["root", "nobody"]

# eight 24 MB SysV segments, each attached, filled, detached (a detached segment is counted by no
# process's address space); prints the MB held at the end
SYSV_SHM = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
seg, held = 24 << 20, 0
for _ in range(8):
    sid = libc.shmget(0, seg, 0o1600)
    if sid < 0:
        break
    addr = libc.shmat(sid, None, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        break
    ctypes.memset(addr, 1, seg)
    libc.shmdt(addr)
    held += seg
print(held >> 20)
"""

# anonymous files (memfd): shared memory no mount's size limit sees, each file held open
MEMFD = r"""
import os
held, fds = 0, []
for i in range(40):
    try:
        fd = os.memfd_create("m%d" % i)
        os.write(fd, b"x" * (8 << 20))
    except OSError:
        break
    fds.append(fd)
    held += 8
print(held)
"""

# FALLOC_FL_KEEP_SIZE reserves disk without growing the file (no file-size limit sees it)
FALLOCATE = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
for fd in (1, 2):
    rc = libc.fallocate(fd, 1, 0, 256 << 20)
    sys.stderr.write("fallocate %d %d\n" % (fd, rc))
"""

CLONE = {"x86_64": 56, "aarch64": 220}.get(platform.machine())

# a user namespace of its own (full capabilities there), a tmpfs without the sandbox's size limit
NESTED_USERNS = rf"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x20000
results = {{}}
pid = libc.syscall({CLONE or -1}, CLONE_NEWUSER | 17, 0, 0, 0, 0) if {CLONE is not None} else -1
if pid == 0:
    os._exit(0)
if pid > 0:
    os.waitpid(pid, 0)
results["clone"] = pid > 0
uid, gid = os.getuid(), os.getgid()
results["unshare"] = libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) == 0
written = 0
if results["unshare"]:
    for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
    os.makedirs("big", exist_ok=True)
    if libc.mount(b"none", b"big", b"tmpfs", 0, b"size=512m") == 0:
        try:
            for i in range(20):
                with open("big/f%d" % i, "wb") as f:
                    f.write(b"x" * (8 << 20))
                written += 8
        except OSError:
            pass
results["written_mb"] = written
print(__import__("json").dumps(results))
"""

# up to 80 MB of 8 MB files in each place; prints the MB written per place
PLACES = ["/", "/dev", "/dev/shm", "/sandbox", "/proc", "/usr", "/tmp"]
PLAIN_WRITES = rf"""
import json, os
out = {{}}
for place in {PLACES!r}:
    n = 0
    for i in range(10):
        path = os.path.join(place, "fill%d" % i)
        try:
            with open(path, "wb") as f:
                f.write(b"x" * (8 << 20))
            n += 8
        except OSError:
            break
    out[place] = n
    for i in range(10):
        try:
            os.unlink(os.path.join(place, "fill%d" % i))
        except OSError:
            pass
print(json.dumps(out))
"""


@pytest.mark.parametrize("server", SERVERS)
def test_sysv_shared_memory_is_bounded(server: str) -> None:
    out = run_python_as(server, SYSV_SHM, disk_mb=32)
    assert out["returncode"] == 0, out["stderr"]
    held = int(out["stdout"])
    assert held <= sandbox.limits().shm_mb, f"{held} MB of SysV shared memory held past the limit"


@pytest.mark.parametrize("server", SERVERS)
def test_anonymous_files_do_not_hold_memory_past_the_limits(server: str) -> None:
    out = run_python_as(server, MEMFD, memory_mb=64)
    assert out["returncode"] == 0, out["stderr"]
    assert int(out["stdout"]) <= sandbox.limits().shm_mb, f"{out['stdout'].strip()} MB held in anonymous files"


# raise the IPC namespace's own limits from inside (the namespace's root uid is the server's, outside)
RAISE_IPC_LIMITS = r"""
import json
out = {}
for name in ("kernel/shmall", "kernel/shmmax", "kernel/shmmni", "kernel/msgmnb", "fs/mqueue/queues_max"):
    try:
        with open("/proc/sys/" + name, "w") as f:
            f.write("100000000")
        out[name] = "raised"
    except OSError:
        out[name] = "refused"
print(json.dumps(out))
"""


@pytest.mark.parametrize("server", SERVERS)
def test_the_sandbox_cannot_raise_its_own_ipc_limits(server: str) -> None:
    out = run_python_as(server, RAISE_IPC_LIMITS)
    assert set(json.loads(out["stdout"]).values()) == {"refused"}, out["stdout"]


@pytest.mark.parametrize("server", SERVERS)
def test_the_captured_output_is_no_file_to_fallocate(server: str) -> None:
    out = run_python_as(server, FALLOCATE)
    lines = out["stderr"].split("\n")
    assert "fallocate 1 -1" in lines and "fallocate 2 -1" in lines, out["stderr"]


@pytest.mark.parametrize("server", SERVERS)
def test_no_user_namespace_of_its_own_inside_the_sandbox(server: str) -> None:
    out = run_python_as(server, NESTED_USERNS, disk_mb=32)
    assert out["returncode"] == 0, out["stderr"]
    got = json.loads(out["stdout"])
    assert got == {"clone": False, "unshare": False, "written_mb": 0}


@pytest.mark.parametrize("server", SERVERS)
def test_only_size_limited_places_are_writable(server: str) -> None:
    out = run_python_as(server, PLAIN_WRITES, disk_mb=32)
    assert out["returncode"] == 0, out["stderr"]
    written = json.loads(out["stdout"])
    assert {p: written[p] for p in ("/", "/dev", "/sandbox", "/proc", "/usr")} == dict.fromkeys(
        ("/", "/dev", "/sandbox", "/proc", "/usr"), 0
    )
    assert 0 < written["/tmp"] <= 32  # the working directory: its size limit
    assert written["/dev/shm"] <= sandbox.limits().shm_mb


def test_the_memory_cgroup_is_detected_or_its_absence_explained() -> None:
    found = sandbox_cgroup.detect()
    if found.parent is None:  # this machine: say why, naming what would enable it
        assert found.reason and "cgroup" in found.reason
    else:
        assert "memory" in found.controllers


@pytest.mark.skipif(
    sandbox_cgroup.detect().parent is None,
    reason=f"no cgroup v2 memory controller to put sandboxes in here: {sandbox_cgroup.detect().reason}",
)
def test_the_memory_cgroup_bounds_the_sandbox_as_a_whole() -> None:
    # six processes of 40 MB each, every one within the per-process limit: together past the ceiling
    code = (
        "import os\nr, w = os.pipe()\ngo_r, go_w = os.pipe()\n"
        "for _ in range(6):\n    if os.fork() == 0:\n        x = bytearray(40 << 20)\n"
        "        os.write(w, b'k')\n        os.close(w)\n        os.read(go_r, 1)\n        os._exit(0)\n"
        "os.close(w)\nheld = 0\nwhile held < 6 and os.read(r, 1):\n    held += 1\nprint(held)\n"
    )
    out = sandbox.run_python(code, memory_mb=64, disk_mb=16)
    lim = sandbox.limits()
    ceiling = 64 + 16 + 2 * lim.shm_mb  # memory.max: what the limits let the sandbox hold in all
    assert out.returncode == 0 and int(out.stdout) * 40 <= ceiling, out
