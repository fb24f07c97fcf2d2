"""A driver on one host of a multi-host Ray cluster whose Mooncake client would advertise its segment on
127.0.0.1 (MC_TCP_BIND_ADDRESS inherited from a single-host run): the first publish must fail at once,
naming the address and the fix. Prints ``RESULT {"error": ...}``."""

from __future__ import annotations

import json
import os

import ray
import torch

from rollart.resource_manager.net import node_ip
from rollart.weights.mooncake_channel import MooncakeChannel, MooncakeStoreError
from rollart.weights.mooncake_master import MooncakeMaster

os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
with MooncakeMaster(host=node_ip()) as master:
    channel = MooncakeChannel("loopback", master.address, segment_mb=8, timeout_s=60)
    try:
        channel.publish({"x": torch.zeros(4)}, 0)
        error = None
    except MooncakeStoreError as err:
        error = str(err)
print("RESULT " + json.dumps({"error": error, "master": master.address, "nodes": len(ray.nodes())}))
ray.shutdown()
