"""Elastic rollout on namespace hosts: a job starts with one rollout host (``b``, one H20); a second host
(``d``, two H20) joins the Ray cluster mid-run; the job's elastic pool starts workers there, they load the
current weights and serve; then the host is drained with Ray's drain API (as an autoscaler marks a node for
removal), the workers there finish their requests and leave, Ray removes the idle node and the host is
deleted. The run ends with the trajectory ledger balanced, and, synchronous and seeded, its reward curve
equals a run on a fixed pool of one host step for step. Throughput and join time are measured by
``rollart bench elastic``."""

from __future__ import annotations

import pytest

from rollart.benchmarks.elastic import run_elastic
from rollart.testing import HostSpec, skip_reason, start_hosts

pytestmark = pytest.mark.timeout(1500)

STEPS, JOIN_AT, DRAIN_AT, JOINING = 8, 1, 4, 2


@pytest.fixture(scope="module")
def hosts():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    specs = [HostSpec("head", {"H800": 1}, num_cpus=2), HostSpec("b", {"H20": 1}, num_cpus=1)]
    with start_hosts(specs, start_timeout_s=300) as cluster:
        yield cluster


def test_a_host_joins_serves_is_drained_and_the_run_matches_a_fixed_pool(hosts, tmp_path):
    res = run_elastic(
        hosts, tmp_path / "elastic", steps=STEPS, seed=5, join_at=JOIN_AT, drain_at=DRAIN_AT, joining=JOINING
    )
    d_ip = res["harness"]["ip"]  # the host that joined
    events = res["events"]
    kinds = [e["event"] for e in events]
    # the host joined, its two workers started there and served the weights being served
    joined = [e for e in events if e["event"] == "joined"]
    assert len(joined) == JOINING and {e["node_ip"] for e in joined} == {d_ip}, events
    assert all(e["version"] >= JOIN_AT and e["join_s"] > 0 for e in joined), joined
    # they took requests: the LLMProxy routed to them by the same tag rules
    served = {int(r): v for r, v in res["served_by_rank"].items()}
    assert all(served[e["rank"]][1] > 0 for e in joined), served
    # drained: marked for removal, both left (finished their requests or moved them), the node went
    assert kinds.index("node_draining") < min(i for i, k in enumerate(kinds) if k == "left"), kinds
    left = [e for e in events if e["event"] == "left"]
    assert sorted(e["rank"] for e in left) == sorted(e["rank"] for e in joined)
    assert all(e["reason"] == "node_draining" for e in left)
    # Ray removed the idle drained node (seen by the harness: the run may end before the pool's next poll)
    assert res["harness"]["gone"] and res["harness"]["removed"], res["harness"]
    assert res["elastic_totals"] == {"joined": JOINING, "left": JOINING}, res["elastic_totals"]
    # per step the metrics record the pool's size and who joined and left
    sizes = [m["elastic"]["workers"] for m in res["metrics"]]
    assert sizes[0] == 1 and max(sizes) == 1 + JOINING and sizes[-1] == 1, sizes
    assert sum(m["elastic"]["joined"] for m in res["metrics"]) == JOINING
    assert sum(m["elastic"]["left"] for m in res["metrics"]) == JOINING
    # the ledger: nothing lost, nothing trained twice, no reward invented
    led = res["ledger"]
    assert led["started"] == led["trained"] + led["retried"] + led["failed"] + led["filtered"] + led["buffered"]
    assert led["in_flight"] == 0 and led["lost"] == 0 and led["trained_twice"] == 0
    assert led["rewards_invented"] == 0 and res["rewards_mismatch"] == 0 and res["unverifiable"] == 0
    assert len(res["metrics"]) == STEPS

    # the same seeded synchronous run on a fixed pool of one host: the reward curve is the same step for step
    fixed = run_elastic(hosts, tmp_path / "fixed", steps=STEPS, seed=5, fixed=True, join_at=JOIN_AT, drain_at=DRAIN_AT)
    assert not fixed["harness"] and "events" not in fixed  # no host joined that run
    curve = [m["reward_mean"] for m in res["metrics"]]
    assert curve == [m["reward_mean"] for m in fixed["metrics"]], (curve, [m["reward_mean"] for m in fixed["metrics"]])
    assert fixed["ledger"]["lost"] == 0 and fixed["ledger"]["trained_twice"] == 0


def test_a_vanished_host_goes_through_the_fault_path_and_the_pool_grows_back(hosts, tmp_path):
    """The joined host's processes are all killed mid-run: its workers' requests go to the live worker (the
    fault path), its workers leave the pool as lost (not restarted in place); when the host comes back the
    pool grows onto it again, and the run ends with the ledger balanced."""
    res = run_elastic(
        hosts, tmp_path / "lost", steps=STEPS, seed=6, join_at=JOIN_AT, lose_at=2, drain_at=DRAIN_AT, joining=JOINING
    )
    events = res["events"]
    kinds = [e["event"] for e in events]
    lost = [e for e in events if e["event"] == "lost"]
    assert len(lost) == JOINING and all(e["node_ip"] == res["harness"]["ip"] for e in lost), events
    assert "node_left" in kinds and kinds.index("node_left") <= max(i for i, k in enumerate(kinds) if k == "lost")
    joined = [e for e in events if e["event"] == "joined"]
    assert len(joined) == 2 * JOINING and kinds.index("lost") < [i for i, k in enumerate(kinds) if k == "joined"][-1]
    assert res["elastic_totals"] == {"joined": 2 * JOINING, "lost": JOINING, "left": JOINING}, res["elastic_totals"]
    assert sum(m["elastic"]["lost"] for m in res["metrics"]) == JOINING
    led = res["ledger"]
    assert led["started"] == led["trained"] + led["retried"] + led["failed"] + led["filtered"] + led["buffered"]
    assert led["in_flight"] == 0 and led["lost"] == 0 and led["trained_twice"] == 0
    assert led["rewards_invented"] == 0 and res["rewards_mismatch"] == 0 and res["unverifiable"] == 0
    assert len(res["metrics"]) == STEPS
