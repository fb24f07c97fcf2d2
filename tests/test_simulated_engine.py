"""The simulated engine's batching: paged-KV admission and preemption, token scaling, modelled time."""

from __future__ import annotations

import pytest

from rollart.engines.base import EngineRequest, SamplingParams
from rollart.engines.hardware import profile_for
from rollart.engines.simulated import SimulatedEngine


def _run(eng: SimulatedEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            done[out.request_id] = list(out.output_token_ids)
    return done


def _engine(**kw) -> SimulatedEngine:
    return SimulatedEngine(decode_base_s=1.0, decode_per_seq_s=0.0, prefill_per_token_s=0.01, time_scale=0.0, **kw)


def test_kv_capacity_preempts_the_newest_and_recomputes_it():
    eng = _engine(kv_capacity_tokens=10)
    eng.add_request(EngineRequest("a", [1, 2, 3, 4], SamplingParams(max_new_tokens=3)))
    eng.add_request(EngineRequest("b", [5, 6, 7, 8], SamplingParams(max_new_tokens=3)))
    assert eng.step() == []  # both fit: 4 + 1 and 4 + 1 tokens
    assert eng.preemptions == 0 and eng.sim_s == pytest.approx(1.0 + 0.08)
    eng.step()  # 5 + 1 and 5 + 1 > 10: b (the newest) goes back to the queue, a runs alone
    assert eng.preemptions == 1
    finished = eng.step()
    assert [o.request_id for o in finished] == ["a"]
    before = eng.sim_s
    eng.step()  # b rejoins: its prompt and its one token are prefilled again
    assert eng.sim_s - before == pytest.approx(1.0 + 0.05)
    rest = _run(eng)
    assert list(rest) == ["b"]
    # the preempted request continues the very sequence it would have produced without preemption
    free = _engine()
    free.add_request(EngineRequest("b", [5, 6, 7, 8], SamplingParams(max_new_tokens=3)))
    assert _run(free)["b"] == rest["b"]


def test_one_request_larger_than_the_capacity_still_runs():
    eng = _engine(kv_capacity_tokens=2)
    eng.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=4)))
    eng.add_request(EngineRequest("b", [1], SamplingParams(max_new_tokens=1)))
    out = _run(eng)
    assert len(out["a"]) == 4 and len(out["b"]) == 1


def test_abort_of_a_waiting_request():
    eng = _engine(max_batch_size=1)
    eng.add_request(EngineRequest("a", [1], SamplingParams(max_new_tokens=5)))
    eng.add_request(EngineRequest("b", [1], SamplingParams(max_new_tokens=5)))
    eng.step()
    out = eng.abort("b")
    assert out is not None and out.finish_reason == "abort" and out.output_token_ids == []
    assert list(_run(eng)) == ["a"]
    assert eng.abort("b") is None


def test_capacity_auto_is_what_the_device_holds_after_its_weights():
    p = profile_for("H800")
    eng = SimulatedEngine(profile="H800", kv_capacity_tokens="auto", time_scale=0.0)
    assert eng.kv_capacity_tokens == p.kv_capacity_tokens()
    # 80 GB at 90% use minus 16.4 GB of BF16 weights, over 144 KiB per token
    assert eng.kv_capacity_tokens == int((72e9 - 16.4e9) // (36 * 2 * 8 * 128 * 2))
    with pytest.raises(ValueError, match="kv_capacity_tokens: 'auto' reads the device of a profile"):
        SimulatedEngine(kv_capacity_tokens="auto")
    with pytest.raises(ValueError, match="token_scale=0"):
        SimulatedEngine(token_scale=0)


def test_token_scale_models_the_same_time_in_fewer_steps():
    fine = SimulatedEngine(profile="H20", time_scale=0.0)
    for i in range(8):
        fine.add_request(EngineRequest(f"r{i}", [1] * 400, SamplingParams(max_new_tokens=800 + 80 * i)))
    coarse = SimulatedEngine(profile="H20", time_scale=0.0, token_scale=40)
    for i in range(8):
        coarse.add_request(EngineRequest(f"r{i}", [1] * 10, SamplingParams(max_new_tokens=20 + 2 * i)))
    steps_fine = steps_coarse = 0
    while fine.has_unfinished():
        fine.step()
        steps_fine += 1
    while coarse.has_unfinished():
        coarse.step()
        steps_coarse += 1
    assert steps_fine == 40 * steps_coarse
    assert coarse.sim_s == pytest.approx(fine.sim_s, rel=0.02)
