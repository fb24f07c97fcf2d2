"""Driver of tests/test_envservice_hosts.py: the agentic pipeline with envs on the ``ray`` backend.

``python envservice_driver.py OUT_DIR MODEL KILL_FILE [BACKEND [OVERRIDES]]`` (MODEL ``-``: the tiny
model) runs 10 synchronous steps of reverse-1 with a format credit of 0.5 (a reward that rises within a
few steps) with two env servers (one CPU each) in the 4-CPU pool ``env``; the first step that finds
KILL_FILE kills its env server mid-episode. OVERRIDES: a JSON object
of dotted config keys (``{"steps": 12, "envs.0.kwargs.length": 1}``; a number after ``envs`` is a list
index). Prints ``RESULT {...}``: the env servers (node IP, URL), the metrics per step and
what the servers' pools saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from rollart.config import PipelineConfig
from rollart.pipelines.agentic import AgenticPipeline


def main() -> None:
    out_dir, model, kill_file = sys.argv[1:4]
    backend = sys.argv[4] if len(sys.argv) > 4 else "ray"
    overrides = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    raw = {
        "name": "envsvc",
        "model": None if model == "-" else model,
        "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
        "pools": {
            "train": {"hardware": "H800", "devices": 1},
            "rollout": {"hardware": "H20", "devices": 1},
            "env": {"hardware": "CPU", "cpus": 4},
        },
        "envs": [
            {
                "name": "envservice_fixtures:DyingReverseEnv",
                "groups": 4,
                "kwargs": {"length": 1, "format_credit": 0.5, "kill_file": kill_file},
                "backend": backend,
                "servers": 2,
                "call_timeout_s": 30,
            },
            {  # a second, multi-turn task on the same backend: a multi-task job
                "name": "frozen_lake",
                "groups": 2,
                "kwargs": {"size": 3, "hole_prob": 0.1, "max_steps": 4, "max_new_tokens": 1},
                "backend": backend,
                "servers": 1,
                "call_timeout_s": 30,
            },
        ],
        "rollout": {"num_env_groups": 6, "group_size": 8, "batch_groups": 6, "alpha": 0},
        "env_manager": {"reset_retries": 3, "reset_backoff_s": 0.05, "step_retries": 1},
        "sampling": {"temperature": 1.0, "max_new_tokens": 1, "seed": 1},
        "advantage": "grpo",  # the episode's reward (grpo_token would take the env's per-letter credit)
        "train": {"lr": 0.05},
        "steps": 10,
        "export": {"hf": False},
        "output_dir": out_dir,
        "cluster": {
            "metadata_store": f"{out_dir}/meta.sqlite",
            "job_id": f"envsvc-{backend}",
            # without RAY_ADDRESS (a one-machine check): the hardware a local Ray declares
            "local_resources": None if os.environ.get("RAY_ADDRESS") else {"H800": 1, "H20": 1, "CPU": 5},
        },
    }
    for dotted, value in overrides.items():
        node: Any = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[leaf] = value
    cfg = PipelineConfig.model_validate(raw)
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        servers = pipe.env_pools.servers()
        history = pipe.run()
        for p in pipe.env_pools.pools.values():  # a server restarted after the run's last call: wait for it
            restore = getattr(p, "restore", None)
            if restore is not None:
                asyncio.run(restore())
        pools = {
            p.name: {"urls": p.urls, "down": sorted(p.down), "sessions": dict(p.sessions)}
            for p in pipe.env_pools.pools.values()
        }
    finally:
        pipe.shutdown()
    keep = ("step", "reward_mean", "reward_by_tag", "trajectories_failed", "trajectories_aborted")
    print(
        "RESULT "
        + json.dumps({"servers": servers, "pools": pools, "history": [{k: h[k] for k in keep} for h in history]})
    )


if __name__ == "__main__":
    main()
