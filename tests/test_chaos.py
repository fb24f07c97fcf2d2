"""The chaos run (issue #13) on three namespace hosts: during an asynchronous run (alpha 1) with a seeded
schedule, an inference worker is SIGKILLed, every process of rollout host c is killed, the reward
service (a real ``rollart serve rewards`` process) is restarted, one env fail-stops and one
fail-slows, and train rank 0 is SIGKILLed. The run completes its steps, and the trajectory ledger
holds: with weights over the Ray channel, and over Mooncake with the relay tree (the killed host is a
relay child; the restarted trainer publishes under a channel name of its own)."""

import pytest

from rollart.benchmarks.chaos import (
    BATCH_GROUPS,
    FAULT_KINDS,
    KEEP,
    LOST_HOST,
    OPTIONAL_KINDS,
    run_chaos,
    schedule,
    summarise,
)
from rollart.rollout.ledger import trajectory_ledger

pytestmark = pytest.mark.timeout(900)

STEPS = 30
SEED = 3


def test_the_fault_schedule_is_seeded_and_spaced():
    a, b = schedule(FAULT_KINDS, STEPS, SEED), schedule(FAULT_KINDS, STEPS, SEED)
    assert a == b and sorted(a.values()) == sorted(FAULT_KINDS)
    steps = sorted(a)
    assert steps[0] >= 3 and steps[-1] <= STEPS - 2 and all(y - x >= 3 for x, y in zip(steps, steps[1:]))
    assert schedule(FAULT_KINDS, STEPS, SEED + 1) != a
    with pytest.raises(ValueError, match="need steps >="):
        schedule(FAULT_KINDS, 12, SEED)
    assert "trainer" in FAULT_KINDS and not OPTIONAL_KINDS


def test_the_ledger_accounts_for_every_trajectory_and_names_the_lost_ones():
    counts = {
        "trajectories_started": 20,
        "trajectories_trained": 9,
        "trajectories_aborted": 2,
        "trajectories_dropped": 3,
        "trajectories_evicted": 1,
        "trajectories_failed": 1,
        "trajectories_reward_failed": 1,
        "trajectories_filtered": 0,
    }
    led = trajectory_ledger(counts, buffered=2, in_flight=1)
    assert (led["retried"], led["failed"], led["lost"]) == (6, 2, 0)
    assert trajectory_ledger(counts, buffered=0, in_flight=1)["lost"] == 2


@pytest.mark.parametrize(("channel", "relay"), [("ray", False), ("mooncake", True)], ids=["ray", "mooncake-relay"])
def test_an_asynchronous_run_on_three_hosts_survives_the_chaos_schedule(hosts3, tmp_path, channel, relay):
    if channel == "mooncake":
        pytest.importorskip("mooncake.store")
    res = run_chaos(hosts3, tmp_path / "run", steps=STEPS, seed=SEED, kinds=FAULT_KINDS, channel=channel, relay=relay)
    s = summarise(res, alpha=1)
    led = res["ledger"]
    # every fault of the schedule was injected, and the run completed its steps
    assert sorted(s["injected"]) == sorted(FAULT_KINDS) and s["steps"] == STEPS, res["injected"]
    # the ledger: every trajectory started was trained, retried or reported failed; none lost, none
    # trained twice, no reward invented (each trained reward recomputed from response and ground truth)
    assert led["started"] == led["trained"] + led["retried"] + led["failed"] + led["filtered"] + led["buffered"]
    assert led["in_flight"] == 0 and led["lost"] == 0 and led["trained_twice"] == 0
    assert led["rewards_invented"] == 0 and res["rewards_mismatch"] == 0 and res["unverifiable"] == 0
    # every step trained its batch once; what a trainer restore undid was trained again, counted apart
    assert led["trained"] - led["rolled_back"] == STEPS * BATCH_GROUPS * KEEP
    assert res["metrics"][-1]["trainer_restarts"] == 1
    # the faults were felt: two deaths in the pool, env steps that hung or were slow (a hanging member
    # is failed after its timeout, or aborted as redundant once its round is complete: retried, or failed)
    assert res["faults"]["deaths"] >= 2, res["faults"]
    assert res["env_hangs"] >= 1 and res["env_slow_s"] > 0 and led["retried"] >= 1
    # staleness <= alpha at every step, from metrics.jsonl; the per-step ledger is there too
    assert all(m["max_staleness"] <= 1 for m in res["metrics"])
    assert all(m["ledger"]["trained_twice"] == 0 and m["ledger"]["rewards_invented"] == 0 for m in res["metrics"])
    # the reward still rises through the faults
    assert s["reward_last"] > s["reward_first"] + 0.1, [m["reward_mean"] for m in res["metrics"]]
    if relay:
        # until the kill, the lost host read every version from its relay parent's copy; the parent, the
        # root, read from the publisher before and after it, never falling back
        before = {c["node_ip"]: c for c in res["host_caches_before_kill"]}
        lost = before[hosts3.host(LOST_HOST).ip]
        assert lost["fetches"] and set(lost["sources"]) == {lost["relay_parent"]}, before
        [root] = [c for c in res["host_caches"] if c["node_ip"] == lost["relay_parent"]]
        assert root["relay_parent"] is None and set(root["sources"]) == {"publisher"}, root
        assert root["relay_fallbacks"] == 0 and root["fetches"][-1] > max(lost["fetches"]), root
        # the restarted trainer published under a channel of its own; the old one's host caches that are
        # left (tombstones until weights.timeout_s has passed) are retired, hold no version, load nothing
        [old_caches] = res["retired_channels"].values()
        assert all(c["retired"] and not c["cached"] and not c["loading"] for c in old_caches), old_caches


def test_soak_names_the_mappings_where_a_process_grew():
    """``mappings_mb`` / ``mapping_growth`` (what the soak reports per train rank): 48 MB allocated and
    touched between two samples of this process show up as anonymous memory grown by about that much."""
    import mmap
    import os

    from rollart.benchmarks.chaos import mappings_mb
    from rollart.benchmarks.soak import mapping_growth

    before = mappings_mb(os.getpid())
    # a new anonymous mapping, each page written (memory from the allocator may reuse pages this process
    # already has resident, and so not grow at all)
    block = mmap.mmap(-1, 48 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    after = mappings_mb(os.getpid())
    grown = mapping_growth({"train0:1": [(0.0, before), (1.0, before), (2.0, after)]})["train0:1"]
    first, last = grown["[anon] all"]
    assert 40 <= last - first <= 60, grown
    assert mappings_mb(2**22 + 7) is None  # a process that is gone
    block.close()


def test_soak_slopes_drop_start_up_and_short_series():
    from rollart.benchmarks.soak import slope, slopes

    assert slope([(0.0, 100.0), (60.0, 102.0), (120.0, 104.0)]) == pytest.approx(2.0)  # MB per minute
    flat = [(0.0, 500.0), (60.0, 200.0), (120.0, 200.0), (180.0, 200.0), (240.0, 200.0)]  # start-up sample first
    out = slopes({"driver:1": flat, "infer0:2": flat[:3]}, span_s=240.0)
    assert list(out) == ["driver:1"] and out["driver:1"]["mb_per_min"] == pytest.approx(0.0)
    # a warm-up step early in the series: the whole-series fit is positive, the second half is flat
    stepped = [(0.0, 500.0)] + [(60.0 * i, 448.0 if i < 4 else 452.0) for i in range(1, 13)]
    out = slopes({"train0:3": stepped}, span_s=720.0)["train0:3"]
    assert out["mb_per_min"] > 0.1 and out["settled_mb_per_min"] == pytest.approx(0.0)


def test_allocation_growth_names_the_line_that_allocated():
    """The soak's ``--tracemalloc`` report: what grew between two snapshots, by allocating line."""
    import tracemalloc

    from rollart.cluster.allocations import allocation_growth

    tracemalloc.start(4)
    try:
        base = tracemalloc.take_snapshot()
        kept = [bytearray(4096) for _ in range(64)]  # 256 KiB allocated on this line
        now = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    rows, text = allocation_growth(base, now)
    assert len(kept) == 64
    top = rows[0]
    assert "test_chaos.py:" in top["at"]
    assert top["kb"] >= 256 and top["blocks"] >= 64
    assert "bytearray(4096)" in text
