"""Driver run inside the head namespace host by tests/test_fault_tolerance.py (RAY_ADDRESS names the head).

``STORE``: an inference pool of one H800 worker (host head or b) and one H20 worker (host c), tag ``*``
preferring H20; a request runs on H20, prints READY and waits for a line on stdin (the test kills every
process of host c meanwhile); then a weight push and new requests must go on without host c.
"""

from __future__ import annotations

import asyncio
import json
import sys

import rollart as ra
from rollart.cluster.config import RestartPolicy
from rollart.engines.base import SamplingParams
from rollart.rollout.inference_worker import inference_worker_class
from rollart.rollout.llm_proxy import LLMProxy
from rollart.rollout.types import GenerateRequest


def request(rid: str, n: int = 40) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=n))


async def main(store: str) -> dict:
    rm = ra.ResourceManager(
        {"rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 1}]}, store=store
    )
    engine = {"kind": "simulated", "options": {"decode_base_s": 0.02, "decode_per_seq_s": 0.0, "vocab_size": 50}}
    cluster = ra.Cluster(
        "infer", inference_worker_class({"*": ["H20", "H800"]}), rm, pool="rollout", worker_kwargs={"engine": engine}
    )
    proxy = LLMProxy(cluster, restart=RestartPolicy(max_restarts=0, on_exhausted="remove"))
    try:
        before = await proxy.generate(request("before", n=4), "*")
        ips = {s.rank: s.node_ip for s in cluster._slots}
        inflight = asyncio.ensure_future(proxy.generate(request("inflight", n=300), "*"))
        while not any(m["running"] for m in await cluster.metrics()):
            await asyncio.sleep(0.01)
        print("READY " + json.dumps({"hardware": before.hardware, "ips": ips}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the test has killed host c
        moved = await inflight
        await proxy.suspend()
        await proxy.model_update({}, 1)
        await proxy.resume()
        after = await asyncio.gather(*(proxy.generate(request(f"after{i}", n=4), "*") for i in range(3)))
        metrics = await proxy.worker_metrics()
        return {
            "moved": {"hardware": moved.hardware, "tokens": len(moved.output_token_ids)},
            "after": [(o.hardware, o.token_versions) for o in after],
            "metrics": [(m["rank"], m["hardware"], m["weight_version"]) for m in metrics],
            "faults": proxy.fault_metrics(),
            "events": [e["event"] for e in proxy.supervisor.events] if proxy.supervisor else [],
        }
    finally:
        proxy.close()
        cluster.shutdown()
        rm.shutdown()


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
