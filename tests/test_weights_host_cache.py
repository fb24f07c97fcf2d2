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


def _owns_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_unpacked_snapshot_pickles_to_its_own_size():
    """A fetched snapshot's tensors own their bytes: pickled (``ray.put``, an actor call) it is about
    as large as the state, not the whole flat buffer once per tensor (the cross-host slowdown)."""
    import pickle

    from rollart.weights.mooncake_channel import pack_state, unpack_state
    from rollart.weights.snapshot import owning_storage, state_checksum

    state = {f"layer{i}.w": torch.randn(64, 32 + i) for i in range(12)} | {"step": torch.tensor([3])}
    flat, layout = pack_state(state)
    got = unpack_state(torch.frombuffer(bytearray(flat.numpy().tobytes()), dtype=torch.uint8), layout)
    assert state_checksum(got) == state_checksum(state)
    assert all(_owns_storage(t) for t in got.values())
    assert len(pickle.dumps(got)) < flat.numel() + (64 << 10)

    views = {item["name"]: flat[item["offset"] : item["offset"] + item["nbytes"]] for item in layout}
    owned = owning_storage(views)
    assert all(_owns_storage(t) for t in owned.values())
    assert all(torch.equal(owned[k], views[k]) for k in views)
    assert owning_storage(got)["step"] is got["step"]  # a tensor that owns its storage is not copied


def test_host_cache_puts_compact_snapshots(ray_local):
    """An inner channel that hands out views of one buffer: the host cache stores each tensor's own
    bytes, so every reader gets tensors that own their storage."""
    from rollart.weights.mooncake_channel import pack_state

    class ViewsChannel:  # local: pickled by value into the cache actor
        name = "host-cache-views"

        def __init__(self, state: dict[str, torch.Tensor]):
            self.flat, self.layout = pack_state(state)

        def fetch(self, version: int) -> dict[str, torch.Tensor]:
            return {i["name"]: self.flat[i["offset"] : i["offset"] + i["nbytes"]] for i in self.layout}

    state = {f"w{i}": torch.full((16, 16), float(i)) for i in range(8)}
    channel = HostSharedChannel(ViewsChannel(state), keep=2)  # type: ignore[arg-type]
    reader = Reader.remote()
    try:
        got = ray.get(reader.fetch.remote(channel, 1))
        assert sorted(got) == sorted(state)
        assert all(_owns_storage(t) for t in got.values()), {k: t.untyped_storage().nbytes() for k, t in got.items()}
    finally:
        ray.kill(reader, no_restart=True)
