"""Per-hardware profiles of the simulated engine (rollart.engines.hardware, RollArt paper Table 2)."""

import asyncio
from typing import Any

import pytest

from rollart.engines.base import EngineRequest, SamplingParams
from rollart.engines.hardware import HARDWARE, profile_for
from rollart.engines.simulated import SimulatedEngine
from rollart.rollout.engine_config import build_engine


def test_profiles_follow_the_datasheets():
    h800, h20 = profile_for("H800"), profile_for("H20")
    # compute-bound prefill: faster per token where the FLOPs are higher (989.5 vs 148 TFLOPs)
    assert h800.prefill_s_per_token < h20.prefill_s_per_token
    assert h20.prefill_s_per_token / h800.prefill_s_per_token == pytest.approx(989.5 / 148)
    # bandwidth-bound decode: faster per step where HBM is faster (4.0 vs 3.35 TB/s), and cheaper per byte
    assert h20.decode_weights_s < h800.decode_weights_s
    assert h20.kv_s_per_token < h800.kv_s_per_token
    assert h20.decode_weights_s * HARDWARE["H20"].cost < h800.decode_weights_s * HARDWARE["H800"].cost
    # a decode step of a rollout-sized batch is bandwidth-bound on both (memory term above compute term)
    for p in (h800, h20):
        assert p.step_s(0, 16, 16 * 1024) == pytest.approx(p.decode_weights_s + 16 * 1024 * p.kv_s_per_token)
        assert p.step_s(4096, 0, 0) == pytest.approx(4096 * p.prefill_s_per_token)


def test_engine_profile_from_config_and_errors():
    eng = build_engine({"kind": "simulated", "options": {"profile": "auto", "time_scale": 0.0}}, hardware="H20")
    assert isinstance(eng, SimulatedEngine) and eng.profile is not None and eng.profile.name == "H20"
    eng = build_engine({"kind": "simulated", "options": {"profile": "H800", "time_scale": 0.0}}, hardware="H20")
    assert eng.profile is not None and eng.profile.name == "H800"  # a named profile wins over the worker's
    with pytest.raises(ValueError, match="profile: 'auto'"):
        build_engine({"kind": "simulated", "options": {"profile": "auto"}})
    with pytest.raises(ValueError, match="drop \\['decode_base_s'\\]"):
        build_engine({"kind": "simulated", "options": {"profile": "H20", "decode_base_s": 0.1}})
    with pytest.raises(ValueError, match="no hardware profile for 'B200'"):
        build_engine({"kind": "simulated", "options": {"profile": "auto"}}, hardware="B200")


def test_engine_charges_the_profile_step_time():
    # time_scale 0: no sleeping, but busy_s still records the modelled time (0 × model), so use a tiny scale
    scale = 1e-3
    eng = SimulatedEngine(profile="H20", time_scale=scale)
    eng.add_request(EngineRequest("a", [1] * 1000, SamplingParams(max_new_tokens=2)))
    eng.step()
    p = profile_for("H20")
    first = p.step_s(1000, 1, 1000)
    assert eng.busy_s == pytest.approx(first * scale)
    eng.step()
    assert eng.busy_s == pytest.approx((first + p.step_s(0, 1, 1001)) * scale)
    assert not eng.has_unfinished()


async def _await(fut: Any) -> Any:
    return await fut


def test_worker_on_each_hardware_uses_its_profile(make_rm):
    import rollart as ra
    from rollart.rollout.inference_worker import inference_worker_class

    rm = make_rm({"rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 1}]})
    cls = inference_worker_class({"*": ["H20", "H800"]})
    engine = {"kind": "simulated", "options": {"profile": "auto", "time_scale": 0.0, "vocab_size": 50}}
    cluster = ra.Cluster("infer-profiles", cls, rm, pool="rollout", worker_kwargs={"engine": engine})
    try:
        metrics = asyncio.run(_await(cluster.metrics()))
        assert sorted((m["hardware"], m["engine_profile"]) for m in metrics) == [("H20", "H20"), ("H800", "H800")]
    finally:
        cluster.shutdown()
