"""rollart advise: the train/rollout split of ROLL Flash Prop. 2, its simulation, the profile it reads, and
the command on the quickstart (a real short run)."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys

import pytest

from rollart.planning.partition import (
    SampleTimes,
    Workload,
    advised_split,
    async_bound,
    beta_star,
    simulate,
    sweep,
    sync_bound,
)
from rollart.planning.profile import ProfileError, workload_from_records


def test_beta_star_is_eq_10_and_balances_the_two_sides_of_the_bound():
    w = Workload(samples_per_step=256, mu_gen=0.02, l_gen=0.3, mu_train=0.01, epochs=1, alpha=1)
    k = 16
    # E N mu_train / (N mu_gen + K L / (alpha + 1) + E N mu_train) = 2.56 / (5.12 + 2.4 + 2.56)
    assert beta_star(w, k) == pytest.approx(2.56 / 10.08)
    b = beta_star(w, k)
    gen = 256 * 0.02 / ((1 - b) * k) + 0.3 / (2 * (1 - b))
    train = 256 * 0.01 / (b * k)
    assert gen == pytest.approx(train)
    assert advised_split(w, k) == 4  # 0.254 * 16 = 4.06
    with pytest.raises(ValueError, match="train_devices"):
        async_bound(w, k, 0)


def test_without_a_tail_the_simulated_best_split_is_the_beta_star_split():
    rng = random.Random(0)
    for _ in range(12):
        mu = rng.uniform(0.005, 0.2)
        w = Workload(rng.choice([64, 256]), mu, mu, rng.uniform(0.002, 0.1), epochs=rng.choice([1, 2]), alpha=1)
        k = rng.choice([4, 8, 16])
        table = sweep(w, k, seeds=(0,))
        best = min(table, key=lambda r: r.simulated_step_s)
        assert abs(best.train_devices - advised_split(w, k)) <= 1, (w, k, table)


def test_a_synchronous_step_is_simulated_within_its_bound():
    rng = random.Random(1)
    for i in range(40):
        mu = rng.uniform(0.005, 0.2)
        w = Workload(rng.choice([16, 64, 256]), mu, mu * rng.uniform(1, 40), rng.uniform(0.001, 0.1))
        k = rng.choice([2, 4, 16])
        assert simulate(w, k, None, steps=30, seed=i) <= sync_bound(w, k) * 1.001


def test_with_alpha_the_tail_is_hidden_and_the_advice_beats_the_bounds_split():
    """The bound charges the longest sample to every step (divided by alpha + 1); queue scheduling with
    alpha = 1 overlaps it with the next step's samples. With a tail 20x the mean the simulated best
    split runs at the throughput of its two sides, and the beta* split trains on too few devices."""
    w = Workload(samples_per_step=256, mu_gen=0.05, l_gen=1.0, mu_train=0.01, epochs=1, alpha=1)
    k = 16
    table = sweep(w, k)
    best = min(table, key=lambda r: r.simulated_step_s)
    throughput = max(256 * 0.05 / best.rollout_devices, 256 * 0.01 / best.train_devices)
    assert best.simulated_step_s <= 1.15 * throughput
    star = table[advised_split(w, k) - 1]
    assert star.train_devices < best.train_devices
    assert star.simulated_step_s > 1.1 * best.simulated_step_s


def test_sample_times_interpolate_their_quantiles_and_keep_the_shape_when_scaled():
    s = SampleTimes((0.0, 0.5, 1.0), (1.0, 2.0, 6.0))
    assert s.at(0.25) == pytest.approx(1.5)
    assert s.at(0.75) == pytest.approx(4.0)
    assert s.mean == pytest.approx(0.5 * 1.5 + 0.5 * 4.0)
    t = s.scaled(1.0)
    assert t.mean == pytest.approx(1.0)
    assert t.max / t.values[0] == pytest.approx(6.0)
    assert (s.at(0.0), s.at(1.0), s.max) == (1.0, 6.0, 6.0)
    with pytest.raises(ValueError, match="probs"):
        SampleTimes((0.1, 1.0), (1.0, 2.0))
    with pytest.raises(ValueError, match="rising"):
        SampleTimes((0.0, 1.0), (2.0, 1.0))


def _record(step: int, wait: float, train: float, sync: float, n: int, q: list[float]) -> dict:
    return {
        "step": step,
        "time": {"rollout_wait_s": wait, "train_s": train, "weight_sync_s": sync},
        "by_tag": {"t": {"trajectories": n, "trajectory_s_mean": q[2], "trajectory_s_quantiles": q}},
    }


def test_the_profile_turns_step_times_into_per_sample_device_times():
    q = [0.1, 0.2, 0.3, 0.4, 0.6, 1.2]
    records = [_record(1, 9.0, 9.0, 9.0, 64, q)] + [_record(s, 0.8, 0.3, 0.02, 64, q) for s in (2, 3, 4)]
    w, m = workload_from_records(records, rollout_devices=2, train_devices=1, epochs=2, alpha=1)
    assert m.steps == 3 and m.samples_per_step == 64  # the first step (warm-up) left out
    assert w.mu_gen == pytest.approx(2 * 0.8 / 64)
    assert w.mu_train == pytest.approx(1 * 0.32 / (2 * 64))
    assert w.shape is not None and w.shape.mean == pytest.approx(w.mu_gen)
    assert w.l_gen / w.mu_gen == pytest.approx(1.2 / SampleTimes((0.0, 0.25, 0.5, 0.75, 0.9, 1.0), tuple(q)).mean)
    with pytest.raises(ProfileError, match="--steps"):
        workload_from_records(records[:1], rollout_devices=1, train_devices=1, epochs=1, alpha=1)


def _advise(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "rollart.cli", "advise", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )


def test_bad_advise_input_is_refused_before_anything_starts(tmp_path):
    res = _advise("quickstart", "--alpha", "0", cwd=tmp_path)
    assert res.returncode == 2 and "--alpha" in res.stderr
    res = _advise("quickstart", "--set", "rollout.group_sise=4", cwd=tmp_path)
    assert res.returncode == 2 and "group_sise" in res.stderr
    assert "starting a local Ray" not in res.stderr


def test_advise_profiles_the_quickstart_and_advises_the_best_simulated_split(tmp_path):
    out = tmp_path / "profile"
    res = _advise("quickstart", "--steps", "3", "--devices", "8", "--out", str(out), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result == json.loads((out / "advise.json").read_text())
    assert result["devices"] == 8 and result["alpha"] == 1  # the quickstart is synchronous: planned for 1
    prof, w = result["profile"], result["workload"]
    assert prof["steps"] == 2 and prof["samples_per_step"] == 256  # 32 groups x 8, the warm-up step left out
    assert w["mu_gen"] > 0 and w["mu_train"] > 0 and w["l_gen"] >= w["mu_gen"]
    a = result["advice"]
    assert a["train_devices"] + a["rollout_devices"] == 8
    sim = result["simulated_step_s"]
    assert a["mode"] == ("sync" if sim["sync"] < sim["async"] else "async")
    table = result["sweep"]
    assert [r["train_devices"] for r in table] == list(range(1, 8))
    best = min(table, key=lambda r: r["simulated_step_s"])
    assert a["train_devices"] == best["train_devices"]
    assert result["beta_star_split"]["vs_advice"] >= 1.0
    # the profile's own numbers, read back from its metrics: rollout wait per sample on 1 rollout device
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(s["max_staleness"] == 0 for s in steps)  # profiled synchronously
    assert w["mu_gen"] == pytest.approx(statistics.median(s["time"]["rollout_wait_s"] for s in steps[1:]) / 256)
