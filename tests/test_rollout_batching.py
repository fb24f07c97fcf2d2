"""Batched ADD (rollart.rollout.batching) on a real local Ray: the requests of one event-loop turn go to
each inference worker as one streaming call, each request still finishes and is answered on its own,
a refused request fails only its own caller, and requests whose worker is killed move to a live worker
from their stored state (nothing lost, nothing doubled)."""

import asyncio
import os
import signal

import pytest
import ray
from rollout_fixtures import simulated_cluster

from rollart.cluster.config import RestartPolicy
from rollart.engines.base import SamplingParams
from rollart.rollout.batching import RequestFailedError
from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.types import GenerateRequest

pytestmark = pytest.mark.timeout(300)


def request(rid: str, n: int = 8, prompt=(5, 6, 7)) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=SamplingParams(max_new_tokens=n))


async def test_one_turn_of_requests_is_one_call_per_worker_and_each_finishes_on_its_own(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2}})
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.002)
    proxy = LLMProxy(cluster, batch_requests=True)
    assert proxy.batcher is not None
    try:
        finished: list[str] = []

        async def one(i: int):
            out = await proxy.generate(request(f"r{i}", n=4 + 60 * (i % 2)), "x")
            finished.append(out.request_id)
            return out

        outs = await asyncio.gather(*(one(i) for i in range(16)))
        assert [o.request_id for o in outs] == [f"r{i}" for i in range(16)]
        assert all(len(o.output_token_ids) == (4 if i % 2 == 0 else 64) for i, o in enumerate(outs))
        assert all(o.finish_reason == "length" for o in outs)
        # 16 requests, 2 Ray calls: the least-loaded routing split them over both workers
        assert (proxy.batcher.calls, proxy.batcher.streams, proxy.batcher.requests) == (2, 2, 16)
        assert {o.rank for o in outs} == {0, 1}
        # the short ones were answered before the long ones of the same call finished
        assert set(finished[:8]) == {f"r{i}" for i in range(0, 16, 2)}
        assert all(v["inflight"] == 0 for v in cluster.load().values())
    finally:
        proxy.close()
        cluster.shutdown()


async def test_a_refused_request_fails_only_its_own_caller(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 1}})
    cluster = simulated_cluster(rm, "rollout")
    proxy = LLMProxy(cluster, batch_requests=True)
    try:
        results = await asyncio.gather(
            proxy.generate(request("ok-1"), "x"),
            proxy.generate(request("twice"), "x"),
            proxy.generate(request("twice"), "x"),  # the worker refuses an id it is running already
            proxy.generate(request("ok-2"), "x"),
            return_exceptions=True,
        )
        assert [r.request_id for r in results if not isinstance(r, BaseException)] == ["ok-1", "twice", "ok-2"]
        (refused,) = [r for r in results if isinstance(r, BaseException)]
        assert isinstance(refused, RequestFailedError) and "'twice' is already running" in str(refused)
        assert proxy.batcher.calls == 1 and cluster.load()[0]["inflight"] == 0
    finally:
        proxy.close()
        cluster.shutdown()


async def test_requests_of_a_killed_worker_move_to_a_live_one_from_their_stored_state(make_rm):
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2}})
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.01)
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=0), batch_requests=True)
    try:
        tasks = [asyncio.ensure_future(proxy.generate(request(f"long{i}", n=300), "x")) for i in range(6)]
        async with asyncio.timeout(60):  # both workers hold their share of the batch
            while sum(m["running"] for m in await cluster.metrics()) < 6:
                await asyncio.sleep(0.01)
        pid = ray.get(cluster.workers[0]._rollart_info.remote(), timeout=60)["pid"]
        os.kill(pid, signal.SIGKILL)
        outs = await asyncio.gather(*tasks)
        assert all(len(o.output_token_ids) == 300 and o.finish_reason == "length" for o in outs)
        moved = [o for o in outs if o.rank == 1]
        assert len(moved) == 6  # rank 0's three finished on rank 1
        assert proxy.fault_metrics()["migrated"] == 3 and cluster.fault_counts["deaths"] == 1
    finally:
        proxy.close()
        cluster.shutdown()


async def test_a_lone_request_goes_as_a_plain_call_and_still_moves_when_its_worker_is_killed(make_rm):
    """Turns that drifted apart send one request per event-loop turn: each goes as a plain generate call
    (a streaming call would cost more), with the same fault handling as a batched one."""
    rm = make_rm({"rollout": {"hardware": "H20", "devices": 2}})
    cluster = simulated_cluster(rm, "rollout", decode_base_s=0.01)
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=0), batch_requests=True)
    try:
        tasks = []
        for i in range(2):
            tasks.append(asyncio.ensure_future(proxy.generate(request(f"lone{i}", n=300), "x")))
            await asyncio.sleep(0)  # its task ran: the request is queued in the batcher
            await asyncio.sleep(0)  # the batcher's flush ran: it was sent alone
        async with asyncio.timeout(60):  # one on each worker (least-loaded routing)
            while [m["running"] for m in await cluster.metrics()] != [1, 1]:
                await asyncio.sleep(0.01)
        assert (proxy.batcher.calls, proxy.batcher.streams, proxy.batcher.requests) == (2, 0, 2)
        pid = ray.get(cluster.workers[0]._rollart_info.remote(), timeout=60)["pid"]
        os.kill(pid, signal.SIGKILL)
        outs = await asyncio.gather(*tasks)
        assert all(len(o.output_token_ids) == 300 and o.finish_reason == "length" for o in outs)
        assert {o.rank for o in outs} == {1}
        assert proxy.fault_metrics()["migrated"] == 1 and cluster.fault_counts["deaths"] == 1
        assert cluster.load()[1]["inflight"] == 0
        # a lone request the worker refuses (its id is running there) fails only its own caller
        first = asyncio.ensure_future(proxy.generate(request("dup", n=300), "x"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        with pytest.raises(RequestFailedError, match="'dup' is already running"):
            await proxy.generate(request("dup"), "x")
        assert len((await first).output_token_ids) == 300 and proxy.batcher.streams == 0
    finally:
        proxy.close()
        cluster.shutdown()


def test_a_worker_class_that_overrides_generate_keeps_one_call_per_request():
    from types import SimpleNamespace

    from rollart.rollout.inference_worker import InferenceWorker, inference_worker_class
    from rollart.rollout.llm_proxy import _has_generate_many

    class Logged(InferenceWorker):  # a user's generate must run for every request
        async def generate(self, request, tag_name):
            return await super().generate(request, tag_name)

    assert _has_generate_many(SimpleNamespace(worker_cls=inference_worker_class({"*": ["CPU"]})))
    assert not _has_generate_many(SimpleNamespace(worker_cls=Logged))
