"""Weights through a real Mooncake store: a ``mooncake_master`` rollart starts on 127.0.0.1, a publisher
and readers in separate Ray worker processes, torn snapshots refused, an inference worker that swaps
in a fetched version between engine steps, and the pipeline running on the Mooncake channel."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from rollart.weights.mooncake_master import MooncakeUnavailable

pytestmark = pytest.mark.timeout(300)


def _require_mooncake() -> None:
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as err:  # OSError: libibverbs1 missing
        if os.environ.get("CI"):
            raise
        pytest.skip(
            f"Mooncake store not importable ({err}): pip install 'rollart[mooncake]', apt-get install libibverbs1"
        )


@pytest.fixture(scope="module")
def master():
    _require_mooncake()
    from rollart.weights.mooncake_channel import close_clients
    from rollart.weights.mooncake_master import MooncakeMaster

    m = MooncakeMaster(lease_ttl_ms=200).start()
    yield m
    close_clients()
    m.stop()


@pytest.fixture
def own_master():
    """A master of the test's own: the store left by the module's earlier tests does not fill its segments."""
    _require_mooncake()
    from rollart.weights.mooncake_channel import close_clients
    from rollart.weights.mooncake_master import MooncakeMaster

    close_clients()
    m = MooncakeMaster(lease_ttl_ms=200).start()
    yield m
    close_clients()
    m.stop()


def sample_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(300, 1000, generator=g),  # 1.2 MB: several 1 MiB chunks
        "bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "count": torch.arange(5, dtype=torch.int64) + step,
        "empty": torch.empty(0, 3),
    }


@ray.remote(num_cpus=0)
class Publisher:
    def publish(self, channel, step: int, wait: bool) -> int:
        if wait:
            return channel.publish(sample_state(step), step)
        channel.publish_async(sample_state(step), step).result()
        return step


@ray.remote(num_cpus=0)
class Reader:
    def fetch(self, channel, version: int) -> dict[str, torch.Tensor]:
        return channel.fetch(version)

    def latest(self, channel) -> int | None:
        return channel.latest()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_versions_cross_processes_and_only_the_newest_are_kept(ray_local, master):
    from rollart.weights.mooncake_channel import MooncakeChannel

    channel = MooncakeChannel("cross", master.address, keep=2, chunk_mb=1, segment_mb=32, timeout_s=30)
    pub, readers = Publisher.remote(), [Reader.remote(), Reader.remote()]
    # readers wait for a version that is not written yet: fetch blocks until its manifest appears
    waiting = [r.fetch.remote(channel, 0) for r in readers]
    assert ray.get(pub.publish.remote(channel, 0, True)) >= sum(
        t.numel() * t.element_size() for t in sample_state(0).values()
    )
    assert all(same(got, sample_state(0)) for got in ray.get(waiting))
    for step in (1, 2):
        ray.get(pub.publish.remote(channel, step, False))
    assert ray.get([r.latest.remote(channel) for r in readers]) == [2, 2]
    assert all(same(got, sample_state(2)) for got in ray.get([r.fetch.remote(channel, 2) for r in readers]))
    assert same(ray.get(readers[0].fetch.remote(channel, 1)), sample_state(1))
    # every remote call hands the publisher a fresh copy of the channel: retention must still hold
    for step in (3, 4, 5):
        ray.get(pub.publish.remote(channel, step, False))
    quick = MooncakeChannel("cross", master.address, timeout_s=0.5)
    with pytest.raises(TimeoutError, match="version 3 was not published"):  # never read: removed at once
        quick.fetch(3)
    assert same(quick.fetch(5), sample_state(5))


def test_a_reader_that_dies_takes_no_key_of_the_channel_with_it(ray_local, own_master):
    """Every key lives in the publisher's segment: an inference worker killed after it joined the
    store (and so mounted a segment the master could place keys in) costs the channel nothing."""
    from rollart.weights.mooncake_channel import MooncakeChannel

    channel = MooncakeChannel("survive", own_master.address, keep=2, chunk_mb=1, segment_mb=32, timeout_s=30)
    reader = Reader.remote()
    assert ray.get(reader.latest.remote(channel)) is None  # the reader's segment is mounted now
    for step in range(6):
        channel.publish(sample_state(step), step)
    assert ray.get(reader.latest.remote(channel)) == 5
    ray.kill(reader)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(reader.latest.remote(channel))
    fresh = MooncakeChannel("survive", own_master.address, keep=2, chunk_mb=1, segment_mb=32, timeout_s=0.5)
    assert fresh.latest() == 5
    assert same(fresh.fetch(5), sample_state(5)) and same(fresh.fetch(4), sample_state(4))
    channel.publish(sample_state(6), 6)  # and the publisher goes on: its index is readable
    assert fresh.latest() == 6 and same(fresh.fetch(6), sample_state(6))


def test_only_the_newest_versions_stay_in_the_store(master):
    from rollart.weights.mooncake_channel import MooncakeChannel

    channel = MooncakeChannel("keep", master.address, keep=2, chunk_mb=1, segment_mb=32, timeout_s=0.5)
    for step in range(4):
        channel.publish(sample_state(step), step)
    assert channel.latest() == 3 and same(channel.fetch(2), sample_state(2))
    for gone in (0, 1):  # nobody read them, so no lease holds them: removed at once
        with pytest.raises(TimeoutError, match=f"version {gone} was not published"):
            channel.fetch(gone)
    # a restarted trainer (a new channel object) republishes version 3 from its checkpoint, then goes on
    restarted = MooncakeChannel("keep", master.address, keep=2, chunk_mb=1, segment_mb=32, timeout_s=0.5)
    restarted.publish(sample_state(7), 3)
    assert same(restarted.fetch(3), sample_state(7))
    restarted.publish(sample_state(4), 4)
    assert same(restarted.fetch(4), sample_state(4)) and same(restarted.fetch(3), sample_state(7))
    with pytest.raises(TimeoutError, match="version 2 was not published"):
        restarted.fetch(2)


def test_a_version_a_reader_touched_is_removed_once_its_lease_runs_out(own_master):
    """Leases (200 ms on this master) hold the versions readers read; the publisher retries those at
    every publish and must not renew them while it does (the master grants a lease on every existence
    check): a version read once is gone a few leases later, however often the publisher publishes,
    and the same holds for a host's relay copy."""
    import json
    import time

    from rollart.weights.mooncake_channel import MooncakeChannel

    channel = MooncakeChannel("lease", own_master.address, keep=2, chunk_mb=1, segment_mb=64, timeout_s=30)
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    store = channel._store()

    def doomed() -> list[int]:
        return [v for v, _ in json.loads(store.get(f"{channel.prefix}/index"))["doomed"]]

    for v in range(3):  # version 0 is dropped at v2's publish, while its read's lease still holds it
        channel.publish(small, v)
        assert same(channel.fetch(v), small)
    assert doomed() == [0]
    deadline, v = time.monotonic() + 10.0, 3
    while 0 in doomed() and time.monotonic() < deadline:  # publishes and reads far more often than 200 ms
        channel.publish(small, v)
        channel.fetch(v)
        v += 1
    assert 0 not in doomed(), f"version 0 still held after {v - 3} more publishes"
    with pytest.raises(TimeoutError, match="version 0 was not published"):
        MooncakeChannel("lease", own_master.address, timeout_s=0.2).fetch(0)
    # a relay copy: read (leased), then dropped again and again until it goes
    flat, manifest = channel.fetch_manifest_into(v - 1, lambda n: torch.empty(n, dtype=torch.uint8))
    channel.put_copy(flat, manifest, "10.0.0.9")
    channel.fetch_into(v - 1, lambda n: torch.empty(n, dtype=torch.uint8), holder="10.0.0.9", timeout_s=5)
    deadline, tries = time.monotonic() + 10.0, 1
    while not channel.drop_copy(v - 1, manifest["chunks"], "10.0.0.9") and time.monotonic() < deadline:
        tries += 1
    assert time.monotonic() < deadline, f"the relay copy still held after {tries} drops"


def _resident_pages(ranges: list[tuple[int, int]]) -> tuple[int, int]:
    """Of the whole pages inside ``ranges`` (this process's memory): how many are resident, and how many."""
    import ctypes
    import mmap

    from rollart.weights.segment_pages import whole_pages

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for addr, size in ranges:
        start, length = whole_pages(addr, size)
        n = length // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * max(n, 1))()
        assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
        resident += sum(b & 1 for b in vec[:n])
        total += n
    return resident, total


def test_a_held_version_gives_its_pages_back_once_it_is_removed(own_master):
    """A version a reader read stays in the publisher's segment past its drop (the reader's lease), while
    newer versions take new places there; once it is removed, its pages go back to the system. Else the
    publisher's resident memory climbs with every held version (a fast trainer with readers: +1 MB/min in
    a soak), towards the whole segment."""
    import json
    import time

    from rollart.weights.mooncake_channel import MooncakeChannel

    channel = MooncakeChannel("pages", own_master.address, keep=2, chunk_mb=1, segment_mb=64, timeout_s=30)
    store = channel._store()
    state = sample_state(0)  # 1.2 MB: a chunk of 1 MiB and one of 0.2 MiB
    channel.publish(state, 0)
    assert same(channel.fetch(0), state)  # read: leased
    keys = [f"{channel.prefix}/v0/chunk{i}" for i in range(2)]
    ranges = []
    for key in keys:
        buf = store.get_replica_desc(key)[0].get_memory_descriptor().buffer_descriptor
        ranges.append((buf.buffer_address, buf.size))
    resident, total = _resident_pages(ranges)
    assert total > 250 and resident == total  # in this process's segment, written

    def doomed() -> list[int]:
        return [v for v, _ in json.loads(store.get(f"{channel.prefix}/index"))["doomed"]]

    for v in (1, 2):
        channel.publish(state, v)
    assert doomed() == [0]  # dropped, held by the lease
    deadline, v = time.monotonic() + 10.0, 3
    while 0 in doomed() and time.monotonic() < deadline:
        channel.publish(state, v)
        v += 1
    assert 0 not in doomed(), "version 0 was never removed"
    resident, total = _resident_pages(ranges)
    # removed: its pages are back (the index, written after the removal, may take a page or two of them)
    assert resident <= 4, f"{resident} of the {total} pages of a removed version are still resident"
    assert same(channel.fetch(v - 1), state)  # the newest version, in the same segment, is whole


def test_a_background_publish_owns_its_bytes_once_it_returns(master):
    """The trainer hands its live tensors to ``publish_async`` and trains on at once: the channel packs
    them into its reused buffer before returning, so later changes to those tensors never reach that
    version, and the next version packed into the same buffer leaves the one in the store intact."""
    from rollart.weights.mooncake_channel import MooncakeChannel

    channel = MooncakeChannel("bg", master.address, keep=3, chunk_mb=1, segment_mb=32, timeout_s=30)
    live = sample_state(0)
    first = channel.publish_async(live, 0)
    for t in live.values():  # the "next train step" writes the live tensors while the write goes on
        t.zero_() if t.dtype != torch.int64 else t.fill_(-1)
    second = channel.publish_async(live, 1)  # waits for version 0's write before packing again
    assert first.done()
    second.result()
    assert same(channel.fetch(0), sample_state(0))
    assert same(channel.fetch(1), live)


def test_relay_a_root_host_keeps_copies_for_its_children_and_drops_them_with_its_cache(ray_local, own_master):
    """Relay tree over [this host, another]: this host reads from the publisher and keeps a copy of each
    version in its own segment for its child, readable under its IP; a version its cache drops goes
    from the store as well."""
    from rollart.weights import HostSharedChannel
    from rollart.weights.host_cache import host_cache_stats
    from rollart.weights.mooncake_channel import MooncakeChannel

    ip = ray.util.get_node_ip_address()
    inner = MooncakeChannel("relay-root", own_master.address, keep=2, chunk_mb=1, segment_mb=32, timeout_s=30)
    channel = HostSharedChannel(inner, keep=2, relay=[ip, "127.0.0.2"])
    reader = Reader.remote()
    for v in (1, 2, 3):
        inner.publish(sample_state(v), v)
        assert same(ray.get(reader.fetch.remote(channel, v)), sample_state(v))
    [stats] = host_cache_stats("relay-root")
    assert stats["relay_parent"] is None and stats["relay_fallbacks"] == 0 and stats["sources"] == ["publisher"] * 3
    flat, layout = inner.fetch_into(3, lambda n: torch.empty(n, dtype=torch.uint8), holder=ip, timeout_s=5)
    from rollart.weights.snapshot import unpack_state

    assert same(unpack_state(flat, layout), sample_state(3))
    with pytest.raises(TimeoutError, match=f"version 1 was not a copy on {ip}"):  # dropped with the cache's v1
        inner.fetch_into(1, lambda n: torch.empty(n, dtype=torch.uint8), holder=ip, timeout_s=0.5)
    ray.kill(reader, no_restart=True)


def test_relay_a_host_whose_parent_has_no_copy_reads_from_the_publisher(ray_local, own_master):
    """The parent in the relay tree is no Ray node (its host is gone): this host leaves the relay at its
    first fetch and reads every version from the publisher, and every version is right."""
    from rollart.weights import HostSharedChannel
    from rollart.weights.host_cache import host_cache_stats
    from rollart.weights.mooncake_channel import MooncakeChannel

    ip = ray.util.get_node_ip_address()
    inner = MooncakeChannel("relay-orphan", own_master.address, keep=2, chunk_mb=1, segment_mb=32, timeout_s=30)
    channel = HostSharedChannel(inner, keep=2, relay=["127.0.0.2", ip], relay_wait_s=1.0)
    reader = Reader.remote()
    for v in (1, 2):
        inner.publish(sample_state(v), v)
        assert same(ray.get(reader.fetch.remote(channel, v)), sample_state(v))
    [stats] = host_cache_stats("relay-orphan")
    assert stats["relay_parent"] is None and stats["relay_fallbacks"] == 1
    assert stats["sources"] == ["publisher", "publisher"]
    ray.kill(reader, no_restart=True)


def _until(predicate, what: str, timeout_s: float = 60.0):
    """Poll ``predicate`` until it holds (its value), or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return value


def test_a_retired_channel_frees_its_caches_and_refuses_every_read_at_once(ray_local, own_master):
    """A trainer restart replaces the channel: ``close_caches`` frees the versions its host caches hold,
    a fetch still waiting for a version the dead trainer never finished stops (not after ``timeout_s``),
    a reader that asks later (a worker still starting) is refused at once by the tombstone instead of
    making a new cache and waiting, and the tombstone ends after its grace."""
    from rollart.weights import HostSharedChannel
    from rollart.weights.host_cache import SupersededVersion, host_cache_stats
    from rollart.weights.mooncake_channel import FetchStopped, MooncakeChannel

    inner = MooncakeChannel("retire-me", own_master.address, keep=2, chunk_mb=1, segment_mb=32, timeout_s=300)
    channel = HostSharedChannel(inner, keep=2)
    channel.start_caches([ray.get_runtime_context().get_node_id()])  # this process owns the cache, as the driver
    inner.publish(sample_state(1), 1)
    reader, late = Reader.remote(), Reader.remote()
    assert same(ray.get(reader.fetch.remote(channel, 1)), sample_state(1))
    waiting = reader.fetch.remote(channel, 2)  # never published: waits up to timeout_s (300 s)
    _until(lambda: host_cache_stats("retire-me")[0]["loading"] == [2], "the fetch of version 2 in flight")
    channel.close_caches(grace_s=600)
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(waiting, timeout=120)
    assert isinstance(err.value.cause, FetchStopped), err.value  # stopped, not timed out
    [stats] = host_cache_stats("retire-me")
    assert stats["retired"] and stats["cached"] == [] and stats["loading"] == [], stats
    with pytest.raises(ray.exceptions.RayTaskError) as err:  # a fresh reader: refused, no new cache
        ray.get(late.fetch.remote(channel, 1), timeout=120)
    assert isinstance(err.value.cause, SupersededVersion) and "replaced" in str(err.value.cause)
    assert [s["pid"] for s in host_cache_stats("retire-me")] == [stats["pid"]]
    # with no grace the tombstone ends once idle
    inner2 = MooncakeChannel("retire-now", own_master.address, keep=2, chunk_mb=1, segment_mb=32, timeout_s=30)
    channel2 = HostSharedChannel(inner2, keep=2)
    inner2.publish(sample_state(1), 1)
    assert same(ray.get(reader.fetch.remote(channel2, 1)), sample_state(1))
    channel2.close_caches(grace_s=0)
    _until(lambda: host_cache_stats("retire-now") == [], "the retired cache ended")
    for r in (reader, late):
        ray.kill(r, no_restart=True)


def test_snapshot_checksum_is_crc32_and_older_sha256_manifests_still_verify():
    from rollart.weights.snapshot import ChecksumMismatch, flat_checksum, pack_state, verify_flat

    flat, layout = pack_state(sample_state(3))
    crc = flat_checksum(flat, layout)
    assert crc.startswith("crc32:") and len(crc) == len("crc32:") + 8
    verify_flat(flat, layout, crc, 3)
    verify_flat(flat, layout, flat_checksum(flat, layout, "sha256"), 3)  # a manifest written before
    flat[100] ^= 1  # one flipped bit
    for expected in (crc, flat_checksum(pack_state(sample_state(3))[0], layout, "sha256")):
        with pytest.raises(ChecksumMismatch, match="version 3"):
            verify_flat(flat, layout, expected, 3)
    moved = [dict(item, offset=item["offset"] + 64) for item in layout]  # the same bytes, another layout
    flat[100] ^= 1
    assert flat_checksum(flat, moved) != crc


async def test_a_torn_snapshot_is_refused_and_the_engine_keeps_serving_its_version(ray_local, make_rm, master):
    import tempfile

    from transformers import AutoModelForCausalLM

    import rollart as ra
    from rollart.models import build_tiny
    from rollart.rollout.inference_worker import inference_worker_class
    from rollart.rollout.types import GenerateRequest
    from rollart.weights.mooncake_channel import MooncakeChannel, _Client
    from rollart.weights.snapshot import ChecksumMismatch

    path = build_tiny(tempfile.mkdtemp(prefix="tiny-mc-"), hidden_size=32, num_layers=1, intermediate_size=64)
    rm = make_rm({"rollout": {"hardware": "CPU", "cpus": 1}})
    cluster = ra.Cluster(
        "mc_infer",
        inference_worker_class({"*": ["CPU"]}),
        rm,
        pool="rollout",
        worker_kwargs={"engine": {"kind": "torch", "model": str(path)}},
    )
    try:
        channel = MooncakeChannel("torn", master.address, chunk_mb=1, segment_mb=32, timeout_s=30)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        greedy = {"temperature": 0.0, "max_new_tokens": 8}
        req = GenerateRequest(request_id="a", prompt_token_ids=[1, 5, 6, 7], sampling=greedy)
        before = await cluster.generate(req, tag_name="x")

        with torch.no_grad():  # perturb parameters (tied embeddings stay tied), then ship the state dict
            for p in model.parameters():
                p.add_(0.5 * torch.randn_like(p))
        new_state = {k: v.clone() for k, v in model.state_dict().items()}
        channel.publish(new_state, 1)
        assert (await cluster.load_weights_from(channel, 1)) == [1]
        after = await cluster.generate(req.model_copy(update={"request_id": "b"}), tag_name="x")
        expected = model.generate(
            torch.tensor([[1, 5, 6, 7]]),
            do_sample=False,
            max_new_tokens=8,
            attention_mask=torch.ones(1, 4, dtype=torch.long),
            pad_token_id=0,
        )
        assert after.output_token_ids == expected[0, 4:].tolist()[: len(after.output_token_ids)]
        assert after.token_versions == [1] * len(after.output_token_ids)
        assert after.output_token_ids != before.output_token_ids

        channel.publish({k: v * 2 for k, v in new_state.items()}, 2)
        store = _Client.get(master.address, channel.segment_mb, channel.buffer_mb)
        raw = bytearray(store.get(f"{channel.prefix}/v2/chunk0"))
        raw[100] ^= 0xFF  # one flipped byte: what a torn or corrupted transfer looks like
        assert store.upsert(f"{channel.prefix}/v2/chunk0", bytes(raw)) == 0
        with pytest.raises(ChecksumMismatch, match="weights version 2"):
            channel.fetch(2)
        with pytest.raises(Exception, match="checksum"):
            await cluster.load_weights_from(channel, 2)
        assert (await cluster.metrics())[0]["weight_version"] == 1
        again = await cluster.generate(req.model_copy(update={"request_id": "c"}), tag_name="x")
        assert again.output_token_ids == after.output_token_ids and set(again.token_versions) == {1}
    finally:
        cluster.shutdown()


def test_unreachable_master_is_a_clear_error():
    _require_mooncake()
    from rollart.resource_manager.net import free_port
    from rollart.weights.mooncake_channel import MooncakeChannel, MooncakeStoreError

    channel = MooncakeChannel("nowhere", f"127.0.0.1:{free_port()}", segment_mb=8, timeout_s=1)
    with pytest.raises((MooncakeStoreError, MooncakeUnavailable), match="Mooncake master"):
        channel.publish({"x": torch.zeros(3)}, 0)


async def test_the_newest_version_is_served_and_superseded_ones_are_skipped(ray_local, make_rm, own_master):
    """Versions 2 and 3 are published while every worker still loads version 1: version 2 is never
    fetched (by any host) nor loaded, and every worker ends on version 3 — two real inference workers,
    their host's shared cache and a real Mooncake store."""
    master = own_master
    import asyncio
    import tempfile

    from transformers import AutoModelForCausalLM

    import rollart as ra
    from rollart.models import build_tiny
    from rollart.rollout.async_controller import NewestVersionLoader
    from rollart.rollout.inference_worker import inference_worker_class
    from rollart.weights.host_cache import HostSharedChannel, host_cache_stats
    from rollart.weights.mooncake_channel import MooncakeChannel

    path = build_tiny(tempfile.mkdtemp(prefix="tiny-mc-"), hidden_size=32, num_layers=1, intermediate_size=64)
    rm = make_rm({"rollout": {"hardware": "CPU", "cpus": 2}})
    cluster = ra.Cluster(
        "mc_newest",
        inference_worker_class({"*": ["CPU"]}),
        rm,
        pool="rollout",
        worker_kwargs={"engine": {"kind": "torch", "model": str(path)}},
    )
    try:
        assert len(cluster.workers) == 2
        channel = HostSharedChannel(
            MooncakeChannel("newest", master.address, keep=3, chunk_mb=1, segment_mb=32, timeout_s=30), keep=2
        )
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        states = {v: {k: t + 0.01 * v for k, t in base.items()} for v in (1, 2, 3)}
        loading, release = asyncio.Event(), asyncio.Event()

        async def load(version: int) -> None:
            if version == 1:  # version 1 stays in flight until 2 and 3 are published
                loading.set()
                await release.wait()
            assert await cluster.load_weights_from(channel, version) == [version, version]

        loader = NewestVersionLoader(load)
        channel.publish(states[1], 1)
        loader.offer(1)
        await loading.wait()
        for v in (2, 3):
            channel.publish(states[v], v)
            loader.offer(v)
        release.set()
        await loader.wait()
        assert loader.loaded == [1, 3] and loader.skipped == [2] and loader.served == 3
        assert [m["weight_version"] for m in await cluster.metrics()] == [3, 3]
        [stats] = host_cache_stats("newest")  # one host: each version it served fetched once
        assert stats["fetches"] == [1, 3] and stats["cached"] == [1, 3]
        # a reader that asks for a version older than the host keeps is told to load a newer one
        with pytest.raises(Exception, match="no longer cached"):
            await cluster.load_weights_from(channel, 0)
        assert [m["weight_version"] for m in await cluster.metrics()] == [3, 3]
    finally:
        cluster.shutdown()


def test_pipeline_runs_on_the_mooncake_channel(ray_local, tmp_path):
    _require_mooncake()
    from test_pipeline import read, small_config

    from rollart.pipelines.agentic import AgenticPipeline

    cfg = small_config(tmp_path, steps=3, checkpoint_every=0, weights={"channel": "mooncake", "segment_mb": 32})
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        assert pipe.weights.master is not None and pipe.weights.master.alive()
        history = pipe.run()
        versions = [w["weight_version"] for w in pipe.infer.metrics().result()]
    finally:
        pipe.shutdown()
    assert pipe.weights.master.pid is None  # the master rollart started is stopped with the job
    assert [h["version"] for h in history] == [1, 2, 3] and versions == [3]  # the run ends on the newest
    assert all(h["max_staleness"] <= cfg.rollout.alpha for h in read(tmp_path / "run" / "metrics.jsonl"))
    # the driver never waited for a version: each was loaded or skipped for a newer one, in order
    loader = pipe.weights.loader
    assert loader is not None and loader.offered == [1, 2, 3] and loader.loaded[-1] == 3
    assert loader.loaded == sorted(loader.loaded) and sorted(loader.loaded + loader.skipped) == [1, 2, 3]
    # with versions in flight, no token is older than its trajectory's start version (the alpha bound's base)
    trajs = pipe.scheduler.completed_trajectories
    assert trajs and all(t.min_version >= t.start_version for t in trajs)
