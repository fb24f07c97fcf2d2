"""A cgroup v2 per code sandbox, where the machine offers one with the memory controller: :func:`support`
finds (once per process) the folder sandboxes are created in, :class:`SandboxCgroup` is one sandbox's.

A sandbox's cgroup holds every process of the sandbox from before bubblewrap starts (the sandbox's
first process moves itself in) and bounds, in all, what its limits allow at once:

- ``memory.max``: ``memory_mb + disk_mb + 2 * shm_mb`` -- processes, the tmpfs at ``/tmp`` and
  ``/dev/shm`` and SysV shared memory together (the kernel charges tmpfs pages and shared memory to the
  cgroup that wrote them); ``memory.swap.max`` 0;
- ``pids.max``: ``max_processes`` (with the pids controller);
- ``cpu.weight``: every sandbox the same weight, so CPU is shared per sandbox, not per process (with
  the cpu controller); ``cpu.stat`` and ``cpu.pressure`` say how much CPU it used and how long it
  waited for one;
- ``cgroup.kill`` ends every process of it at once (Linux 5.14+; else each is killed by pid).

Where sandboxes go:

- ``ROLLART_SANDBOX_CGROUP=/sys/fs/cgroup/PATH``: a cgroup delegated to the server's user (systemd:
  ``Delegate=yes``), with no process of its own;
- else, for a server running as root, ``rollart-sandbox`` under the cgroup v2 root (created, with the
  memory, pids and cpu controllers enabled for it);
- else none: the per-process limits hold (see ``docs/security.md``) and :attr:`CgroupSupport.reason`
  says why there is no cgroup.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

CGROUP_ENV = "ROLLART_SANDBOX_CGROUP"
AUTO_NAME = "rollart-sandbox"
WANTED = ("memory", "pids", "cpu")


@dataclass(frozen=True)
class CgroupSupport:
    """Where sandbox cgroups are created (``parent``; None: nowhere, and ``reason`` says why)."""

    parent: str | None
    controllers: frozenset[str] = frozenset()
    reason: str = ""


def _cgroup2_mounts(mountinfo: str) -> list[str]:
    out: list[str] = []
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        head, sep, tail = line.partition(" - ")
        if sep and tail.split(" ", 1)[0] == "cgroup2":
            out.append(head.split(" ")[4].replace("\\040", " "))
    return out


def _v1_controllers(mountinfo: str) -> list[str]:
    out = []
    with contextlib.suppress(OSError), open(mountinfo) as f:
        for line in f:
            head, sep, tail = line.partition(" - ")
            fields = tail.split()
            if sep and fields and fields[0] == "cgroup" and len(fields) >= 3:
                out += [o for o in fields[2].split(",") if o in ("memory", "cpu", "pids")]
    return sorted(set(out))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enable(folder: str, controllers: set[str]) -> set[str]:
    """Enable ``controllers`` for the children of ``folder`` (those it has); the ones enabled."""
    have = set(_read(os.path.join(folder, "cgroup.controllers")).split())
    on = set(_read(os.path.join(folder, "cgroup.subtree_control")).split())
    for c in sorted((controllers & have) - on):
        with contextlib.suppress(OSError):
            _write(os.path.join(folder, "cgroup.subtree_control"), f"+{c}")
    return set(_read(os.path.join(folder, "cgroup.subtree_control")).split()) & controllers


def detect(
    *, mountinfo: str = "/proc/self/mountinfo", environ: Mapping[str, str] | None = None, euid: int | None = None
) -> CgroupSupport:
    """Find (and prepare) the cgroup sandboxes are created in; never raises."""
    environ = os.environ if environ is None else environ
    euid = os.geteuid() if euid is None else euid
    mounts = _cgroup2_mounts(mountinfo)
    if not mounts:
        v1 = _v1_controllers(mountinfo)
        return CgroupSupport(
            None,
            reason="no cgroup v2 file system is mounted"
            + (f" (cgroup v1 only, with {', '.join(v1)}: not used)" if v1 else ""),
        )
    root = mounts[0]
    wanted = environ.get(CGROUP_ENV, "").strip()
    try:
        if wanted:
            parent = os.path.realpath(wanted)
            if not any(parent == m or parent.startswith(m.rstrip("/") + "/") for m in mounts):
                return CgroupSupport(None, reason=f"{CGROUP_ENV}={wanted!r} is not under a cgroup v2 mount ({root})")
            if not os.path.isdir(parent):
                return CgroupSupport(None, reason=f"{CGROUP_ENV}={wanted!r}: no such cgroup")
        elif euid != 0:
            return CgroupSupport(
                None,
                reason=f"the server is not root: name a cgroup v2 delegated to its user in {CGROUP_ENV} "
                "(systemd: a unit with Delegate=yes) to give each sandbox a memory cgroup",
            )
        else:
            have = set(_read(os.path.join(root, "cgroup.controllers")).split())
            if "memory" not in have:
                return CgroupSupport(
                    None,
                    reason=f"cgroup v2 at {root} offers no memory controller "
                    f"(cgroup.controllers: {' '.join(sorted(have)) or 'none'})",
                )
            if "memory" not in _enable(root, set(WANTED)):
                return CgroupSupport(
                    None, reason=f"cannot enable the memory controller in {root}/cgroup.subtree_control"
                )
            parent = os.path.join(root, AUTO_NAME)
            os.makedirs(parent, exist_ok=True)
        if "memory" not in set(_read(os.path.join(parent, "cgroup.controllers")).split()):
            return CgroupSupport(None, reason=f"cgroup {parent} has no memory controller")
        enabled = _enable(parent, set(WANTED))
        if "memory" not in enabled:
            return CgroupSupport(
                None,
                reason=f"cannot enable the memory controller for the children of {parent} (it must hold no process)",
            )
        probe = os.path.join(parent, f"probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(probe)
        try:
            _write(os.path.join(probe, "memory.max"), str(64 << 20))
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(probe)
    except OSError as err:
        return CgroupSupport(None, reason=f"cgroup v2 at {root} is not usable for sandboxes: {err}")
    return CgroupSupport(parent, frozenset(enabled), reason=f"a cgroup per sandbox under {parent}")


@functools.cache
def support() -> CgroupSupport:
    """:func:`detect` once per process."""
    found = detect()
    log.debug("sandbox cgroups: %s", found.reason)
    return found


class SandboxCgroup:
    """One sandbox's cgroup: created with its limits, joined by the sandbox's first process (it writes
    its pid to :attr:`procs`), killed and removed when the sandbox ends."""

    def __init__(self, path: str, controllers: frozenset[str]):
        self.path, self.controllers = path, controllers
        self.procs = os.path.join(path, "cgroup.procs")

    @classmethod
    def create(cls, found: CgroupSupport, *, memory_bytes: int, max_processes: int) -> SandboxCgroup:
        assert found.parent is not None
        path = os.path.join(found.parent, f"sandbox-{uuid.uuid4().hex}")
        os.mkdir(path)
        group = cls(path, found.controllers)
        try:
            _write(os.path.join(path, "memory.max"), str(memory_bytes))
            with contextlib.suppress(OSError):  # no swap accounting on this kernel: nothing to bound
                _write(os.path.join(path, "memory.swap.max"), "0")
            if "pids" in found.controllers:
                _write(os.path.join(path, "pids.max"), str(max_processes + 2))  # + bubblewrap's two
            if "cpu" in found.controllers:
                _write(os.path.join(path, "cpu.weight"), "100")
        except OSError:
            group.remove()
            raise
        return group

    def usage(self) -> tuple[float, float] | None:
        """(CPU seconds used, seconds some process of it waited for a CPU), or None if unreadable."""
        try:
            stat = dict(line.split() for line in _read(os.path.join(self.path, "cpu.stat")).splitlines())
            cpu = int(stat["usage_usec"]) / 1e6
            some = _read(os.path.join(self.path, "cpu.pressure")).splitlines()[0]
            waited = int(dict(kv.split("=") for kv in some.split()[1:])["total"]) / 1e6
        except (OSError, KeyError, ValueError, IndexError):
            return None
        return cpu, waited

    def kill(self) -> None:
        """Kill every process of the cgroup."""
        try:
            _write(os.path.join(self.path, "cgroup.kill"), "1")
            return
        except OSError:
            pass
        for _ in range(100):  # before cgroup.kill (Linux < 5.14): by pid, until none is left
            try:
                pids = [int(p) for p in _read(self.procs).split()]
            except (OSError, ValueError):
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        """Remove the cgroup once its last process is gone (the caller killed them: a few ms at most)."""
        end = time.monotonic() + 5.0
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as err:  # EBUSY: a killed process not yet gone
                if err.errno != errno.EBUSY or time.monotonic() > end:
                    log.warning("sandbox cgroup %s not removed: %s", self.path, err)
                    return
            time.sleep(0.01)
