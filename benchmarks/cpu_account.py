"""Where a benchmark's CPU time goes, per core, over a window of steps (Linux ``/proc/stat``).

A :class:`CoreSampler` thread reads every core's counters a few times a second; :func:`per_step`
turns the two samples that bracket a window into milliseconds per step per core: ``busy`` (user,
nice, system, irq, softirq), of it ``system`` and ``softirq`` (the kernel's share: a TCP transfer
shows here), and ``idle``. On namespace hosts pinned to cores (``HostSpec.cpus``) a core's numbers are
its hosts' own: a host whose core is never idle is CPU bound, and what a mode adds to its busy time per
step is what that mode costs the host.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq")
PROC_STAT = Path("/proc/stat")


def read_cores(path: Path = PROC_STAT) -> dict[int, tuple[int, ...]]:
    """Core -> its counters (clock ticks, in :data:`FIELDS` order); empty where there is no /proc."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    cores: dict[int, tuple[int, ...]] = {}
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            cores[int(name[3:])] = tuple(int(v) for v in values[: len(FIELDS)])
    return cores


class CoreSampler:
    """Samples :func:`read_cores` every ``every_s`` on a daemon thread, with ``time.monotonic`` stamps,
    from :meth:`start` until :meth:`stop`."""

    def __init__(self, every_s: float = 0.1, path: Path = PROC_STAT):
        self.every_s = every_s
        self.path = path
        self.samples: list[tuple[float, dict[int, tuple[int, ...]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="core-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), read_cores(self.path)))
            if self._stop.wait(self.every_s):
                return

    def start(self) -> CoreSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic(), read_cores(self.path)))

    def per_step(self, t0: float, t1: float, steps: int) -> dict[int, dict[str, float]]:
        return per_step(self.samples, t0, t1, steps)


def per_step(
    samples: list[tuple[float, dict[int, tuple[int, ...]]]], t0: float, t1: float, steps: int
) -> dict[int, dict[str, float]]:
    """Milliseconds per step per core between the last sample at or before ``t0`` and the first at or
    after ``t1`` (so the window covers the steps; a sampling period more at most); empty when the
    samples do not bracket the window or hold no cores."""
    stamps = [t for t, _ in samples]
    i, j = bisect.bisect_right(stamps, t0) - 1, bisect.bisect_left(stamps, t1)
    if i < 0 or j >= len(samples) or steps <= 0:
        return {}
    (_, a), (_, b) = samples[i], samples[j]
    ms_per_tick = 1000.0 / os.sysconf("SC_CLK_TCK")
    out: dict[int, dict[str, float]] = {}
    for core in sorted(a.keys() & b.keys()):
        d = dict(zip(FIELDS, (y - x for x, y in zip(a[core], b[core]))))
        busy = d["user"] + d["nice"] + d["system"] + d["irq"] + d["softirq"]
        out[core] = {
            "busy": busy * ms_per_tick / steps,
            "system": d["system"] * ms_per_tick / steps,
            "softirq": d["softirq"] * ms_per_tick / steps,
            "idle": (d["idle"] + d["iowait"]) * ms_per_tick / steps,
        }
    return out
