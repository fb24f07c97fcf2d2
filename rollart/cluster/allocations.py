"""Where a process's Python allocations grow, between two :mod:`tracemalloc` snapshots.

``rollart bench soak --tracemalloc FRAMES`` traces the driver; ``--tracemalloc-train FRAMES`` also the train
ranks, through :meth:`rollart.cluster.worker.Worker._rollart_allocations`, which drives
:func:`trace_allocations` in the worker's own process. Tracing slows the traced process (every allocation
records its traceback): for finding a leak, not for a run that measures speed.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

_baseline: list[tracemalloc.Snapshot] = []  # this process's baseline snapshot, once taken


def allocation_growth(
    base: tracemalloc.Snapshot, now: tracemalloc.Snapshot, top: int = 60
) -> tuple[list[dict[str, Any]], str]:
    """The allocations that grew between two snapshots, grouped by their allocating traceback: the ``top``
    largest as records (KiB, blocks, the innermost frame) and as text (full tracebacks)."""
    drop = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    diff = now.filter_traces(drop).compare_to(base.filter_traces(drop), "traceback")
    grown = [d for d in diff if d.size_diff > 0][:top]
    rows, text = [], []
    for d in grown:
        frame = d.traceback[-1] if len(d.traceback) else None
        rows.append(
            {
                "kb": round(d.size_diff / 1024, 1),
                "blocks": d.count_diff,
                "at": f"{frame.filename}:{frame.lineno}" if frame else "?",
            }
        )
        text.append(f"+{d.size_diff / 1024:.1f} KiB in {d.count_diff:+d} blocks")
        text.extend(f"    {line}" for line in d.traceback.format(most_recent_first=True))
    return rows, "\n".join(text) + "\n"


def trace_allocations(action: str, frames: int = 12, top: int = 60) -> tuple[list[dict[str, Any]], str] | None:
    """In this process: ``"start"`` tracing (``frames`` frames per allocation), take the ``"baseline"``
    snapshot, report what ``"grown"`` since the baseline (:func:`allocation_growth`; ``ValueError``
    without one), or ``"stop"`` tracing (and forget the baseline). Only ``"grown"`` returns something."""
    if action == "start":
        if not tracemalloc.is_tracing():
            tracemalloc.start(frames)
        return None
    if action == "baseline":
        _baseline[:] = [tracemalloc.take_snapshot()]
        return None
    if action == "grown":
        if not _baseline:
            raise ValueError("no baseline: call trace_allocations('baseline') first")
        return allocation_growth(_baseline[0], tracemalloc.take_snapshot(), top)
    if action == "stop":
        tracemalloc.stop()
        _baseline.clear()
        return None
    raise ValueError(f"trace_allocations: unknown action {action!r}; use 'start', 'baseline', 'grown' or 'stop'")
