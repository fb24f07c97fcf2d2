"""Batch splitting and the dispatch/collect plans, without Ray."""

import numpy as np
import pytest
import torch

import rollart as ra
from rollart.cluster.dispatch import collect, concat_results, plan_calls
from rollart.decorators.specs import RegisterSpec


def spec(mode, execute=ra.Execute.ALL):
    return RegisterSpec(dispatch=mode, execute=execute)


def test_batch_requires_equal_lengths_and_names_the_columns():
    with pytest.raises(ValueError, match="'a' has 3 rows, 'b' has 2"):
        ra.Batch({"a": torch.zeros(3), "b": [1, 2]})
    with pytest.raises(TypeError, match="column 'c'"):
        ra.Batch({"c": 5})


@pytest.mark.parametrize("rows, n", [(10, 3), (7, 4), (2, 4), (0, 3), (8, 8)])
def test_uneven_split_has_no_padding_and_concat_restores_order(rows, n):
    b = ra.Batch({"x": torch.arange(rows), "y": list(range(rows)), "z": np.arange(rows)}, meta={"step": 3})
    parts = b.split(n)
    sizes = [len(p) for p in parts]
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1
    back = ra.Batch.concat(parts)
    assert back["x"].tolist() == list(range(rows)) and back["y"] == list(range(rows))
    assert back["z"].tolist() == list(range(rows)) and back.meta == {"step": 3}


def test_dp_split_plan_skips_empty_ranks_and_broadcasts_other_args():
    b = ra.Batch({"x": torch.arange(3)})
    plan = plan_calls(spec(ra.Dispatch.DP_SPLIT), "c.m", 5, (b, 0.5), {})
    ran = [p for p in plan if p is not None]
    assert len(ran) == 3 and plan[3] is None and plan[4] is None
    assert [p[0][0]["x"].tolist() for p in ran] == [[0], [1], [2]]
    assert all(p[0][1] == 0.5 for p in ran)
    with pytest.raises(TypeError, match="no ra.Batch argument"):
        plan_calls(spec(ra.Dispatch.DP_SPLIT), "c.m", 2, (1,), {})


def test_all_to_all_needs_world_size_lists():
    plan = plan_calls(spec(ra.Dispatch.ALL_TO_ALL), "c.m", 2, ([1, 2],), {"k": ["a", "b"]})
    assert plan == [((1,), {"k": "a"}), ((2,), {"k": "b"})]
    with pytest.raises(ValueError, match="list of world_size=3 items"):
        plan_calls(spec(ra.Dispatch.ALL_TO_ALL), "c.m", 3, ([1, 2],), {})


def test_rank_zero_plans_one_call_and_returns_its_result():
    plan = plan_calls(spec(ra.Dispatch.ONE_TO_ALL, ra.Execute.RANK_ZERO), "c.m", 3, (1,), {})
    assert plan[0] == ((1,), {}) and plan[1:] == [None, None]
    assert collect(spec(ra.Dispatch.RANK_ZERO), ["r0"]) == "r0"


def test_concat_results_by_type():
    assert concat_results([[1], [2, 3]]) == [1, 2, 3]
    assert concat_results([torch.ones(2), torch.zeros(1)]).tolist() == [1, 1, 0]
    assert concat_results([{"loss": 1.0}, {"loss": 2.0}]) == {"loss": [1.0, 2.0]}
    assert concat_results([None, None]) is None
