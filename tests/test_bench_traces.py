"""rollart bench traces: the blocks it compares. Every counted step is traced in one run of a pair and
untraced in the other (so a step's own cost weighs on both sides), a block's first step and the warm-up
are never counted, and the differences are computed from the counted steps only."""

import pytest

from rollart.benchmarks.traces import compare, split, step_s, traced_steps


def test_the_second_run_traces_exactly_the_steps_the_first_left_untraced():
    first, second = traced_steps(40, 4, 8, 0), traced_steps(40, 4, 8, 1)
    counted = [s for s in range(40) if first[s] is not None]
    assert counted and all(second[s] is not None and second[s] != first[s] for s in counted)
    assert all(first[s] is None and second[s] is None for s in range(40) if s < 8 or s % 4 == 0)
    assert [first[s] for s in (9, 13, 17, 21)] == [False, True, False, True]  # untraced blocks first at phase 0
    with pytest.raises(SystemExit, match="--block"):
        traced_steps(40, 1, 0, 0)


def test_the_comparison_uses_the_counted_steps_of_each_side():
    plan = traced_steps(12, 3, 0, 0)  # blocks: 0-2 off, 3-5 on, 6-8 off, 9-11 on; 0, 3, 6, 9 left out
    records = [
        {"step": s + 1, "time": {"step_s": 1.0 if plan[s] is False else 1.1 if plan[s] else 50.0}} for s in range(12)
    ]
    on, off = split(records, plan, step_s)
    assert (on, off) == ([1.1] * 4, [1.0] * 4)
    result = compare(on, off)
    assert result["overhead_mean_pct"] == pytest.approx(10.0) and result["overhead_median_pct"] == pytest.approx(10.0)
    with pytest.raises(SystemExit, match="--steps"):
        compare([], off)
