"""One state per worker (rollart.cluster.membership): the transitions a rank may make, and routing that
follows them. A rank is driven through join, serve, drain, death and restart on a real Ray cluster, and the
LLMProxy's requests reach only the ranks that serve."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import ray
from rollout_fixtures import simulated_cluster

from rollart.cluster.membership import IllegalTransition, Membership, Slot, WorkerState
from rollart.engines.base import SamplingParams
from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.types import GenerateRequest

pytestmark = pytest.mark.timeout(300)
S = WorkerState


def members(n: int) -> tuple[Membership, list[tuple[int, str]]]:
    recorded: list[tuple[int, str]] = []
    m = Membership("t", lambda rank, state: recorded.append((rank, state)))
    m.slots = [Slot(r, "H20", None, r, (r,)) for r in range(n)]  # type: ignore[arg-type]
    return m, recorded


def test_transitions_follow_the_machine_and_a_drain_outlives_a_restart() -> None:
    m, recorded = members(3)
    for r in range(3):
        m.move(r, S.SERVING)
    with m.lock:
        picked = [m.take(m.slots).rank for _ in range(3)]  # type: ignore[union-attr]
    assert sorted(picked) == [0, 1, 2]  # least loaded first: each once
    m.set_draining(1, True)
    assert m.states()[1] is S.DRAINING and recorded[-1] == (1, "draining")
    with m.lock:
        assert {m.take(m.slots).rank for _ in range(4)} == {0, 2}  # type: ignore[union-attr]
    deaths: list[int] = []
    m.add_death_listener(lambda rank, cause: deaths.append(rank))
    assert m.died(1, RuntimeError("gone")) and deaths == [1] and m.fault_counts["deaths"] == 1
    assert not m.died(1, None)  # a dead rank does not die twice
    m.set_restarting(1, True)
    assert m.states()[1] is S.RESTARTING and m.recoverable()
    m.move(1, S.JOINING)
    assert m.serve(1) and m.states()[1] is S.DRAINING  # asked to leave before it died: it comes back leaving
    m.move(1, S.RETIRED)
    assert not m.serve(1) and m.states()[1] is S.RETIRED  # a retired rank stays out
    m.move(1, S.SERVING)  # a late request for a retired rank changes nothing
    assert m.states()[1] is S.RETIRED
    # a restart that did not come to serve is a death again; a removed rank never serves again
    m.died(2, None)
    m.set_restarting(2, True)
    m.move(2, S.JOINING)
    m.set_restarting(2, False)
    assert m.states()[2] is S.DEAD
    m.move(2, S.REMOVED)
    with pytest.raises(IllegalTransition, match=r"t\[rank 2\]: removed cannot become serving"):
        m.move(2, S.SERVING)
    assert not m.serve(2)
    with pytest.raises(IllegalTransition, match="serving cannot become restarting"):
        m.move(0, S.RESTARTING)


def test_nothing_is_served_when_no_rank_can_come_back() -> None:
    m, _ = members(2)
    m.move(0, S.SERVING)
    m.move(1, S.SERVING)
    m.died(0, None)
    m.died(1, None)
    assert not m.recoverable() and not m.wait_until_serving(0.01)
    m.set_awaiting(True)  # an elastic pool waiting for capacity: a worker may still join
    assert m.recoverable()


def test_the_elastic_pool_gets_the_weight_paths_host_hooks_when_it_is_built() -> None:
    """``ElasticRollout.hosts`` (what hears of hosts joining and leaving) is a constructor argument and
    read-only after: the pipeline builds its weight path first and passes it; no module assigns it later."""
    import ast
    from pathlib import Path

    from rollart.rollout.elastic import ElasticRollout

    assert "hosts" in inspect.signature(ElasticRollout).parameters
    attr = ElasticRollout.hosts
    assert isinstance(attr, property) and attr.fset is None, "ElasticRollout.hosts can be written"
    root = Path(__file__).resolve().parents[1]
    assigned = [
        f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}"
        for folder in ("rollart", "pipelines", "benchmarks")
        for path in sorted((root / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and node.attr == "hosts"
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert assigned == []


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4))


async def ranks_served(proxy: LLMProxy, prefix: str, n: int = 12) -> set[int]:
    outs = await asyncio.gather(*(proxy.generate(request(f"{prefix}{i}"), "x") for i in range(n)))
    assert all(len(o.output_token_ids) == 4 for o in outs)
    return {o.rank for o in outs}


async def test_a_rank_joins_serves_drains_dies_restarts_and_the_proxy_routes_only_to_serving_ranks(make_rm) -> None:
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2, "max_devices": 3}})
    cluster = simulated_cluster(rm, "rollout")
    proxy = LLMProxy(cluster, batch_requests=True)
    try:
        assert [cluster.state_of(r) for r in range(2)] == [S.SERVING, S.SERVING]
        assert await ranks_served(proxy, "a") == {0, 1}
        # join: started, loading weights, not routed to
        unit = await asyncio.to_thread(rm.grow, "rollout", 0, 30.0)
        assert unit is not None
        rank = await asyncio.to_thread(cluster.add_worker, unit, 120.0)
        assert rank == 2 and cluster.state_of(2) is S.JOINING
        assert await ranks_served(proxy, "b") == {0, 1}
        # serve
        cluster.mark_alive(2)
        assert cluster.state_of(2) is S.SERVING
        assert await ranks_served(proxy, "c", 18) == {0, 1, 2}
        # drain: control calls still reach it, routed calls do not
        cluster.set_draining(0)
        assert cluster.state_of(0) is S.DRAINING
        assert await ranks_served(proxy, "d") == {1, 2}
        assert len(await cluster.metrics()) == 3
        cluster.set_draining(0, False)
        # death: the request sent to it is served by another rank, and it is marked dead
        ray.kill(cluster.workers[1], no_restart=True)
        assert await ranks_served(proxy, "e", 18) <= {0, 2}
        assert cluster.state_of(1) is S.DEAD and cluster.fault_counts["deaths"] == 1
        # restart: joining until marked alive, then routed to again
        cluster.mark_restarting(1)
        assert cluster.state_of(1) is S.RESTARTING
        await asyncio.to_thread(cluster.restart_worker, 1, 120.0, mark_alive=False)
        assert cluster.state_of(1) is S.JOINING
        assert await ranks_served(proxy, "f") == {0, 2}
        cluster.mark_alive(1)
        assert await ranks_served(proxy, "g", 18) == {0, 1, 2}
        assert [p["state"] for p in cluster.placement()] == ["serving"] * 3
        # retire: never routed to again, never restarted
        cluster.retire_worker(2)
        assert cluster.is_retired(2) and await ranks_served(proxy, "h") == {0, 1}
        with pytest.raises(RuntimeError, match="left the pool"):
            cluster.restart_worker(2)
    finally:
        proxy.close()
        cluster.shutdown()
    assert {p["state"] for p in cluster.placement()} == {"stopped"}
