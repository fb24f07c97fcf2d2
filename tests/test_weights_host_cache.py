"""One fetch per host: readers of a HostSharedChannel on the same node share a single fetch of each
version from the wrapped channel, and every reader gets the published snapshot."""

from __future__ import annotations

import pytest
import ray
import torch

from rollart.weights import HostSharedChannel, RayObjectChannel, WeightChannel
from rollart.weights.host_cache import host_cache_stats

pytestmark = pytest.mark.timeout(180)


@ray.remote(num_cpus=0)
class Reader:
    def fetch(self, channel: WeightChannel, version: int) -> dict[str, torch.Tensor]:
        return channel.fetch(version)


def test_readers_of_one_host_share_one_fetch_per_version(ray_local):
    channel = HostSharedChannel(RayObjectChannel("host-cache-test"), keep=2)
    assert isinstance(channel, WeightChannel) and isinstance(channel.inner, WeightChannel)
    readers = [Reader.remote() for _ in range(3)]
    try:
        for version in (1, 2, 3):
            state = {"w": torch.full((4, 4), float(version)), "step": torch.tensor([version])}
            channel.publish(state, version)
            got = ray.get([r.fetch.remote(channel, version) for r in readers])
            for g in got:
                assert torch.equal(g["w"], state["w"]) and torch.equal(g["step"], state["step"])
        [stats] = host_cache_stats("host-cache-test")  # one node, one cache
        assert stats["fetches"] == [1, 2, 3] and stats["cached"] == [2, 3]
        assert stats["node_ip"] == ray.util.get_node_ip_address()
    finally:
        for r in readers:
            ray.kill(r, no_restart=True)
