"""Driver of tests/test_kube_envpods.py: the agentic pipeline with its envs on the ``kubernetes`` backend.

``python kube_pipeline_driver.py OUT_DIR KUBECONFIG IMAGE`` runs 10 synchronous steps of reverse-1 with a
format credit of 0.5 (the reward rises within a few steps; the same run as tests/scripts/envservice_driver.py) with two
env pods (``rollart serve env reverse``, reached at their pod IPs) and FrozenLake-3 in a third pod, on the
API server that KUBECONFIG names, on a local Ray. Prints ``RESULT {...}``: the pools' URLs and sessions, and the metrics per step.
"""

from __future__ import annotations

import json
import sys

from rollart.config import PipelineConfig
from rollart.pipelines.agentic import AgenticPipeline


def main() -> None:
    out_dir, kubeconfig, image = sys.argv[1:4]
    cfg = PipelineConfig.model_validate(
        {
            "name": "kube",
            "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
            "pools": {"train": {"hardware": "H800", "devices": 1}, "rollout": {"hardware": "H20", "devices": 1}},
            "envs": [
                {
                    "name": "reverse",
                    "groups": 4,
                    "kwargs": {"length": 1, "format_credit": 0.5},
                    "backend": "kubernetes",
                    "servers": 2,
                    "call_timeout_s": 30,
                    "kubernetes": {"image": image, "port": 8200, "connection": {"kubeconfig": kubeconfig}},
                },
                {  # a second, multi-turn task in its own pod: a multi-task job
                    "name": "frozen_lake",
                    "groups": 2,
                    "kwargs": {"size": 3, "hole_prob": 0.1, "max_steps": 4, "max_new_tokens": 1},
                    "backend": "kubernetes",
                    "servers": 1,
                    "call_timeout_s": 30,
                    "kubernetes": {"image": image, "port": 8200, "connection": {"kubeconfig": kubeconfig}},
                },
            ],
            "rollout": {"num_env_groups": 6, "group_size": 8, "batch_groups": 6, "alpha": 0},
            "sampling": {"temperature": 1.0, "max_new_tokens": 1, "seed": 1},
            "advantage": "grpo",
            "train": {"lr": 0.05},
            "steps": 10,
            "export": {"hf": False},
            "output_dir": out_dir,
            "cluster": {
                "metadata_store": f"{out_dir}/meta.sqlite",
                "job_id": "kube-e2e",
                "local_resources": {"H800": 1, "H20": 1, "CPU": 2},
            },
        }
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
        pools = {p.name: {"urls": p.urls, "sessions": dict(p.sessions)} for p in pipe.env_pools.pools.values()}
    finally:
        pipe.shutdown()
    keep = ("step", "reward_mean", "reward_by_tag", "trajectories_failed", "trajectories_aborted")
    print("RESULT " + json.dumps({"pools": pools, "history": [{k: h[k] for k in keep} for h in history]}))


if __name__ == "__main__":
    main()
