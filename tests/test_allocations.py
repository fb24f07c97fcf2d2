"""Where a process's allocations grow (rollart.cluster.allocations, behind ``rollart bench soak
--tracemalloc-train`` and the workers' ``_rollart_allocations``): the line that kept memory is named."""

import pytest

from rollart.cluster.allocations import trace_allocations

KEPT: list[bytes] = []


def _keep(n: int) -> None:
    KEPT.extend(bytes(1000) + str(i).encode() for i in range(n))  # the line the report must name


def test_the_line_that_kept_memory_since_the_baseline_is_named_first():
    with pytest.raises(ValueError, match="unknown action"):
        trace_allocations("begin")
    trace_allocations("start", frames=4)
    try:
        with pytest.raises(ValueError, match="no baseline"):
            trace_allocations("grown")
        _keep(200)  # before the baseline: not growth
        trace_allocations("baseline")
        _keep(2000)
        rows, text = trace_allocations("grown")
    finally:
        trace_allocations("stop")
        KEPT.clear()
    top = rows[0]
    assert top["at"].endswith(f"test_allocations.py:{_keep.__code__.co_firstlineno + 1}"), rows[:3]
    assert top["blocks"] >= 2000 and 1900 < top["kb"] < 2300, top
    assert "KEPT.extend" in text  # the full traceback, source line included
