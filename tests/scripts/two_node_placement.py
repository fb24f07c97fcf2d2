"""Two Ray nodes on one machine (ray.cluster_utils.Cluster, both on 127.0.0.1): a head with H800 and a
second node with H20. Prints, as JSON, where every worker of a mixed pool landed."""

import json
import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray
from ray.cluster_utils import Cluster as RayTestCluster

import rollart as ra


class Probe(ra.Worker):
    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        return {"rank": self.rank, "hardware": self.hardware, "node_id": ray.get_runtime_context().get_node_id()}

    @ra.hw_mapping({"FrozenLake": ["H800", "H20"], "*": ["H20", "H800"]})
    def generate(self, prompt: str, tag_name: str) -> dict:
        return {"hardware": self.hardware, "node_id": ray.get_runtime_context().get_node_id()}


def main(store: str) -> None:
    cluster = RayTestCluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"accelerator_type:H800": 2}, "node_ip_address": "127.0.0.1"},
    )
    cluster.add_node(num_cpus=2, resources={"accelerator_type:H20": 2}, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="two-node")
    nodes = {}
    for n in ray.nodes():
        for key in n["Resources"]:
            if key.startswith("accelerator_type:"):
                nodes[key.split(":", 1)[1]] = n["NodeID"]
    rm = ra.ResourceManager(
        {"rollout": [{"hardware": "H800", "devices": 2}, {"hardware": "H20", "devices": 2}]}, store=store
    )
    probe = ra.Cluster("probe", Probe, rm, pool="rollout")
    out = {
        "nodes": nodes,
        "node_addresses": sorted({n["NodeManagerAddress"] for n in ray.nodes()}),
        "workers": probe.where(),
        "routed": {tag: probe.generate("p", tag_name=tag) for tag in ("FrozenLake", "Sokoban")},
    }
    print("RESULT " + json.dumps(out))
    probe.shutdown()
    rm.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
