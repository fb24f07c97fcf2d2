"""Weight channel over a Mooncake store (RollArt paper §5.2 "cross-cluster weight synchronisation").

The trainer publishes a versioned snapshot into the store and goes on training; inference workers,
possibly in another cluster, fetch it when they are ready (on resume). Layout of version ``v``
under the channel's prefix ``rollart/<name>``::

    rollart/<name>/v<v>/chunk<i>     the snapshot's bytes, all tensors back to back, cut in chunks
    rollart/<name>/v<v>/manifest     JSON: version, chunk count, and per tensor name, dtype, shape,
                                     byte offset, and the checksum of that layout and the bytes
                                     (CRC-32, checked before unpacking) — written after every chunk
    rollart/<name>/latest            the newest version whose manifest is written (upserted last)

Invariants: a reader sees a version only through its manifest, which is written after all its
chunks, and a reader returns a snapshot only if its checksum equals the manifest's — so an engine
never loads a half-written or mixed snapshot. Only the newest ``keep`` versions are kept.

The store is reached over TCP or RDMA (``protocol``; RDMA names its devices, e.g. ``mlx5_0,mlx5_1``).
Each process mounts its own segment once (``segment_mb``) and joins through the master with
peer-to-peer handshakes, so no separate metadata server is needed; its transfer engine is bound to
its own host's address: ``MC_TCP_BIND_ADDRESS`` if set, else the process's Ray node IP (127.0.0.1 on
a one-machine Ray), so peers on other hosts can reach the segment.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import mmap
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from rollart.resource_manager.net import node_ip
from rollart.weights import segment_pages
from rollart.weights.mooncake_master import MooncakeUnavailable, library_fix, missing_library
from rollart.weights.snapshot import (
    pack_into,
    pack_state,
    packed_chunks,
    packed_nbytes,
    snapshot_layout,
    unpack_state,
    verify_flat,
)
from rollart.weights.stream import Part, TensorMeta

logger = logging.getLogger(__name__)

__all__ = ["MooncakeChannel", "MooncakeStoreError", "close_clients", "pack_state", "unpack_state"]


class FetchStopped(RuntimeError):
    """A reader stopped waiting for a version (its channel was replaced)."""


class MooncakeStoreError(RuntimeError):
    """A Mooncake store call returned an error code."""


OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode for a key that is not in the store


def _remove_keys(store: Any, keys: list[str]) -> bool:
    """Remove ``keys``; True when none of them is left. A key a reader still holds a lease on is refused
    (``OBJECT_HAS_LEASE``) and stays: the caller tries again later, once the lease has run out. Whether
    a key is gone is read from ``remove``'s own code, never asked of the master: the master grants a
    lease on every existence check (``is_exist``), so a retry that asked would renew the lease it waits
    for, and a version a reader had touched would never be removed (each publish then retried all of
    them: measured, a publish grew from 7 to 70 ms over 1 200 versions)."""
    return all(code in (0, OBJECT_NOT_FOUND) for code in [store.remove(k) for k in keys])


def _page_padded(data: Any) -> Any:
    """A small value (manifest, ``latest``, the index: ``bytes``) padded with spaces to whole pages, which
    ``json.loads`` and ``int`` ignore; a chunk (a ``memoryview``) as it is.

    The master places every key in this process's segment with a size-class allocator, and the pages a
    removed key used stay resident unless they are given back (only a held version's are: see
    :func:`_own_ranges`). Small values of ever-changing sizes (the index grows and shrinks with the
    versions waiting for a lease, ``latest`` and the manifest with the version's digits) took pieces
    out of the places of removed chunks, so the next chunk no longer fitted there and went to fresh pages
    further into the segment: with readers holding leases the segment's resident span crept, publish
    after publish (a 30-minute soak's train rank: +0.57 KB a publish, a 10 → 21 MB mapping). Padded to
    whole pages they reuse each other's places instead. Measured with 20 000 publishes and a reader holding
    leases: a reader of every version, span 6 → 8 MB and +0.105 KB a publish before, 6 MB flat after; a
    reader skipping versions, 4 → 5 MB and +0.111 KB before, 3 → 4 MB and +0.061 KB after (slower, not
    stopped: pages of keys removed at once are still not given back)."""
    if not isinstance(data, bytes):
        return data
    return data + b" " * (-len(data) % mmap.PAGESIZE)


# A removed key's place in this process's segment may be handed to the next put at once: its pages are given
# back (``segment_pages.release``) under this lock, which every put of this process also takes, so no put of
# this process lands in a place between its removal and the release (and is zeroed by it). Another process's
# put lands there only when its own segment is full, and readers verify every snapshot's checksum.
_SEGMENT_LOCK = threading.Lock()


def _own_ranges(store: Any, keys: list[str], own: dict[str, bool]) -> dict[str, tuple[int, int]]:
    """Address and size of each of ``keys`` whose bytes sit in this process's own segment (a key not in
    the store, or placed in another process's segment, is left out); ``own`` caches which transport
    endpoints are this process's. Asking grants a lease on the keys."""
    out = {}
    for key, replicas in store.batch_get_replica_desc(keys).items():
        for r in replicas:
            if not r.is_memory_replica():
                continue
            buf = r.get_memory_descriptor().buffer_descriptor
            endpoint = str(buf.transport_endpoint)
            if endpoint not in own:
                own[endpoint] = segment_pages.is_own_endpoint(endpoint)
            if own[endpoint]:
                out[key] = (int(buf.buffer_address), int(buf.size))
    return out


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this machine (a socket can bind it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def _ray_node_count() -> int | None:
    """Alive nodes of the Ray cluster this process belongs to (None without Ray)."""
    import ray

    if not ray.is_initialized():
        return None
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def loopback_segment_problem(host: str, master: str, ray_nodes: int | None) -> str | None:
    """A client segment advertised on a loopback address where other hosts take part (the master on
    another address, or a Ray cluster of several nodes): every transfer from another host to it would fail
    and be retried until ``weights.timeout_s``. What is wrong and the fix, or None."""
    if not _is_loopback(host):
        return None
    master_host = master.rsplit(":", 1)[0].strip("[]")
    several_nodes = ray_nodes is not None and ray_nodes > 1
    if not several_nodes and (_is_loopback(master_host) or _is_local_address(master_host)):
        return None  # one machine: loopback is right
    where = f"the Ray cluster has {ray_nodes} nodes" if several_nodes else f"the master is at {master}, on another host"
    source = (
        f"MC_TCP_BIND_ADDRESS={os.environ['MC_TCP_BIND_ADDRESS']}"
        if os.environ.get("MC_TCP_BIND_ADDRESS")
        else "this process's Ray node IP"
    )
    return (
        f"the Mooncake segment of this process would be advertised on {host} ({source}), which no other host "
        f"can reach, but {where}: transfers to it would fail until weights.timeout_s. Unset MC_TCP_BIND_ADDRESS "
        "(rollart then uses the node's Ray IP) or set it to this host's address on the network the other hosts "
        "reach; on a multi-host cluster start every Ray node with --node-ip-address=<that address>"
    )


class _Client:
    """One ``MooncakeDistributedStore`` per process and master address."""

    _lock = threading.Lock()
    _by_master: dict[str, Any] = {}

    @classmethod
    def get(cls, master: str, segment_mb: int, buffer_mb: int, protocol: str = "tcp", rdma_devices: str = "") -> Any:
        with cls._lock:
            if master in cls._by_master:
                return cls._by_master[master]
            host = os.environ.get("MC_TCP_BIND_ADDRESS") or node_ip()
            problem = loopback_segment_problem(host, master, _ray_node_count())
            if problem is not None:
                raise MooncakeStoreError(problem)
            os.environ["MC_TCP_BIND_ADDRESS"] = host
            os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every connection at INFO
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as err:
                library = missing_library(str(err))
                if library is not None:
                    raise MooncakeUnavailable(
                        f"weights.channel=mooncake: the Mooncake store cannot load the shared library {library}; "
                        f"{library_fix(library)}"
                    ) from err
                raise MooncakeUnavailable(
                    "weights.channel=mooncake needs pip install 'rollart[mooncake]' and apt-get install libibverbs1 "
                    f"({err})"
                ) from err
            host_port = master.rsplit(":", 1)
            try:
                socket.create_connection((host_port[0], int(host_port[1])), timeout=3).close()
            except (OSError, ValueError, IndexError) as err:
                raise MooncakeStoreError(
                    f"no Mooncake master answers at {master!r} ({err}); set "
                    "weights.mooncake_master to host:port of a running master, or leave it "
                    "empty and rollart starts one"
                ) from err
            store = MooncakeDistributedStore()
            rc = store.setup(host, "P2PHANDSHAKE", segment_mb << 20, buffer_mb << 20, protocol, rdma_devices, master)
            if rc != 0:
                raise MooncakeStoreError(
                    f"could not join the Mooncake master at {master} from {host} over {protocol}"
                    f"{' (' + rdma_devices + ')' if rdma_devices else ''} (code {rc}); is "
                    "weights.mooncake_master reachable, and are weights.rdma_devices right?"
                )
            logger.info("Mooncake client on %s joined master %s over %s", host, master, protocol)
            cls._by_master[master] = store
            return store


class _Publisher:
    """A publishing process's state for one channel: the flat buffer it packs every version into
    (reused, so a publish does not allocate and fault in a snapshot's worth of fresh pages) and the one
    background thread that writes it. A channel object reaches the trainer as a fresh copy in every
    remote call, so this lives per process, not in the channel."""

    _lock = threading.Lock()
    _by_channel: dict[tuple[str, str], _Publisher] = {}

    def __init__(self, name: str):
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mooncake-{name}")
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.pending: Future | None = None
        self.lock = threading.Lock()  # one publish of this channel at a time packs into the buffer
        self._staging = torch.empty(0, dtype=torch.uint8)
        # where the keys of the versions waiting for a reader's lease sit in this process's segment: their
        # pages are given back the moment each key is removed (see :mod:`~rollart.weights.segment_pages`)
        self.held: dict[str, tuple[int, int]] = {}
        self.own_endpoints: dict[str, bool] = {}  # transport endpoint -> whether it is this process's

    def staging(self, nbytes: int) -> torch.Tensor:
        """A reused buffer of at least ``nbytes`` for a streamed publish's chunk."""
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging

    @classmethod
    def of(cls, master: str, name: str) -> _Publisher:
        with cls._lock:
            if (master, name) not in cls._by_channel:
                cls._by_channel[(master, name)] = cls(name)
            return cls._by_channel[(master, name)]

    def pack(self, state: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """``state`` packed into the reused buffer, and its layout; call it holding :attr:`lock`. Waits for
        the previous background write first (it reads the buffer); that write's outcome stays in its
        future, with its caller."""
        if self.pending is not None:
            wait([self.pending])
            self.pending = None
        layout = snapshot_layout(state)
        nbytes = packed_nbytes(layout)
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        flat = self.buffer[:nbytes]
        pack_into(state, layout, flat)
        return flat, layout


def close_clients() -> None:
    """Leave every Mooncake store this process joined (before its master goes away)."""
    with _Client._lock:
        for store in _Client._by_master.values():
            store.close()
        _Client._by_master.clear()


class MooncakeChannel:
    """Serializable handle to a weight channel in a Mooncake store; pass it to trainer and workers alike.

    ``publish`` blocks until the snapshot is in the store; ``publish_async`` returns a future at once
    (the trainer's next step runs while the bytes move). ``fetch(version)`` waits up to ``timeout_s``
    for that version's manifest, then reads and verifies it.
    """

    packs_on_publish = True  # publish_async copies the tensors into its own buffer before it returns

    def __init__(
        self,
        name: str,
        master: str,
        *,
        keep: int = 2,
        chunk_mb: int = 16,
        segment_mb: int = 256,
        buffer_mb: int = 64,
        timeout_s: float = 120.0,
        protocol: str = "tcp",
        rdma_devices: list[str] | str = "",
    ):
        if keep < 1:
            raise ValueError("weights.keep must be >= 1")
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"weights.protocol must be 'tcp' or 'rdma', not {protocol!r}")
        devices = rdma_devices if isinstance(rdma_devices, str) else ",".join(rdma_devices)
        if protocol == "rdma" and not devices:
            raise ValueError(
                "weights.rdma_devices: protocol rdma needs the RDMA device names, "
                "e.g. rdma_devices: [mlx5_0, mlx5_1] (see `ibv_devices`)"
            )
        self.protocol = protocol
        self.rdma_devices = devices
        self.name = name
        self.master = master
        self.keep = keep
        self.chunk_bytes = chunk_mb << 20
        self.segment_mb = segment_mb
        self.buffer_mb = buffer_mb
        self.timeout_s = timeout_s

    @property
    def prefix(self) -> str:
        return f"rollart/{self.name}"

    def _store(self) -> Any:
        return _Client.get(self.master, self.segment_mb, self.buffer_mb, self.protocol, self.rdma_devices)

    def _put(self, key: str, data: Any, *, upsert: bool = False) -> None:
        """Into this process's own segment (a memory copy, no transfer: the readers pull from here).

        Every key a publisher writes (chunks, manifests, ``latest``, the index) lives in the
        publisher's segment: a key the master placed in a reader's segment would vanish with that
        reader (a killed inference worker unmounts its segment), and the channel with it. Only when
        the own segment is full does the master place it elsewhere (a warning says so)."""
        from mooncake.store import ReplicateConfig

        store = self._store()
        raw_put = store.upsert if upsert else store.put
        data = _page_padded(data)
        config = ReplicateConfig()
        config.preferred_segment = store.get_hostname()

        def put(*args: Any) -> int:
            with _SEGMENT_LOCK:
                return int(raw_put(*args))

        rc = put(key, data, config)
        # an upsert can be refused while a reader's lease holds the key (e.g. ``latest`` being polled):
        # retry with a short backoff until ``timeout_s`` before calling it a failure
        deadline, pause = time.monotonic() + self.timeout_s, 0.005
        while rc != 0 and upsert and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
            rc = put(key, data, config)
        if rc != 0 and (rc := put(key, data)) == 0:
            logger.warning(
                "weight channel %r: %s did not fit this process's segment and sits in another "
                "process's (lost if that process ends); raise weights.segment_mb",
                self.name,
                key,
            )
        if rc != 0:
            raise MooncakeStoreError(
                f"Mooncake {'upsert' if upsert else 'put'} of {key!r} failed with code {rc} "
                "(a full store? raise weights.segment_mb)"
            )

    # ------------------------------------------------------------------ publisher
    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> int:
        """Write ``state`` as ``version``; returns the bytes written."""
        publisher = _Publisher.of(self.master, self.name)
        with publisher.lock:
            return self._publish_packed(*publisher.pack(state), version)

    def _publish_packed(self, flat: torch.Tensor, layout: list[dict[str, Any]], version: int) -> int:
        view = flat.numpy()
        chunks = (memoryview(view[i : i + self.chunk_bytes]) for i in range(0, max(len(view), 1), self.chunk_bytes))
        return self._publish_chunks(layout, len(view), chunks, version)

    def _publish_chunks(
        self, layout: list[dict[str, Any]], nbytes: int, chunks: Iterator[memoryview], version: int
    ) -> int:
        """Write a version's chunks (each ``chunk_bytes`` but the last, as they come), then its manifest
        with the CRC-32 of the layout and the bytes (computed on the way), then ``latest``."""
        base = f"{self.prefix}/v{version}"
        # a version left by a predecessor (a trainer restarted from a checkpoint) is overwritten: its
        # manifest first goes, so no reader pairs it with the new chunks (the checksum would refuse that)
        store = self._store()
        again = store.is_exist(f"{base}/manifest") == 1
        if again:
            store.remove(f"{base}/manifest")  # refused while a reader holds a lease; the upsert below still lands
        crc = zlib.crc32(json.dumps(layout, sort_keys=True).encode())
        n_chunks = 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
            self._put(f"{base}/chunk{n_chunks}", chunk, upsert=again)
            n_chunks += 1
        manifest = {
            "version": version,
            "checksum": f"crc32:{crc:08x}",
            "chunks": n_chunks,
            "chunk_bytes": self.chunk_bytes,
            "nbytes": nbytes,
            "tensors": layout,
        }
        self._put(f"{base}/manifest", json.dumps(manifest).encode(), upsert=again)
        self._put(f"{self.prefix}/latest", str(version).encode(), upsert=True)
        self._drop_old_versions(version, n_chunks)
        logger.debug("published %s v%d: %d bytes in %d chunks", self.name, version, nbytes, n_chunks)
        return nbytes

    def order(self, metas: Sequence[TensorMeta]) -> list[str]:
        """The order :meth:`publish_stream` takes the tensors in: by name (the packed layout's)."""
        return sorted(m.name for m in metas)

    def publish_stream(self, metas: Sequence[TensorMeta], tensors: Iterator[tuple[str, Part]], version: int) -> int:
        """Write the tensors of ``metas``, given one at a time in :meth:`order` (whole, or a tensor larger than
        a bucket in row pieces, each written at its offset of the packed layout), as ``version``: each is
        packed into a reused chunk-sized buffer and every full chunk is written at once, so the publisher
        holds one chunk, never the snapshot (a sharded trainer's path). Same keys, layout and checksum as
        :meth:`publish` (the CRC-32 runs over the chunks as they go). Waits for a background publish of this
        channel first."""
        publisher = _Publisher.of(self.master, self.name)
        with publisher.lock:
            if publisher.pending is not None:
                wait([publisher.pending])
                publisher.pending = None
            layout = snapshot_layout(metas)
            staging = publisher.staging(self.chunk_bytes)
            chunks = packed_chunks(layout, tensors, self.chunk_bytes, staging)
            return self._publish_chunks(layout, packed_nbytes(layout), chunks, version)

    def publish_async(self, state: Mapping[str, torch.Tensor], version: int, *, copy: bool = True) -> Future:
        """Pack ``state`` now into this process's reused buffer for the channel (that is the copy: the
        caller may change its tensors, e.g. train on, once this returns) and write it in the background.
        The next call waits for this write first. ``copy`` is accepted for the channel protocol; the
        packing copies either way."""
        publisher = _Publisher.of(self.master, self.name)
        with publisher.lock:
            publisher.pending = publisher.executor.submit(self._publish_packed, *publisher.pack(state), version)
            return publisher.pending

    def _drop_old_versions(self, version: int, n_chunks: int) -> None:
        """Remove versions beyond the newest ``keep``; a key still leased to a reader is retried later.

        The list of published and still-to-remove versions lives in the store (``<prefix>/index``),
        not in this object: a channel reaches its publisher as a fresh copy in every remote call, and
        a restarted trainer finds what its predecessor left behind.

        A version a reader holds stays past its removal, and meanwhile newer versions take new places in
        this process's segment: so on a TCP segment the places of a held version's keys are noted when its
        removal is first refused, and each key's pages are given back as soon as that key is removed (else
        the resident memory would climb, publish after publish, towards the whole segment)."""
        store = self._store()
        publisher = _Publisher.of(self.master, self.name)
        raw = store.get(f"{self.prefix}/index")
        index = json.loads(raw) if raw else {"published": [], "doomed": []}
        # publish order, not version order: a trainer restarted from an older checkpoint publishes
        # lower numbers than the versions its predecessor left, and those are the ones to drop
        published = [p for p in index["published"] if p[0] != version] + [[version, n_chunks]]
        waiting = [d for d in index["doomed"] if d[0] != version]
        still: list[list[int]] = []
        # oldest first, up to the first one still leased: readers read versions in order, so their leases
        # run out in that order, and the newer ones would be refused too (each refusal is a master call)
        for v, chunks in waiting:
            if still or not self._remove_version(store, v, chunks, publisher):
                still.append([v, chunks])
        # the versions dropped now are tried at once: one nobody read goes straight away
        for v, chunks in published[: -self.keep]:
            if not self._remove_version(store, v, chunks, publisher):
                still.append([v, chunks])
                if self.protocol == "tcp":
                    publisher.held.update(_own_ranges(store, self._version_keys(v, chunks), publisher.own_endpoints))
        published = published[-self.keep :]
        self._put(f"{self.prefix}/index", json.dumps({"published": published, "doomed": still}).encode(), upsert=True)

    def _version_keys(self, version: int, chunks: int) -> list[str]:
        base = f"{self.prefix}/v{version}"
        return [f"{base}/manifest"] + [f"{base}/chunk{i}" for i in range(chunks)]

    def _remove_version(self, store: Any, version: int, chunks: int, publisher: _Publisher | None = None) -> bool:
        """Remove a version's manifest, then its chunks; False while a reader's lease still holds one. The
        pages of a key whose place was noted (``publisher.held``) go back the moment it is removed: before
        anything else of this process is put (the master may reuse the place for the next put)."""
        keys = self._version_keys(version, chunks)
        if publisher is None or not publisher.held:
            return _remove_keys(store, keys)
        gone = True
        for key in keys:
            with _SEGMENT_LOCK:
                code = store.remove(key)
                where = publisher.held.pop(key, None) if code in (0, OBJECT_NOT_FOUND) else None
                if code == 0 and where is not None:
                    segment_pages.release([where])
            gone = gone and code in (0, OBJECT_NOT_FOUND)
        return gone

    def warm(self) -> None:
        """Join the store now (mount this process's segment), not on the first weight update."""
        self._store()

    # ------------------------------------------------------------------ readers
    def latest(self) -> int | None:
        raw = self._store().get(f"{self.prefix}/latest")
        return int(raw) if raw else None

    def _base(self, version: int, holder: str | None = None) -> str:
        """Where ``version``'s keys live: the publisher's, or a relay copy held by ``holder``."""
        base = f"{self.prefix}/v{version}"
        return base if holder is None else f"{base}/copy/{holder}"

    def _manifest(
        self,
        store: Any,
        version: int,
        holder: str | None = None,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> dict[str, Any]:
        """``version``'s manifest (of ``holder``'s copy, if given), waiting up to ``timeout_s`` (default:
        the channel's) for its writer (in another process), or until ``stop`` is set."""
        base = self._base(version, holder)
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        delay = 0.002
        while not (raw := store.get(f"{base}/manifest")):
            if stop is not None and stop.is_set():
                raise FetchStopped(f"weight channel {self.name!r}: the wait for version {version} was stopped")
            if time.monotonic() > deadline:
                where = f"a copy on {holder}" if holder else "published"
                raise TimeoutError(
                    f"weight channel {self.name!r}: version {version} was not {where} within "
                    f"{wait_s} s (latest: {self.latest()})"
                )
            time.sleep(delay)  # polling for a publisher in another process; bounded by timeout_s
            delay = min(delay * 2, 0.02)  # a short cap: the wait is on the path of every weight update
        manifest = json.loads(raw)
        if manifest["version"] != version:
            raise MooncakeStoreError(
                f"weight channel {self.name!r}: manifest of v{version} says v{manifest['version']}"
            )
        return manifest

    def _get_chunks_into(self, store: Any, manifest: dict[str, Any], flat: torch.Tensor, base: str) -> None:
        """Every chunk of a version (under ``base``) straight into ``flat`` (one batched transfer, no
        intermediate ``bytes``); a chunk whose transfer failed is read again with backoff."""
        version, n = manifest["version"], manifest["nbytes"]
        ptr = flat.data_ptr()
        keys = [f"{base}/chunk{i}" for i in range(manifest["chunks"])]
        # the writer's chunk size (a reader's chunk_mb may differ); older manifests: ask the store
        step = manifest.get("chunk_bytes")
        sizes = [min(step, n - i * step) for i in range(len(keys))] if step else [int(store.get_size(k)) for k in keys]
        offsets = [sum(sizes[:i]) for i in range(len(keys))]
        if sum(sizes) != n or any(s <= 0 for s in sizes):
            raise MooncakeStoreError(
                f"weight channel {self.name!r}: v{version} chunks hold {sum(sizes)} bytes, its manifest says {n}"
            )
        if store.register_buffer(ptr, n) != 0:
            raise MooncakeStoreError(f"weight channel {self.name!r}: could not register a {n}-byte buffer")
        try:
            codes = store.batch_get_into(keys, [ptr + off for off in offsets], sizes)
            for i, (key, code) in enumerate(zip(keys, codes)):
                delay = 0.02
                for _ in range(6):
                    if code == sizes[i]:
                        break
                    if store.is_exist(key) != 1:
                        break
                    logger.warning("weight channel %r: v%d chunk %d transfer failed; retrying", self.name, version, i)
                    time.sleep(delay)  # backoff before a retry of a failed transfer
                    delay *= 2
                    code = store.get_into(key, ptr + offsets[i], sizes[i])
                if code != sizes[i]:
                    raise MooncakeStoreError(
                        f"weight channel {self.name!r}: v{version} chunk {i} is missing "
                        "(evicted, or its holder died); fetch a newer version"
                    )
        finally:
            store.unregister_buffer(ptr)

    def fetch_into(
        self,
        version: int,
        alloc: Callable[[int], torch.Tensor],
        *,
        holder: str | None = None,
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """``version`` packed: ``alloc(nbytes)`` gives a flat writable ``uint8`` tensor (e.g. over shared
        memory), the store's bytes land in it directly and are checksum verified; returns it and its
        layout (:func:`~rollart.weights.snapshot.tensor_views` makes the tensors). ``holder``: read the
        relay copy that host holds (:meth:`put_copy`) instead of the publisher's, waiting ``timeout_s``."""
        flat, manifest = self.fetch_manifest_into(version, alloc, holder=holder, timeout_s=timeout_s)
        return flat, manifest["tensors"]

    def fetch_manifest_into(
        self,
        version: int,
        alloc: Callable[[int], torch.Tensor],
        *,
        holder: str | None = None,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """:meth:`fetch_into`, returning the whole manifest (checksum, chunking) with the bytes; setting
        ``stop`` (from another thread) ends the wait for the manifest with :class:`FetchStopped`."""
        store = self._store()
        manifest = self._manifest(store, version, holder, timeout_s, stop)
        flat = alloc(manifest["nbytes"])
        if manifest["nbytes"]:
            self._get_chunks_into(store, manifest, flat, self._base(version, holder))
        verify_flat(flat, manifest["tensors"], manifest["checksum"], version)
        return flat, manifest

    # ------------------------------------------------------------------ relay copies (host caches)
    def put_copy(self, flat: torch.Tensor, manifest: dict[str, Any], holder: str) -> None:
        """A relay copy of a fetched version in this process's own segment, under ``holder`` (its host):
        chunks first, its manifest (the publisher's, same checksum) last, so another host can read it
        from here instead of from the publisher. Remove it with :meth:`drop_copy`."""
        base = self._base(manifest["version"], holder)
        view, step = flat.numpy(), manifest.get("chunk_bytes") or self.chunk_bytes
        for i in range(manifest["chunks"]):
            self._put(f"{base}/chunk{i}", memoryview(view[i * step : (i + 1) * step]), upsert=True)
        self._put(f"{base}/manifest", json.dumps(manifest).encode(), upsert=True)

    def drop_copy(self, version: int, chunks: int, holder: str) -> bool:
        """Remove ``holder``'s relay copy of ``version``; False while a reader's lease still holds a key."""
        base = self._base(version, holder)
        return _remove_keys(self._store(), [f"{base}/manifest"] + [f"{base}/chunk{i}" for i in range(chunks)])

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        flat, layout = self.fetch_into(version, lambda n: torch.empty(n, dtype=torch.uint8))
        return unpack_state(flat, layout)
