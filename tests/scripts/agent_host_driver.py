"""Driver of tests/test_serving_hosts.py: agent episodes whose harness runs on another host.

``python agent_host_driver.py WORKDIR`` (in the head host, ``RAY_ADDRESS`` set) serves a scripted
policy behind the endpoint on this host's IP and plays three episodes of the ``agent`` env kind with
``examples/calculator_agent/remote.py:solve_elsewhere``: each starts the calculator agent behind
``$CALCULATOR_AGENT_PREFIX`` (``ip netns exec`` of another host), which reaches the endpoint over the
network. Prints ``RESULT {...}``: the endpoint's URL and, per episode, its status, reward, calls and
the addresses the calls came from.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent / "examples" / "calculator_agent"))


def task(seed: int) -> dict:
    n = 10 + seed % 50
    return {"question": f"SAY:{n}", "answer": n}  # the scripted engine answers the number: reward 1


async def play(workdir: Path) -> dict:
    from remote import solve_elsewhere
    from serving_fixtures import build_merging_tokenizer
    from transformers import AutoTokenizer

    import rollart as ra
    from rollart.engines.base import SamplingParams
    from rollart.resource_manager.launcher import ensure_ray
    from rollart.resource_manager.net import node_ip
    from rollart.rollout.inference_worker import inference_worker_class
    from rollart.rollout.llm_proxy import LLMProxy
    from rollart.serving.agent import AgentEnvManager, AgentSpec
    from rollart.serving.config import ServingConfig
    from rollart.serving.endpoint import PolicyEndpoint, build_service
    from rollart.serving.service import ProxyBackend

    ensure_ray()
    folder = build_merging_tokenizer(workdir / "tok")
    rm = ra.ResourceManager({"rollout": {"hardware": "H20", "devices": 1}}, store=workdir / "meta.db")
    cluster = ra.Cluster(
        "infer",
        inference_worker_class({"*": ["H20"]}),
        rm,
        pool="rollout",
        worker_kwargs={"engine": {"kind": "serving_fixtures:ScriptedEngine", "model": str(folder)}},
    )
    proxy = LLMProxy(cluster)
    config = ServingConfig(host=node_ip())  # other hosts reach it on this host's IP
    service = build_service(
        ProxyBackend(proxy),
        AutoTokenizer.from_pretrained(str(folder)),
        config,
        model="calculator",
        sampling=SamplingParams(max_new_tokens=32),
    )
    endpoint = PolicyEndpoint(service, config)
    await endpoint.start()
    try:
        manager = AgentEnvManager(
            AgentSpec(agent="remote:solve_elsewhere", timeout_s=120),
            endpoint,
            tag="calc",
            agent=solve_elsewhere,
            tasks=task,
        )
        episodes = []
        for seed in range(3):
            traj = await manager.run(seed=seed, group_id=f"0:{seed}", traj_id=f"0:{seed}:0:v0")
            episodes.append(
                {
                    "status": traj.status,
                    "error": traj.error,
                    "reward": traj.reward,
                    "calls": traj.info.get("calls"),
                    "clients": traj.info.get("clients"),
                    "actions": sum(traj.loss_mask),
                }
            )
        return {"url": endpoint.public_url, "episodes": episodes}
    finally:
        await endpoint.stop()
        proxy.close()
        cluster.shutdown()
        rm.shutdown()


def main() -> None:
    result = asyncio.run(play(Path(sys.argv[1])))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
