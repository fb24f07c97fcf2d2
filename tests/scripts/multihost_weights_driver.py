"""Driver run inside the head host of a namespace cluster by tests/test_multihost_weights.py.

Runs a small multi-task asynchronous pipeline (alpha 1) with the weight channel given on the command
line and prints ``RESULT {...}``: where every worker runs (node IP and hardware), the hardware per tag
of every step, and after every weight sync the version each inference worker serves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import ray

from rollart.config import PipelineConfig
from rollart.pipelines.agentic import AgenticPipeline


def config(channel: str, out: Path, steps: int) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "name": f"mh-{channel}",
            "pools": {
                "train": {"hardware": "H800", "devices": 1},
                "rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 2}],
            },
            "tags": {"reverse-3": ["H800"], "reverse-2": ["H20"]},
            # one group of each task in every batch (without it the two H20 workers' reverse-2 groups
            # can fill every batch of a short run)
            "tasks": {"reverse-3": {"ratio": 0.5}, "reverse-2": {"ratio": 0.5}},
            "envs": [
                {"name": "reverse", "groups": 2, "kwargs": {"length": 3}},
                {"name": "reverse", "groups": 2, "kwargs": {"length": 2}},
            ],
            "rollout": {"num_env_groups": 4, "group_size": 2, "batch_groups": 2, "alpha": 1},
            "sampling": {"temperature": 1.0, "max_new_tokens": 3},
            "advantage": "grpo_token",
            "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
            "train": {"lr": 0.001},
            "steps": steps,
            "checkpoint_every": 0,
            "output_dir": str(out),
            "cluster": {"metadata_store": str(out / "meta.sqlite")},
            # relay (mooncake): the rollout hosts read in a tree, the trainer's host sends each version once
            "weights": {"channel": channel, "segment_mb": 16, "timeout_s": 120}
            | ({"relay": True} if channel == "mooncake" else {}),
        }
    )


class RecordingPipeline(AgenticPipeline):
    """Records the version every inference worker serves once each sync is complete."""

    served: list[dict[str, Any]]

    async def on_weights_served(self, version: int) -> None:
        metrics = await self.proxy.worker_metrics()
        self.served.append({"version": version, "workers": [m["weight_version"] for m in metrics]})


def worker_place(cluster: Any) -> list[dict[str, Any]]:
    """Rank, hardware and node IP of every worker of a Cluster."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    infos = ray.get([w._rollart_info.remote() for w in cluster.workers])
    return [{"rank": i["rank"], "hardware": i["hardware"], "ip": ips[i["node_id"]]} for i in infos]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--channel", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = config(args.channel, Path(args.out), args.steps)
    pipe = RecordingPipeline(cfg, progress=False)
    pipe.served = []
    try:
        history = pipe.run()
        result: dict[str, Any] = {
            "driver_ip": ray.util.get_node_ip_address(),
            "train": worker_place(pipe.train),
            "infer": worker_place(pipe.infer),
            "versions": [h["version"] for h in history],
            "hardware_by_tag": [h["hardware_by_tag"] for h in history],
            "max_staleness": [h["max_staleness"] for h in history],
            "served": pipe.served,
        }
        if args.channel == "mooncake":
            from rollart.weights.host_cache import host_cache_stats

            assert pipe.weights.master is not None
            result["mooncake_master"] = pipe.weights.master.address
            assert pipe.weights.loader is not None
            result["loaded"], result["skipped"] = pipe.weights.loader.loaded, pipe.weights.loader.skipped
            result["host_caches"] = host_cache_stats(pipe.weights.channel.name)  # type: ignore[union-attr]
    finally:
        pipe.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    sys.exit(main())
