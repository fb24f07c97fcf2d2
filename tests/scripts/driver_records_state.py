"""A driver that reserves pools, starts a cluster with a serverless endpoint, and exits without cleanup."""

import json
import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import rollart as ra


class Gen(ra.Worker):
    @ra.hw_mapping({"*": ["H20", "H800"]})
    def generate(self, prompt: str, tag_name: str) -> str:
        return prompt


class Reward(ra.Worker):
    @ra.register_serverless(url="http://127.0.0.1:9/rewards/math", timeout_s=5, retries=2)
    def compute_rewards(self, trajectories: list) -> list:
        raise AssertionError("never runs locally")


def main(store: str, job_id: str) -> None:
    rm = ra.ResourceManager(
        {"rollout": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 2}]},
        store=store,
        job_id=job_id,
        local_resources={"H800": 2, "H20": 2, "CPU": 2},
    )
    gen = ra.Cluster("gen", Gen, rm, pool="rollout")
    ra.Cluster("reward", Reward, rm, pool=None)
    print("RESULT " + json.dumps({"pid": os.getpid(), "placement": gen.placement()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
