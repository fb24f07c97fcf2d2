"""Driver run inside the head host of a namespace cluster by tests/test_multihost_weights.py.

Relay tree over two rollout hosts, ``--parent`` then ``--child``: the driver (on the head, beside the
Mooncake master) makes both host caches, publishes versions 1..3, and only a reader on the child host
fetches them; nobody on the parent host asks. Prints ``RESULT {...}``: whether every version read
equals the one published, and every host cache's stats.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollart.resource_manager.net import node_ip
from rollart.weights import HostSharedChannel
from rollart.weights.host_cache import host_cache_stats
from rollart.weights.mooncake_channel import MooncakeChannel
from rollart.weights.mooncake_master import MooncakeMaster

CHANNEL = "relay-prompt"


def state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.arange(7) + version}


@ray.remote(num_cpus=0)
class Reader:
    def fetch(self, channel: HostSharedChannel, version: int) -> dict[str, torch.Tensor]:
        return channel.fetch(version)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--parent", required=True)
    p.add_argument("--child", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--relay-wait-s", type=float, default=60.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ray.init()
    nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with MooncakeMaster(host=node_ip(), log_dir=out) as master:
        inner = MooncakeChannel(CHANNEL, master.address, keep=2, chunk_mb=1, segment_mb=16, timeout_s=60)
        channel = HostSharedChannel(inner, keep=2, relay=[args.parent, args.child], relay_wait_s=args.relay_wait_s)
        channel.start_caches([nodes[args.parent], nodes[args.child]])
        reader = Reader.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[args.child], soft=False)
        ).remote()
        same = []
        for v in (1, 2, 3):
            inner.publish(state(v), v)
            got = ray.get(reader.fetch.remote(channel, v))
            same.append(all(torch.equal(got[k], t) for k, t in state(v).items()))
        caches = host_cache_stats(CHANNEL)
    print("RESULT " + json.dumps({"same": same, "host_caches": caches}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
