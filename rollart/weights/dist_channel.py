"""Weight channel over a torch.distributed broadcast (RollArt paper §5.2 "weight sync over collective
communication": NCCL between GPUs, gloo on CPU).

The trainer (the publisher, rank 0) and ``num_receivers`` inference-worker processes (ranks
``1..num_receivers``) share one standalone process group that never touches the default
``torch.distributed`` group (trainers use that one for DDP). A named Ray coordinator actor,
``rollart-weights-dist:<name>``, assigns ranks in the order processes first use the channel and
carries one manifest per broadcast. The group's store is served by rank 0 (the trainer) on its own
Ray node IP, on a port the store itself picks there; the manifest carries that address, so receivers
on other hosts find it. Every process builds its gloo device on the interface that carries its node
IP (``NCCL_SOCKET_IFNAME`` likewise, unless set), never a fixed loopback. ``publish(state, v)`` posts the manifest of version ``v`` then broadcasts the tensors from
rank 0; each receiver's ``fetch(v)`` waits (at most ``timeout_s``) for that manifest, joins the same
broadcast and rebuilds ``{name: tensor}`` on CPU. Every receiver takes part in every broadcast, in
order: a broadcast is a collective, so ``publish`` returns only once all receivers have joined it.

Bucket layout: tensors are taken in name order and grouped by dtype; each dtype's tensors are laid
back to back (flattened, contiguous) into buckets of at most ``bucket_bytes``, and a tensor larger
than a bucket is split over buckets of its own, one row range (along its first dimension, at most
``bucket_bytes``, at least one row) each. A bucket goes over the wire as one flat ``uint8`` tensor; the
manifest lists, per bucket, its dtype, byte size and ``(name, element offset, shape)`` per tensor (a
piece's bucket also its first row and the whole tensor's shape), so a receiver views the received bytes
back into tensors, or receives a piece straight into its rows of the tensor, without further messages::

    manifest = {version, seq, backend, store: [ip, port],
                buckets: [{dtype, nbytes, entries: [(name, offset, shape)], piece?: [first row, full shape]}]}

The manifest needs only names, shapes and dtypes, so a publisher can post it before it has any bytes and
send each bucket as soon as its tensors are gathered (:meth:`TorchBroadcastChannel.publish_stream`, what
a sharded trainer uses: its extra memory is one bucket). After the buckets comes a 16-byte BLAKE2b
digest of all their bytes. Invariant: a receiver returns a snapshot only if the digest of the bytes it
received equals the publisher's; otherwise it raises :class:`ChecksumMismatch` (after the whole
broadcast, so the group stays in step) and the engine keeps its old weights.

The handle is serializable (pickled into Ray actors); the process group, its store and the rank live
in a per-process registry keyed by the channel name, created on first use and released by
:meth:`TorchBroadcastChannel.close`. A failed collective (e.g. a receiver that never came) leaves the
group unusable in that process: the channel then raises at once and a new channel is needed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import ray
import torch
import torch.distributed as dist

from rollart.resource_manager.net import interface_of, node_ip
from rollart.weights.snapshot import ChecksumMismatch
from rollart.weights.stream import Part, PartReader, TensorMeta, metas_of, row_pieces

logger = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
_PUBLISHER = "publisher"
_RECEIVER = "receiver"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight manifest")
    return dtype


def plan_buckets(state: Mapping[str, torch.Tensor] | Sequence[TensorMeta], bucket_bytes: int) -> list[dict[str, Any]]:
    """Bucket layout of ``state`` (a state dict, or the :class:`TensorMeta` of its tensors): per dtype
    (first seen in name order), tensors in name order packed into buckets of at most ``bucket_bytes``; a
    larger tensor is split into row pieces of at most ``bucket_bytes``, a bucket each. Each bucket is
    ``{"dtype": str, "nbytes": int, "entries": [(name, element offset, shape)]}``; a piece's bucket has one
    entry, the piece's shape, and ``"piece": [first row, the whole tensor's shape]``."""
    metas = metas_of(state) if isinstance(state, Mapping) else list(state)
    by_dtype: dict[torch.dtype, list[TensorMeta]] = {}
    for meta in sorted(metas, key=lambda m: m.name):
        by_dtype.setdefault(meta.dtype, []).append(meta)
    buckets: list[dict[str, Any]] = []
    for dtype, group in by_dtype.items():
        size = dtype.itemsize
        open_bucket: dict[str, Any] | None = None
        for meta in group:
            nbytes = meta.nbytes
            entry_shape = list(meta.shape)
            if nbytes > bucket_bytes:
                pieces = row_pieces(meta.shape, size, bucket_bytes)
                row_bytes = nbytes // max(meta.shape[0], 1) if meta.shape else nbytes
                for a, b in pieces:
                    buckets.append(
                        {
                            "dtype": str(dtype),
                            "nbytes": (b - a) * row_bytes,
                            "entries": [(meta.name, 0, [b - a, *entry_shape[1:]] if entry_shape else entry_shape)],
                            **({"piece": [a, entry_shape]} if len(pieces) > 1 else {}),
                        }
                    )
                continue
            if open_bucket is None or open_bucket["nbytes"] + nbytes > bucket_bytes:
                open_bucket = {"dtype": str(dtype), "nbytes": 0, "entries": []}
                buckets.append(open_bucket)
            open_bucket["entries"].append((meta.name, open_bucket["nbytes"] // size, entry_shape))
            open_bucket["nbytes"] += nbytes
    return buckets


def _wire_digest() -> Any:
    """The running digest of a broadcast: BLAKE2b (16 bytes) over every bucket's bytes in order."""
    import hashlib

    return hashlib.blake2b(digest_size=16)


@ray.remote(num_cpus=0)
class _Coordinator:
    """Rendezvous of one channel: ranks, and the manifest of each broadcast (by sequence)."""

    def __init__(self, num_receivers: int):
        self.num_receivers = num_receivers
        self.publisher: str | None = None
        self.receivers: dict[str, int] = {}
        self.manifests: dict[int, dict[str, Any]] = {}
        self.versions: dict[int, int] = {}  # seq -> version, every broadcast announced so far
        self.done: dict[int, set[int]] = {}
        self.posted = asyncio.Condition()

    def join(self, process_key: str, role: str) -> int:
        """The rank of this process: publisher 0, receivers 1.. in order of first call."""
        if role == _PUBLISHER:
            if self.publisher not in (None, process_key):
                raise RuntimeError(f"another process ({self.publisher}) already publishes on this channel")
            self.publisher = process_key
            return 0
        if process_key not in self.receivers:
            if len(self.receivers) >= self.num_receivers:
                raise RuntimeError(f"channel has {self.num_receivers} receivers already; {process_key} is one too many")
            self.receivers[process_key] = len(self.receivers) + 1
        return self.receivers[process_key]

    async def post(self, manifest: dict[str, Any]) -> None:
        seq = manifest["seq"]
        async with self.posted:
            self.manifests[seq] = manifest
            self.versions[seq] = manifest["version"]
            self.posted.notify_all()

    async def wait_manifest(self, seq: int, timeout_s: float) -> dict[str, Any] | None:
        """The manifest of broadcast ``seq``, or None if it is not posted within ``timeout_s``."""
        async with self.posted:
            try:
                await asyncio.wait_for(self.posted.wait_for(lambda: seq in self.manifests), timeout_s)
            except TimeoutError:
                return None
            return self.manifests[seq]

    def received(self, seq: int, rank: int) -> None:
        """A receiver finished broadcast ``seq``; drop its manifest once every receiver has."""
        got = self.done.setdefault(seq, set())
        got.add(rank)
        if len(got) >= self.num_receivers:
            self.manifests.pop(seq, None)
            del self.done[seq]

    def seq_of(self, version: int) -> list[int]:
        return [s for s, v in self.versions.items() if v == version]

    def latest(self) -> int | None:
        return max(self.versions.values()) if self.versions else None


@dataclass
class _Endpoint:
    """This process's side of one channel: rank, store, process group, broadcast counter."""

    rank: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: int = 0
    store: Any = None
    store_addr: tuple[str, int] = ("", 0)
    group: Any = None
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    broken: str | None = None
    executor: ThreadPoolExecutor | None = None

    def release(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            except Exception as err:
                logger.debug("process group shutdown failed: %s", err)
        self.group = None
        self.store = None
        if self.executor is not None:
            self.executor.shutdown(wait=False)
            self.executor = None


_ENDPOINTS: dict[tuple[str, str], _Endpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()


def _process_key() -> str:
    try:
        actor = ray.get_runtime_context().get_actor_id()
    except Exception:
        actor = None
    return f"{socket.gethostname()}:{os.getpid()}:{actor or 'driver'}"


class TorchBroadcastChannel:
    """Serializable handle to a broadcast weight channel; pass it to the trainer and the inference
    workers alike. The trainer calls :meth:`publish`, each of the ``num_receivers`` worker processes
    calls :meth:`fetch` for the same versions in the same order."""

    packs_on_publish = False  # publish_async keeps the tensors it is given (the caller hands over a copy)

    def __init__(
        self,
        name: str,
        num_receivers: int,
        bucket_bytes: int = 32 << 20,
        backend: Backend | None = None,
        timeout_s: float = 120.0,
    ):
        if num_receivers < 1:
            raise ValueError("num_receivers must be >= 1")
        if bucket_bytes < 1:
            raise ValueError("bucket_bytes must be >= 1")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, not {backend!r}")
        self.name = name
        self.num_receivers = num_receivers
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.timeout_s = timeout_s
        self._coordinator = _Coordinator.options(name=self._coordinator_name, get_if_exists=True).remote(num_receivers)

    @property
    def _coordinator_name(self) -> str:
        return f"rollart-weights-dist:{self.name}"

    @property
    def world_size(self) -> int:
        return 1 + self.num_receivers

    def __getstate__(self) -> dict[str, Any]:
        # the handle holds only configuration and the coordinator's actor handle; process-group
        # state lives in this module's per-process registry and is never pickled
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"TorchBroadcastChannel({self.name!r}, num_receivers={self.num_receivers})"

    # ------------------------------------------------------------------ per-process state
    def _endpoint(self, role: str) -> _Endpoint:
        with _ENDPOINTS_LOCK:
            ep = _ENDPOINTS.get((self.name, role))
            if ep is None:
                rank = ray.get(self._coordinator.join.remote(_process_key(), role))
                ep = _ENDPOINTS[(self.name, role)] = _Endpoint(rank=rank)
                logger.debug("%r: this process is rank %d of %d", self, rank, self.world_size)
            return ep

    def _connect(self, ep: _Endpoint, backend: str, store_addr: tuple[str, int]) -> None:
        """Build this process's side of the group (collective: returns once every rank has joined)."""
        timeout = timedelta(seconds=self.timeout_s)
        if ep.store is None:
            ep.store = dist.TCPStore(
                store_addr[0],
                int(store_addr[1]),
                self.world_size,
                is_master=ep.rank == 0,
                timeout=timeout,
                wait_for_workers=False,
            )
        iface = interface_of(node_ip())
        store = dist.PrefixStore(f"rollart-weights-dist/{self.name}", ep.store)
        if backend == "nccl":
            if not (dist.is_nccl_available() and torch.cuda.is_available()):
                raise RuntimeError(f"{self!r}: the publisher broadcasts over NCCL but this process has no CUDA/NCCL")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            ep.group = dist.ProcessGroupNCCL(store, ep.rank, self.world_size, opts)
            ep.device = torch.device("cuda", torch.cuda.current_device())
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface)]
            ep.group = dist.ProcessGroupGloo(store, ep.rank, self.world_size, opts)
            ep.device = torch.device("cpu")
        ep.backend = backend
        logger.info(
            "%r: rank %d joined the %s group of %d on %s (store %s:%s)",
            self,
            ep.rank,
            backend,
            self.world_size,
            iface,
            *store_addr,
        )

    def _broadcast(self, ep: _Endpoint, buf: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        ep.group.broadcast([buf], opts).wait()

    def _check(self, ep: _Endpoint) -> None:
        if ep.broken:
            raise RuntimeError(
                f"{self!r} is unusable in this process after an earlier failure ({ep.broken}); create a new channel"
            )

    def _fail(self, ep: _Endpoint, what: str, err: BaseException) -> RuntimeError:
        ep.broken = f"{what}: {err}"
        ep.release()
        return RuntimeError(f"{self!r} rank {ep.rank}: {what} failed: {err}")

    def _seal(self, digest: bytes) -> bytes:
        """The digest sent after a version's buckets (what receivers compare theirs with)."""
        return digest

    # ------------------------------------------------------------------ publisher
    def order(self, metas: Sequence[TensorMeta]) -> list[str]:
        """The order :meth:`publish_stream` takes the tensors in: its buckets' (by dtype, then name)."""
        names = (name for bucket in plan_buckets(metas, self.bucket_bytes) for name, _, _ in bucket["entries"])
        return list(dict.fromkeys(names))

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Broadcast ``state`` as ``version`` to every receiver (see :meth:`publish_stream`)."""
        metas = metas_of(state)
        self.publish_stream(metas, ((name, state[name]) for name in self.order(metas)), version)

    def publish_stream(self, metas: Sequence[TensorMeta], tensors: Iterator[tuple[str, Part]], version: int) -> None:
        """Broadcast the tensors of ``metas``, given one at a time in :meth:`order` (whole, or in row pieces
        with any boundaries), as ``version``: each bucket is packed and sent as soon as its rows are in, then
        a 16-byte digest of every bucket's bytes; returns once everything is sent. Blocks until all
        receivers have joined this broadcast (each calls ``fetch(version)``)."""
        ep = self._endpoint(_PUBLISHER)
        with ep.lock:
            self._check(ep)
            backend = ep.backend or self.backend or self._auto_backend()
            buckets = plan_buckets(metas, self.bucket_bytes)
            if ep.store is None:  # serve the store on this node, on a port it picks, before receivers look
                ep.store = dist.TCPStore(
                    node_ip(),
                    0,
                    self.world_size,
                    is_master=True,
                    timeout=timedelta(seconds=self.timeout_s),
                    wait_for_workers=False,
                )
                ep.store_addr = (node_ip(), int(ep.store.port))
            manifest = {
                "version": version,
                "seq": ep.seq,
                "backend": backend,
                "buckets": buckets,
                "store": list(ep.store_addr),
            }
            ray.get(self._coordinator.post.remote(manifest))
            ep.seq += 1
            try:
                if ep.group is None:
                    self._connect(ep, backend, ep.store_addr)
                sent = 0
                digest = _wire_digest()
                reader = PartReader(tensors)
                for bucket in buckets:
                    if "piece" in bucket:
                        (name, _, shape), first = bucket["entries"][0], bucket["piece"][0]
                        part = {name: reader.rows(name, first, first + shape[0])}
                    else:
                        part = {name: reader.whole(name, shape) for name, _, shape in bucket["entries"]}
                    if bucket["nbytes"]:
                        buf = self._pack(part, bucket, ep.device)
                        del part  # a piece's wire buffer is a view of it: one bucket held, not two
                        digest.update(buf.cpu().numpy().tobytes() if buf.is_cuda else memoryview(buf.numpy()))
                        self._broadcast(ep, buf)
                        sent += bucket["nbytes"]
                        del buf
                    else:
                        del part
                seal = torch.frombuffer(bytearray(self._seal(digest.digest())), dtype=torch.uint8).to(ep.device)
                self._broadcast(ep, seal)
                if ep.backend == "nccl":
                    torch.cuda.current_stream(ep.device).synchronize()
            except Exception as err:
                raise self._fail(ep, f"broadcast of version {version}", err) from err
        logger.debug("%r: published version %d, %d bytes in %d buckets", self, version, sent, len(buckets))

    def publish_async(self, state: Mapping[str, torch.Tensor], version: int, *, copy: bool = True) -> Future:
        """Snapshot ``state`` now (``copy=False`` when the caller hands over tensors it will not touch
        again) and broadcast it from a background thread; the future holds the outcome."""
        snapshot = {k: v.detach().clone() for k, v in state.items()} if copy else dict(state)
        ep = self._endpoint(_PUBLISHER)
        with _ENDPOINTS_LOCK:
            if ep.executor is None:
                ep.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dist-weights-{self.name}")
            executor = ep.executor
        return executor.submit(self.publish, snapshot, version)

    def _auto_backend(self) -> str:
        """NCCL where this process has a GPU (the receivers then need one too), else gloo."""
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"

    @staticmethod
    def _pack(state: Mapping[str, torch.Tensor], bucket: dict[str, Any], device: torch.device) -> torch.Tensor:
        parts = [state[name].detach().to(device).reshape(-1) for name, _, _ in bucket["entries"]]
        flat = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        return flat.view(torch.uint8)

    # ------------------------------------------------------------------ receivers
    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """Receive ``version``'s broadcast as a CPU ``{name: tensor}`` dict, checksum verified.

        Raises TimeoutError if no broadcast of ``version`` is announced within ``timeout_s``,
        ValueError if the next broadcast carries another version (its data is received and dropped so
        the group stays in step), ChecksumMismatch if the received bytes do not match the manifest."""
        ep = self._endpoint(_RECEIVER)
        with ep.lock:
            self._check(ep)
            seq = ep.seq
            if any(s < seq for s in ray.get(self._coordinator.seq_of.remote(version))):
                raise ValueError(
                    f"{self!r}: version {version} was broadcast before this receiver's next "
                    f"broadcast (#{seq}); a broadcast cannot be replayed"
                )
            manifest = ray.get(self._coordinator.wait_manifest.remote(seq, self.timeout_s), timeout=self.timeout_s + 30)
            if manifest is None:
                raise TimeoutError(
                    f"weight channel {self.name!r}: no broadcast of version {version} within {self.timeout_s:g}s"
                )
            ep.seq += 1
            try:
                if ep.group is None:
                    self._connect(ep, manifest["backend"], tuple(manifest["store"]))
                state, intact = self._receive(ep, manifest)
            except Exception as err:
                raise self._fail(ep, f"receiving version {manifest['version']}", err) from err
            self._coordinator.received.remote(seq, ep.rank)
        if manifest["version"] != version:
            raise ValueError(
                f"weight channel {self.name!r}: asked for version {version} but the next "
                f"broadcast carried version {manifest['version']}; snapshot dropped"
            )
        if not intact:  # the whole broadcast was received first, so the group stays in step
            raise ChecksumMismatch(
                f"weights version {version}: the bytes received do not hash to the digest the publisher sent; "
                "not loaded"
            )
        logger.debug("%r: rank %d received version %d", self, ep.rank, version)
        return state

    def _receive(self, ep: _Endpoint, manifest: dict[str, Any]) -> tuple[dict[str, torch.Tensor], bool]:
        """Every bucket of a broadcast, then its digest: the tensors, and whether the bytes received
        hash to the digest the publisher sent. A piece is received into its rows of the whole tensor
        (allocated at its first piece), straight there on the CPU."""
        state: dict[str, torch.Tensor] = {}
        digest = _wire_digest()
        for bucket in manifest["buckets"]:
            dtype = _dtype(bucket["dtype"])
            if "piece" in bucket:
                (name, _, shape), (first, full) = bucket["entries"][0], bucket["piece"]
                if first == 0:
                    state[name] = torch.empty(full, dtype=dtype)
                rows = state[name][first : first + shape[0]]
                wire = rows.view(-1).view(torch.uint8)
                if ep.device.type == "cpu":
                    self._broadcast(ep, wire)
                else:
                    buf = torch.empty(bucket["nbytes"], dtype=torch.uint8, device=ep.device)
                    self._broadcast(ep, buf)
                    wire.copy_(buf)
                    del buf
                digest.update(memoryview(wire.numpy()))
                continue
            if not bucket["nbytes"]:
                for name, _, shape in bucket["entries"]:
                    state[name] = torch.empty(shape, dtype=dtype)
                continue
            buf = torch.empty(bucket["nbytes"], dtype=torch.uint8, device=ep.device)
            self._broadcast(ep, buf)
            host = buf.to("cpu")
            digest.update(memoryview(host.numpy()))
            flat = host.view(dtype)
            for name, offset, shape in bucket["entries"]:
                numel = 1
                for d in shape:
                    numel *= d
                state[name] = flat[offset : offset + numel].view(shape).clone()
        seal = torch.empty(16, dtype=torch.uint8, device=ep.device)
        self._broadcast(ep, seal)
        return state, bytes(seal.cpu().numpy()) == digest.digest()

    # ------------------------------------------------------------------ both
    def latest(self) -> int | None:
        """The newest version announced on this channel (its manifest posted), or None."""
        return ray.get(self._coordinator.latest.remote())

    def close(self) -> None:
        """Release this process's process group and store for this channel (both roles)."""
        with _ENDPOINTS_LOCK:
            eps = [_ENDPOINTS.pop(key) for key in list(_ENDPOINTS) if key[0] == self.name]
        for ep in eps:
            with ep.lock:
                ep.release()

    def destroy(self) -> None:
        """End the channel for everyone (its owner, at the end of a job): this process's part (:meth:`close`)
        and the coordinator, whose receivers are counted, so a later channel of the same name starts with
        none (the coordinator is found by name: without this a second job of the same name in one Ray
        would find the first one's receivers and be refused)."""
        self.close()
        try:
            ray.kill(self._coordinator, no_restart=True)
        except Exception as err:  # already gone (its owner ended)
            logger.debug("%r: the coordinator was already gone: %s", self, err)
            return
        deadline = time.monotonic() + 10.0  # the name is free once the GCS has the actor dead
        while time.monotonic() < deadline:
            try:
                ray.get_actor(self._coordinator_name)
            except ValueError:
                return
            time.sleep(0.05)
