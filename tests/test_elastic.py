"""Elastic rollout on a real local Ray (logical H20 devices): the pool grows into devices that come free
while it serves, new workers take traffic only once they serve the current weights, ``scale`` drains
workers without losing a request and gives their devices back, a ``rollart scale`` request through the
cluster registry is applied, and bad elastic specs are refused before anything starts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from rollout_fixtures import simulated_cluster

from rollart.config import PipelineConfig
from rollart.engines.base import SamplingParams
from rollart.resource_manager.specs import ResourceSpecError, parse_pools
from rollart.rollout.config import ElasticConfig
from rollart.rollout.elastic import ElasticRollout
from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.types import GenerateRequest

pytestmark = pytest.mark.timeout(300)

FAST = ElasticConfig(poll_s=0.1, drain_timeout_s=5.0, place_timeout_s=5.0, join_timeout_s=120.0)


def request(rid: str, n: int = 8) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=n))


def free_h20() -> float:
    return ray.available_resources().get("accelerator_type:H20", 0.0)


def block_h20(keep: int = 0):
    """A placement group holding every free H20 device but ``keep`` (another job's devices)."""
    n = int(free_h20()) - keep
    pg = placement_group([{"accelerator_type:H20": 1.0}] * n, strategy="PACK")
    ray.get(pg.ready(), timeout=30)
    return pg, n


def wait_until(predicate, timeout_s: float = 60.0, what: str = ""):
    """Poll a condition the elastic thread brings about; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {timeout_s:.0f}s: {what}")
        time.sleep(0.05)


def serving(cluster) -> list[int]:
    return [p["rank"] for p in cluster.placement() if p["alive"] and not p["draining"]]


QUEUED_DRIVER = """
import json, sys
from rollart.resource_manager import ResourceManager
from rollart.resource_manager.admission import Admission
rm = ResourceManager({"rollout": {"hardware": "H20", "devices": 2}}, job_id=sys.argv[1], admission=Admission(poll_s=0.05))
print(json.dumps({"job": rm.job_id, "devices": rm.group_devices("rollout", 0)}))
rm.shutdown()
"""


def test_elastic_specs_are_checked_before_anything_starts(tmp_path):
    spec = parse_pools({"rollout": {"hardware": "H20", "devices": 2, "max_devices": 8}})["rollout"]
    assert spec.elastic and spec.groups[0].max_devices == 8
    assert parse_pools(
        {"rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 0, "max_devices": 2}]}
    )
    with pytest.raises(ResourceSpecError, match=r'pools.rollout: "max_devices" \(2\) is below "devices" \(4\)'):
        parse_pools({"rollout": {"hardware": "H20", "devices": 4, "max_devices": 2}})
    with pytest.raises(ResourceSpecError, match=r'pools.rollout.*"devices": 0 needs "max_devices"'):
        parse_pools({"rollout": {"hardware": "H20", "devices": 0}})
    with pytest.raises(ResourceSpecError, match=r'pools.rollout: "max_devices" is for accelerator groups'):
        parse_pools({"rollout": {"hardware": "CPU", "cpus": 2, "max_devices": 4}})
    base = {
        "envs": [{"name": "reverse", "groups": 2}],
        "rollout": {"num_env_groups": 2, "group_size": 2, "batch_groups": 2},
        "output_dir": str(tmp_path / "run"),
    }
    with pytest.raises(ValueError, match=r"pools.train.max_devices: only the rollout pool .* can be elastic"):
        PipelineConfig.model_validate(
            {
                **base,
                "pools": {
                    "train": {"hardware": "H800", "devices": 1, "max_devices": 2},
                    "rollout": {"hardware": "H20", "devices": 1},
                },
            }
        )
    with pytest.raises(ValueError, match=r"pools.rollout.max_devices: an elastic pool .* weights.channel dist"):
        PipelineConfig.model_validate(
            {
                **base,
                "pools": {
                    "train": {"hardware": "H800", "devices": 1},
                    "rollout": {"hardware": "H20", "devices": 1, "max_devices": 2},
                },
                "weights": {"channel": "dist"},
            }
        )


async def test_the_pool_grows_into_freed_devices_and_shrinks_without_losing_a_request(make_rm, tmp_path):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1, "max_devices": 3}})
    blocker, blocked = block_h20()  # the cluster's other H20 devices are taken: the pool stays at one
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.01)
    proxy = LLMProxy(cluster, batch_requests=True)
    elastic = ElasticRollout(rm, cluster, proxy, FAST, out_dir=tmp_path)
    try:
        await proxy.model_update({}, 3)  # the served version: a joining worker must serve it too
        elastic.start()
        await asyncio.sleep(0.5)  # several polls with nothing free: nothing joins
        assert serving(cluster) == [0] and elastic.devices() == 1

        remove_placement_group(blocker)  # capacity comes free while the pool serves
        outs = await asyncio.gather(*(proxy.generate(request(f"a{i}"), "x") for i in range(8)))
        assert all(len(o.output_token_ids) == 8 for o in outs)
        await asyncio.to_thread(wait_until, lambda: elastic.totals["joined"] == 2, 120, "two workers joined")
        assert len(serving(cluster)) == 3
        joined = [e for e in elastic.events if e["event"] == "joined"]
        assert sorted(e["rank"] for e in joined) == [1, 2] and all(e["version"] == 3 for e in joined), joined
        assert all(m["weight_version"] == 3 for m in await cluster.metrics())  # every worker serves version 3
        assert all(e["join_s"] > 0 and e["load_s"] >= 0 for e in joined)
        # new requests reach the new workers (least-loaded routing over the live ones)
        outs = await asyncio.gather(*(proxy.generate(request(f"b{i}", n=40), "x") for i in range(12)))
        assert {o.rank for o in outs} == {0, 1, 2}
        assert rm.group_devices("rollout", 0) == 3 and elastic.step_metrics()["joined"] == 2

        # scale in to one device while long requests run: the last joined leave, every request completes
        long = [asyncio.ensure_future(proxy.generate(request(f"c{i}", n=150), "x")) for i in range(9)]
        await asyncio.sleep(0.2)
        before = free_h20()
        assert elastic.scale(1)
        await asyncio.to_thread(wait_until, lambda: elastic.totals["left"] == 2, 120, "two workers left")
        assert serving(cluster) == [0] and elastic.devices() == 1
        outs = await asyncio.gather(*long)
        assert all(len(o.output_token_ids) == 150 and o.finish_reason == "length" for o in outs)
        left = [e for e in elastic.events if e["event"] == "left"]
        assert sorted(e["rank"] for e in left) == [1, 2] and all(e["reason"] == "scale" for e in left)
        await asyncio.to_thread(wait_until, lambda: free_h20() >= before + 2, 30, "devices given back to the cluster")
        assert rm.group_devices("rollout", 0) == 1 and elastic.step_metrics()["left"] == 2
        assert not elastic.scale(5) and elastic.events[-1]["event"] == "scale_refused"  # above max_devices
        rows = [json.loads(line) for line in (tmp_path / "elastic.jsonl").read_text().splitlines()]
        assert [r["event"] for r in rows].count("joined") == 2 and [r["event"] for r in rows].count("left") == 2
    finally:
        elastic.stop()
        proxy.close()
        cluster.shutdown()


async def test_a_request_still_running_when_the_drain_times_out_continues_on_another_worker(make_rm, tmp_path):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2, "max_devices": 2}})
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.02)
    proxy = LLMProxy(cluster, batch_requests=True)
    cfg = FAST.model_copy(update={"drain_timeout_s": 0.3})
    elastic = ElasticRollout(rm, cluster, proxy, cfg, out_dir=tmp_path)
    try:
        elastic.start()
        long = [asyncio.ensure_future(proxy.generate(request(f"l{i}", n=120), "x")) for i in range(6)]
        await asyncio.sleep(0.3)
        assert elastic.scale(1)
        outs = await asyncio.gather(*long)
        # every request has its whole budget, in order: the preempted ones continued from their tokens
        assert all(len(o.output_token_ids) == 120 for o in outs)
        left = [e for e in elastic.events if e["event"] == "left"]
        assert len(left) == 1 and left[0]["migrated"] >= 1, left
        assert serving(cluster) == [0]
    finally:
        elastic.stop()
        proxy.close()
        cluster.shutdown()


async def test_scale_in_hands_the_devices_to_a_queued_job_which_then_starts(make_rm, tmp_path):
    """`rollart scale` (the command, run as a user runs it) drains the elastic pool; the job waiting in
    the admission queue for those devices is admitted and places its pools. While it waits, the elastic
    pool does not take the devices it waits for."""
    from rollart.cli.jobs import pool_sizes
    from rollart.cli.scale import scale_problem
    from rollart.resource_manager.admission import Admission

    total = int(ray.cluster_resources().get("accelerator_type:H20", 0.0))
    rm = make_rm(
        {"rollout": {"hardware": "H20", "devices": 1, "max_devices": total - 1}},
        job_id=f"elastic-{tmp_path.name}",
        admission=Admission(poll_s=0.05),
    )
    registry = rm.store.registry
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.01)
    proxy = LLMProxy(cluster, batch_requests=True)
    elastic = ElasticRollout(rm, cluster, proxy, FAST, out_dir=tmp_path)
    queued_job, waiter = f"queued-{tmp_path.name}", None
    try:
        elastic.start()
        await asyncio.to_thread(wait_until, lambda: elastic.devices() == total - 1, 120, "the pool grew to its maximum")
        await asyncio.to_thread(wait_until, lambda: elastic.totals["joined"] == total - 2, 120, "the new workers serve")
        row = registry.jobs(rm.job_id)[0]
        assert row["asks"] == {"H20": total - 1} and row["elastic"]["rollout"]["devices"] == total - 1
        # what `rollart jobs` and `rollart status` show: the pool's devices now and its maximum
        size = row["elastic"]["rollout"]
        assert pool_sizes({"pools": {"rollout": {**size, "joining": 0}}}) == f"rollout {total - 1}/{total - 1}"
        assert pool_sizes({"pools": {"rollout": {**size, "devices": 2, "joining": 0, "draining": 1}}}) == (
            f"rollout 2/{total - 1} -1 draining"
        )
        [pool_row] = rm.store.pools(rm.job_id)
        assert (pool_row["devices"], pool_row["max_devices"]) == (total - 1, total - 1)

        # another job's driver (its own process, as `rollart submit` starts it): it asks for two H20, one is free
        env = {
            **os.environ,
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            "ROLLART_METADATA_DB": str(tmp_path / "b.sqlite"),
        }
        waiter = subprocess.Popen(
            [sys.executable, "-c", QUEUED_DRIVER, queued_job],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        await asyncio.to_thread(
            wait_until,
            lambda: waiter.poll() is not None or [r.get("state") for r in registry.jobs(queued_job)] == ["queued"],
            120,
            "the job queued",
        )
        assert waiter.poll() is None, waiter.communicate()
        assert elastic.devices() == total - 1  # the queued job's devices stay free: the pool does not take them
        assert scale_problem(registry.jobs(rm.job_id)[0], rm.job_id, "rollout", total) is not None  # above max
        assert scale_problem(registry.jobs(rm.job_id)[0], rm.job_id, "train", 1) is not None  # not elastic
        assert scale_problem(registry.jobs(rm.job_id)[0], rm.job_id, "rollout", 1) is None
        # the command a user types: above the pool's maximum it is refused before anything is asked
        scale = [sys.executable, "-m", "rollart.cli", "scale", rm.job_id, "--pool", "rollout"]
        refused = await asyncio.to_thread(
            subprocess.run, [*scale, "--devices", str(total)], env=env, capture_output=True, text=True, timeout=120
        )
        assert refused.returncode == 2 and "max_devices" in refused.stderr, refused.stderr[-2000:]
        assert elastic.devices() == total - 1
        done = await asyncio.to_thread(
            subprocess.run,
            [*scale, "--devices", "1", "--wait", "120"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1] == f"rollout: 1/{total - 1} devices"
        out, err = await asyncio.to_thread(waiter.communicate, timeout=180)
        assert waiter.returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1]) == {"job": queued_job, "devices": 2}  # its groups were placed: it ran
        assert [r["state"] for r in registry.jobs(queued_job)] == ["finished"]  # it ended as it should
        assert elastic.devices() == 1 and registry.jobs(rm.job_id)[0]["asks"] == {"H20": 1}
        assert [(r["devices"], r["max_devices"]) for r in rm.store.pools(rm.job_id)] == [(1, total - 1)]
        scaled = [e for e in elastic.events if e["event"] == "scale"]
        assert scaled and scaled[-1]["source"] == "rollart scale" and scaled[-1]["devices"] == 1
    finally:
        if waiter is not None and waiter.poll() is None:
            waiter.kill()
            waiter.wait()
        elastic.stop()
        proxy.close()
        cluster.shutdown()


async def test_a_tag_rule_listing_several_types_takes_new_workers_of_the_first_listed_type(make_rm, tmp_path):
    """A mixed pool whose H20 group is elastic and empty at start: a tag ruled ``[H20, H800]`` is served by
    the H800 worker until an H20 worker joins, then by the H20 one (the rule's order)."""
    rm = make_rm({"rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 0, "max_devices": 1}]})
    cluster = simulated_cluster(rm, "rollout", mapping={"x": ["H20", "H800"], "*": ["H800"]})
    proxy = LLMProxy(cluster, batch_requests=True)
    elastic = ElasticRollout(rm, cluster, proxy, FAST, out_dir=tmp_path)
    try:
        first = await asyncio.gather(*(proxy.generate(request(f"a{i}"), "x") for i in range(4)))
        assert {o.rank for o in first} == {0}  # only the H800 worker exists
        elastic.start()
        await asyncio.to_thread(wait_until, lambda: elastic.totals["joined"] == 1, 120, "an H20 worker joined")
        [joined] = [e for e in elastic.events if e["event"] == "joined"]
        assert joined["hardware"] == "H20" and joined["rank"] == 1
        after = await asyncio.gather(*(proxy.generate(request(f"b{i}"), "x") for i in range(4)))
        assert {o.rank for o in after} == {1}  # the rule's first type now has a live worker
        other = await proxy.generate(request("c"), "y")
        assert other.rank == 0  # a tag ruled [H800] stays there
    finally:
        elastic.stop()
        proxy.close()
        cluster.shutdown()
