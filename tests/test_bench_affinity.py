"""`rollart bench affinity --quick`: a prefill-heavy and a decode-heavy task through the rollout path on
cost-equivalent pools of simulated H800 / H20 workers (each worker on its hardware's profile). The shape
asserted comes from the profiles (the bench's analytic model), and the measured side is the devices'
modelled busy time, not wall-clock time."""

import argparse
import json
from pathlib import Path

import pytest

from rollart.benchmarks import affinity
from rollart.engines.hardware import profile_for

pytestmark = pytest.mark.timeout(300)


def test_affinity_mapping_beats_reverse_and_homogeneous_pools_of_the_same_cost(ray_local, tmp_path):
    p = argparse.ArgumentParser()
    affinity.add_arguments(p)
    result = affinity.run(p.parse_args(["--quick", "--out", str(tmp_path)]))
    modes = result["modes"]
    assert list(modes) == ["affinity", "reverse", "h800-only", "h20-only", "auto"]
    # the premise, from the datasheets: H800 prefills faster per token, H20 decodes faster per step
    assert profile_for("H800").prefill_s_per_token < profile_for("H20").prefill_s_per_token
    assert profile_for("H20").decode_weights_s < profile_for("H800").decode_weights_s
    # cost-equivalent pools (seed Fig. 4: 1 H800 + 3 H20 ~ 2 H800 ~ 6 H20), within one H20 of each other
    costs = [m["cost"] for m in modes.values()]
    assert max(costs) - min(costs) <= 1.0
    model = {name: m["model"]["rollout_s"] for name, m in modes.items()}
    busy = {name: m["measured"]["max_device_busy_s"] for name, m in modes.items()}
    for other in ("reverse", "h800-only", "h20-only"):
        assert model["affinity"] < model[other], (other, model)
        assert busy["affinity"] < busy[other], (other, busy)
    # per task: the prefill task is quicker on H800 than on H20, the decode task on H20 than on H800
    mlat = {name: m["model"]["task_latency_s"] for name, m in modes.items()}
    assert mlat["affinity"]["Prefill"] < mlat["reverse"]["Prefill"]
    assert mlat["affinity"]["Decode"] < mlat["reverse"]["Decode"]
    # every trajectory of both tasks came back, with its latency and tokens counted
    for m in modes.values():
        assert set(lat_m := m["measured"]["task_latency_s"]) == {"Prefill", "Decode"} and min(lat_m.values()) > 0
        assert m["measured"]["trajectories_per_s"] > 0 and m["measured"]["output_tokens_per_s"] > 0
    # auto: the learning batch ran on the no-hint order (everything on H800); then each task went where
    # the static affinity mapping puts it, with the same modelled cost
    auto, static = modes["auto"]["measured"], modes["affinity"]["measured"]
    assert auto["learning_batch"]["hardware_by_tag"] == {"Decode": {"H800": 8}, "Prefill": {"H800": 8}}
    assert auto["hardware_by_tag"] == static["hardware_by_tag"] == {"Decode": {"H20": 8}, "Prefill": {"H800": 8}}
    assert modes["auto"]["mapping"] == {"*": ["H800", "H20"], "Decode": ["H20", "H800"]}
    assert model["auto"] == pytest.approx(model["affinity"])
    for other in ("reverse", "h800-only", "h20-only"):
        assert busy["auto"] < busy[other], (other, busy)
    saved = json.loads((tmp_path / "affinity.json").read_text())
    assert saved["modes"]["affinity"]["mapping"] == {"Prefill": ["H800"], "Decode": ["H20"]}
    assert saved["tasks"]["Prefill"]["trajectories"] == saved["tasks"]["Decode"]["trajectories"] == 8
    assert "| affinity |" in result["table"]
    assert Path(result["files"][0]).exists()
