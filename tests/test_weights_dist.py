"""Weights over a torch.distributed (gloo) broadcast between real Ray worker processes: one publisher
and two receivers that run concurrently, several buckets per version, the group reused across
versions, a tampered checksum refused, and a version nobody publishes timing out."""

from __future__ import annotations

import pytest
import ray
import torch

from rollart.weights.dist_channel import TorchBroadcastChannel, plan_buckets
from rollart.weights.snapshot import ChecksumMismatch

pytestmark = pytest.mark.timeout(180)


@ray.remote(num_cpus=0)
class Publisher:
    def publish(
        self, channel: TorchBroadcastChannel, state: dict[str, torch.Tensor], version: int, background: bool = False
    ) -> int:
        if background:  # as ``publish_to(channel, wait=False)`` does
            channel.publish_async(state, version, copy=False).result(timeout=60)
        else:
            channel.publish(state, version)
        assert not torch.distributed.is_initialized(), "the channel must not touch the default group"
        return version

    def close(self, channel: TorchBroadcastChannel) -> None:
        channel.close()


@ray.remote(num_cpus=0)
class Receiver:
    def fetch(self, channel: TorchBroadcastChannel, version: int) -> dict[str, torch.Tensor]:
        return channel.fetch(version)

    def fetch_error(self, channel: TorchBroadcastChannel, version: int) -> str:
        try:
            channel.fetch(version)
        except Exception as err:
            return type(err).__name__
        return "no error"

    def close(self, channel: TorchBroadcastChannel) -> None:
        channel.close()


class TamperedChannel(TorchBroadcastChannel):
    """Sends a digest that does not match what it sends."""

    def _seal(self, digest: bytes) -> bytes:
        return bytes(16)


def sample_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "embed.weight": torch.randn(40, 16, generator=g),  # 2560 B: bigger than a 1 KiB bucket
        "layer.bias": torch.randn(16, generator=g),
        "layer.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "norm.scale": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "positions": torch.arange(100, dtype=torch.int64) * (step + 1),  # 800 B
        "step": torch.tensor([step], dtype=torch.int64),  # 0-dim: state_checksum cannot view it as bytes
        "empty": torch.empty(0, 3),
    }


@pytest.fixture(scope="module")
def actors(ray_local):
    pub = Publisher.remote()
    receivers = [Receiver.remote(), Receiver.remote()]
    yield pub, receivers
    for a in (pub, *receivers):
        ray.kill(a, no_restart=True)


def broadcast(channel, pub, receivers, state, version, background=False):
    sent = pub.publish.remote(channel, state, version, background)
    got = [r.fetch.remote(channel, version) for r in receivers]
    assert ray.get(sent, timeout=60) == version
    return ray.get(got, timeout=60)


def test_bucket_layout_groups_dtypes_and_splits_big_tensors_into_row_pieces():
    buckets = plan_buckets(sample_state(0), bucket_bytes=1024)
    assert all(len({b["dtype"]}) == 1 for b in buckets)
    assert all(b["nbytes"] <= 1024 for b in buckets)  # the 2 560-byte embedding too: in pieces
    big = [b for b in buckets if [e[0] for e in b["entries"]] == ["embed.weight"]]
    # 16 rows of 64 bytes a bucket, in order, each carrying its first row and the whole shape
    assert [(b["piece"][0], b["entries"][0][2], b["piece"][1]) for b in big] == [
        (0, [16, 16], [40, 16]),
        (16, [16, 16], [40, 16]),
        (32, [8, 16], [40, 16]),
    ]
    assert sorted({e[0] for b in buckets for e in b["entries"]}) == sorted(sample_state(0))


def test_two_receivers_get_every_version_over_one_group(actors):
    pub, receivers = actors
    channel = TorchBroadcastChannel("dist-two", num_receivers=2, bucket_bytes=1024, timeout_s=60)
    assert channel.latest() is None
    for version in (1, 2):
        state = sample_state(version)
        for got in broadcast(channel, pub, receivers, state, version, background=version == 2):
            assert set(got) == set(state)
            for name, t in state.items():
                assert got[name].dtype == t.dtype and got[name].device.type == "cpu", name
                assert torch.equal(got[name], t), name
        assert channel.latest() == version

    # a receiver that asks for another version than the next broadcast still takes part (so nobody
    # hangs), drops it and raises; an old version cannot be replayed; the group stays in step
    sent = pub.publish.remote(channel, sample_state(3), 3)
    assert ray.get([r.fetch_error.remote(channel, 4) for r in receivers], timeout=60) == ["ValueError"] * 2
    assert ray.get(sent, timeout=60) == 3
    assert ray.get([r.fetch_error.remote(channel, 1) for r in receivers], timeout=60) == ["ValueError"] * 2
    for got in broadcast(channel, pub, receivers, sample_state(4), 4):
        assert torch.equal(got["positions"], sample_state(4)["positions"])
    ray.get([a.close.remote(channel) for a in (pub, *receivers)], timeout=60)


def test_tampered_checksum_is_refused(actors):
    pub, receivers = actors
    channel = TamperedChannel("dist-tampered", num_receivers=2, bucket_bytes=1024, timeout_s=60)
    sent = pub.publish.remote(channel, sample_state(3), 3)
    errors = [r.fetch_error.remote(channel, 3) for r in receivers]
    assert ray.get(sent, timeout=60) == 3
    assert ray.get(errors, timeout=60) == [ChecksumMismatch.__name__] * 2


def test_unpublished_version_times_out(ray_local):
    channel = TorchBroadcastChannel("dist-silent", num_receivers=1, timeout_s=0.5)
    with pytest.raises(TimeoutError, match="dist-silent.*version 7"):
        channel.fetch(7)
    channel.close()


def test_pipeline_runs_on_the_broadcast_channel(ray_local, tmp_path):
    from test_pipeline import small_config

    from rollart.pipelines.agentic import AgenticPipeline

    cfg = small_config(tmp_path, steps=2, checkpoint_every=0, weights={"channel": "dist"})
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
        versions = [w["weight_version"] for w in pipe.infer.metrics().result()]
    finally:
        pipe.shutdown()
    assert [h["version"] for h in history] == [1, 2] and versions == [2]
    assert all(h["max_staleness"] <= cfg.rollout.alpha for h in history)


def test_a_destroyed_channel_leaves_no_receivers_to_a_later_job_of_its_name(ray_local):
    """A job's channel is found by name; the job's end (``destroy``) ends its coordinator, so the next job of
    that name (a second pipeline in one process and Ray) counts its receivers from none."""
    first = TorchBroadcastChannel("dist-reused", num_receivers=1, timeout_s=5)
    assert ray.get(first._coordinator.join.remote("host:1:worker-a", "receiver")) == 1
    stale = TorchBroadcastChannel("dist-reused", num_receivers=1, timeout_s=5)  # the first one's coordinator
    with pytest.raises(ray.exceptions.RayTaskError, match="one too many"):
        ray.get(stale._coordinator.join.remote("host:2:worker-b", "receiver"))
    first.destroy()
    second = TorchBroadcastChannel("dist-reused", num_receivers=1, timeout_s=5)
    assert ray.get(second._coordinator.join.remote("host:2:worker-b", "receiver")) == 1
    second.destroy()
