"""One fetch per host: a weight channel whose readers share each version inside their host (RollArt paper
§5.2: "inference workers fetch them on demand, then model update within clusters").

:class:`HostSharedChannel` wraps another channel (the Mooncake store across clusters). Publishing goes
straight to the wrapped channel. A reader's ``fetch(v)`` asks the cache actor of its own Ray node
(``rollart-weights-host:<channel>:<node id>``, pinned to that node, created by the first reader
there): the cache fetches ``v`` from the wrapped channel once, whatever the number of readers asking
at the same time, into an anonymous shared-memory file of its own (``memfd``) holding the packed
snapshot (:func:`~rollart.weights.snapshot.pack_state` layout); a Mooncake inner channel writes its
bytes straight into that memory (``fetch_into``). Every reader gets ``(pid, fd, layout)``, maps the
same pages through ``/proc/<pid>/fd/<fd>`` (a reader and its cache share a node, so a pid namespace)
and copies each tensor out once. So the cross-host transfer happens once per host and version, and
there is no serialisation on the host: no object-store put, no unpickling, one copy per reader.

Relay (``relay=[host IPs]``, the pipeline's ``weights.relay``): the hosts form a binary tree, and each
host reads a version from its parent's copy in the store instead of the publisher's, so the trainer's
host sends each version once (not once per host) and no host sends it more than twice. A child asks
its parent's cache to fetch the version (the parent's readers may not have asked: busy, or a worker
restarting), so the copy comes whether or not the parent's host wants that version yet. A host whose
parent host is gone, or whose parent's copy does not come, reads from the publisher from then on. The
job's driver makes the caches of the hosts it starts with (:meth:`HostSharedChannel.start_caches`), so
a worker's death does not take its host's cache with it.

Invariants: the bytes in shared memory are the ones the wrapped channel verified (its checksum); a
reader maps a version only after checking that the file it opened is that version's (its memfd name),
and the newest ``keep`` versions stay cached (an older one is closed: its memory goes once no reader
maps it, and a reader that asks for it gets :class:`SupersededVersion`). A cache lives as long as the
process that created it (its owner keeps the handle); its memory goes with it, and a new one is
created on demand after that.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollart.resource_manager.net import node_ip
from rollart.weights.base import WeightChannel
from rollart.weights.snapshot import pack_state, unpack_state
from rollart.weights.stream import Part, TensorMeta, channel_order, publish_stream

logger = logging.getLogger(__name__)

_PREFIX = "rollart-weights-host"
# handles this process holds: a named actor that is not detached ends when its creator drops the handle
_HANDLES: dict[str, Any] = {}
_HANDLES_LOCK = threading.Lock()


class SupersededVersion(RuntimeError):
    """A host cache no longer holds this version (``keep`` newer ones arrived): load a newer one."""


# the channels this process was told are replaced (a trainer restart): never read, never given a new cache
_RETIRED: set[str] = set()


def _replaced(channel_name: str, version: int) -> SupersededVersion:
    return SupersededVersion(
        f"weight channel {channel_name!r} was replaced (a trainer restart): version {version} is not served; "
        "load from the new channel"
    )


def retire_channel(name: str) -> None:
    """This process reads nothing more of channel ``name``: a fetch of it raises :class:`SupersededVersion`,
    and a reader whose host cache ended does not make a new one for it (the job's driver tells every
    reader before it retires the channel's caches, :meth:`HostSharedChannel.close_caches`)."""
    _RETIRED.add(name)


class _Shared:
    """One version in an anonymous shared-memory file of this process."""

    def __init__(self, name: str, nbytes: int):
        self.name = name
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.nbytes = nbytes
        self.map: mmap.mmap | None = None
        if nbytes:
            os.ftruncate(self.fd, nbytes)
            self.map = mmap.mmap(self.fd, nbytes)

    def flat(self) -> torch.Tensor:
        if self.map is None:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        try:
            if self.map is not None:
                self.map.close()
        except BufferError:  # a tensor of this process still views it: the mapping goes with that tensor
            logger.debug("host cache %s: mapping still viewed; left to the garbage collector", self.name)
        os.close(self.fd)


@ray.remote(num_cpus=0)
class _HostCache:
    """On one node: each version fetched once from ``channel`` into shared memory, newest ``keep`` kept.

    With a relay ``order`` (the hosts' IPs) the caches form a binary tree: the first host reads from the
    publisher, every other host from its parent's relay copy (``put_copy``), and a host with children
    keeps a copy of its own in its segment. So the publisher serves each version once, however many
    hosts read it, and no host serves more than two. Before waiting on its parent's copy a host asks
    the parent's cache to fetch that version (:meth:`prefetch`). A parent host no longer alive, or a
    copy that does not come within ``relay_wait_s``, is skipped from then on: this host reads from the
    publisher."""

    def __init__(
        self,
        channel: WeightChannel,
        keep: int,
        channel_name: str,
        relay: list[str] | None = None,
        relay_wait_s: float = 10.0,
    ):
        self.channel = channel
        self.keep = keep
        self.channel_name = channel_name
        self.shared: dict[int, tuple[_Shared, list[dict[str, Any]]]] = {}
        self.loading: dict[int, asyncio.Future] = {}
        self.fetches: deque[int] = deque(maxlen=1000)  # the versions fetched, the last 1000 (bounded memory)
        self.sources: deque[str] = deque(maxlen=1000)  # where each of them came from: "publisher" or a host IP
        self.newest = -1
        self.ip = node_ip()
        # the relay tree is a binary heap over ``relay``: host k reads from host (k-1)//2, host 0 from the
        # publisher, and a host keeps a copy when a host 2k+1 exists
        order = list(relay or []) if hasattr(channel, "put_copy") else []
        k = order.index(self.ip) if self.ip in order else None
        self.parent: str | None = order[(k - 1) // 2] if k else None
        self.relays = k is not None and 2 * k + 1 < len(order)
        self.relay_wait_s = relay_wait_s
        self.parent_node: str | None = None  # the Ray node id of ``parent``, looked up when first needed
        self.copies: dict[int, int] = {}  # version -> chunks of this host's relay copies still in the store
        self.relay_fallbacks = 0  # times the parent's copy did not come (then the publisher is read)
        # set by :meth:`retire` (the channel was replaced): no version is served any more
        self.retired = threading.Event()
        self.end_at = float("inf")  # retired: when this tombstone may end

    async def get(self, version: int) -> dict[str, Any]:

        self._refuse_if_retired(version)
        if version not in self.shared:
            if version <= self.newest - self.keep:  # readers asking for it are behind: load a newer one
                raise SupersededVersion(
                    f"weight channel {self.channel_name!r}: version {version} is no longer cached on "
                    f"{node_ip()} (newest {self.newest}, keep {self.keep})"
                )
            if version in self.loading:  # another reader of this host asked first: share its fetch
                await asyncio.shield(self.loading[version])
            else:
                await self._load(version)
        self._refuse_if_retired(version)
        if version not in self.shared:
            raise SupersededVersion(f"weight channel {self.channel_name!r}: version {version} was superseded")
        shm, layout = self.shared[version]
        return {"pid": os.getpid(), "fd": shm.fd, "name": shm.name, "nbytes": shm.nbytes, "layout": layout}

    async def prefetch(self, version: int) -> None:
        """Fetch ``version`` now, for a relay child waiting on this host's copy (its readers may not have
        asked yet: busy, or restarting); a version already superseded here is left to the publisher."""
        try:
            await self.get(version)
        except SupersededVersion:
            pass
        except Exception as err:  # the child times out and reads from the publisher; say why here
            logger.warning("host cache %s: prefetch of version %d for a relay child failed: %s", self.ip, version, err)

    def _refuse_if_retired(self, version: int) -> None:
        if self.retired.is_set():
            raise _replaced(self.channel_name, version)

    async def retire(self, grace_s: float) -> None:
        """The channel was replaced (a trainer restart publishes under a new name): free every version
        now, refuse every later read (:class:`SupersededVersion`) and stop a fetch still waiting. The
        actor stays ``grace_s`` as the channel's tombstone, then ends once no fetch is in flight: a
        load sent with the old channel before it was replaced (e.g. to a worker still starting) is
        refused here at once; were the cache gone, that reader would make a new one and wait for a
        version that never comes."""
        self.retired.set()
        self.end_at = time.monotonic() + grace_s
        for shm, _ in self.shared.values():
            shm.close()
        self.shared.clear()
        asyncio.get_running_loop().call_later(grace_s, self._end_if_idle)

    def _end_if_idle(self) -> None:
        if self.retired.is_set() and not self.loading and time.monotonic() >= self.end_at:
            ray.get_runtime_context().current_actor.end.remote()

    async def end(self) -> None:
        ray.actor.exit_actor()

    async def _load(self, version: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.loading[version] = fut
        try:
            entry = await asyncio.get_running_loop().run_in_executor(None, self._fetch, version)
            if self.retired.is_set():
                entry[0].close()
                self._refuse_if_retired(version)
        except BaseException as err:
            fut.set_exception(err)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self.loading.pop(version, None)
            self._end_if_idle()
        self.shared[version] = entry
        self.newest = max(self.newest, version)
        for old in sorted(self.shared)[: -self.keep]:
            self.shared.pop(old)[0].close()
        if self.copies:
            await asyncio.get_running_loop().run_in_executor(None, self._drop_copies)
        fut.set_result(None)

    def _drop_copies(self) -> None:
        """Remove this host's relay copies of the versions it no longer caches (a copy a reader still
        holds a lease on is tried again after the next fetch)."""
        # two loads may finish at once and drop in two executor threads: each works on a snapshot, and a copy
        # the other thread dropped meanwhile is not dropped twice
        for version, chunks in [(v, c) for v, c in list(self.copies.items()) if v not in self.shared]:
            if self.channel.drop_copy(version, chunks, self.ip):  # type: ignore[attr-defined]
                self.copies.pop(version, None)

    def _fetch(self, version: int) -> tuple[_Shared, list[dict[str, Any]]]:

        name = f"rollart-w-{self.channel_name}-v{version}"
        made: list[_Shared] = []

        def alloc(nbytes: int) -> torch.Tensor:
            made.append(_Shared(name, nbytes))
            return made[-1].flat()

        def drop_made() -> None:
            for shm in made:
                shm.close()
            made.clear()

        source = "publisher"
        try:
            manifest = None
            if self.parent is not None and not self._prompt_parent(version):
                logger.warning(
                    "host cache %s: relay parent %s is no live Ray node (its host is gone); reading from the publisher",
                    self.ip,
                    self.parent,
                )
                self.parent = None
                self.relay_fallbacks += 1
            if self.parent is not None:  # the relay tree: from the parent's copy
                try:
                    _, manifest = self.channel.fetch_manifest_into(  # type: ignore[attr-defined]
                        version, alloc, holder=self.parent, timeout_s=self.relay_wait_s, stop=self.retired
                    )
                    source = self.parent
                except Exception as err:  # any failure of the copy: the publisher has it too
                    if self.retired.is_set():  # stopped: the channel was replaced, nothing to read
                        raise
                    logger.warning(
                        "host cache %s: no relay copy of version %d from %s (%s); reading from the publisher "
                        "from now on",
                        self.ip,
                        version,
                        self.parent,
                        err,
                    )
                    self.parent = None
                    self.relay_fallbacks += 1
                    drop_made()
                    manifest = None
            if manifest is None and hasattr(self.channel, "fetch_manifest_into"):
                _, manifest = self.channel.fetch_manifest_into(version, alloc, stop=self.retired)
            if manifest is not None:
                layout = manifest["tensors"]
                if self.relays:
                    self._put_copy(made[-1].flat(), manifest)
            else:  # a channel without packed reads
                flat, layout = pack_state(self.channel.fetch(version))
                alloc(flat.numel()).copy_(flat)
        except BaseException:
            drop_made()
            raise
        self.fetches.append(version)
        self.sources.append(source)
        logger.debug("host cache %s: fetched version %d from %s", self.ip, version, source)
        return made[-1], layout

    def _prompt_parent(self, version: int) -> bool:
        """Ask the parent host's cache to fetch ``version`` (and so write its relay copy) without waiting
        for its own readers (they may be busy, or restarting); False when the parent host is gone. A
        parent host whose readers have not made its cache yet is not prompted (its first reader makes it)."""
        for fresh in (False, True):  # the parent's node as last seen, then as Ray lists it now (it may have restarted)
            if fresh or self.parent_node is None:
                self.parent_node = next(
                    (n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == self.parent), None
                )
                if self.parent_node is None:
                    return False
            try:
                ray.get_actor(_cache_name(self.channel_name, self.parent_node)).prefetch.remote(version)
                return True
            except ValueError:  # no cache there (yet, or its node is gone)
                continue
        logger.debug("host cache %s: relay parent %s has no cache yet; not prompted", self.ip, self.parent)
        return True

    def _put_copy(self, flat: torch.Tensor, manifest: dict[str, Any]) -> None:
        """This host's relay copy for its children; a failure costs them a read from the publisher only."""
        try:
            self.channel.put_copy(flat, manifest, self.ip)  # type: ignore[attr-defined]
            self.copies[manifest["version"]] = manifest["chunks"]
        except Exception as err:
            logger.warning(
                "host cache %s: relay copy of version %d not written (%s)", self.ip, manifest["version"], err
            )

    def warm(self) -> None:
        warm = getattr(self.channel, "warm", None)
        if warm is not None:
            warm()

    def stats(self) -> dict[str, Any]:
        return {
            "node_ip": self.ip,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "fetches": list(self.fetches),
            "sources": list(self.sources),
            "relay_parent": self.parent,
            "relay_fallbacks": self.relay_fallbacks,
            "cached": sorted(self.shared),
            "loading": sorted(self.loading),
            "retired": self.retired.is_set(),
        }


def _map_shared(handle: dict[str, Any], version: int) -> dict[str, torch.Tensor]:
    """The snapshot a host cache holds in shared memory, copied out once (each tensor owns its storage)."""
    if not handle["nbytes"]:
        return unpack_state(torch.empty(0, dtype=torch.uint8), handle["layout"])
    try:
        fd = os.open(f"/proc/{handle['pid']}/fd/{handle['fd']}", os.O_RDONLY)
    except OSError as err:  # the cache closed it meanwhile (a newer version), or the cache is gone
        raise SupersededVersion(
            f"weights version {version}: its shared copy is gone ({err}); load a newer one"
        ) from err
    try:
        # the fd number may have been reused by the time we opened it: the memfd's name says which version it is
        if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{handle['name']} (deleted)":
            raise SupersededVersion(f"weights version {version}: its shared copy was replaced; load a newer one")
        mapped = mmap.mmap(fd, handle["nbytes"], access=mmap.ACCESS_COPY)  # private: never written back
        flat = torch.frombuffer(mapped, dtype=torch.uint8)
        out = unpack_state(flat, handle["layout"])
        del flat
        try:
            mapped.close()
        except BufferError:  # still viewed somewhere: unmapped when that view goes
            pass
        return out
    finally:
        os.close(fd)


def _cache_name(channel_name: str, node_id: str) -> str:
    return f"{_PREFIX}:{channel_name}:{node_id}"


class HostSharedChannel:
    """Serializable handle: ``inner`` (e.g. a :class:`~rollart.weights.mooncake_channel.MooncakeChannel`)
    read once per host and version; every reader of a host gets that host's copy."""

    def __init__(self, inner: WeightChannel, keep: int = 2, relay: list[str] | None = None, relay_wait_s: float = 10.0):
        """``relay``: the reading hosts' IPs in tree order (see :class:`_HostCache`); None: every host
        reads from the publisher."""
        self.inner = inner
        self.name = inner.name
        self.keep = keep
        self.relay = list(relay) if relay else None
        self.relay_wait_s = relay_wait_s

    def __repr__(self) -> str:
        return f"HostSharedChannel({self.inner!r})"

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> Any:
        return self.inner.publish(state, version)

    def publish_async(self, state: Mapping[str, torch.Tensor], version: int, *, copy: bool = True) -> Future:
        return self.inner.publish_async(state, version, copy=copy)

    def order(self, metas: Sequence[TensorMeta]) -> list[str]:
        return channel_order(self.inner, metas)

    def publish_stream(self, metas: Sequence[TensorMeta], tensors: Iterator[tuple[str, Part]], version: int) -> Any:
        return publish_stream(self.inner, metas, tensors, version)

    @property
    def packs_on_publish(self) -> bool:
        return self.inner.packs_on_publish

    def latest(self) -> int | None:
        return self.inner.latest()

    def _cache(self, node_id: str | None = None) -> Any:
        """The cache actor of ``node_id`` (default: this process's node), made there if it does not exist;
        this process holds its handle (a cache this process made lives as long as this process)."""
        node_id = node_id or ray.get_runtime_context().get_node_id()
        name = _cache_name(self.name, node_id)
        with _HANDLES_LOCK:
            if name not in _HANDLES:
                _HANDLES[name] = _HostCache.options(
                    name=name,
                    get_if_exists=True,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(self.inner, self.keep, self.name, self.relay, self.relay_wait_s)
            return _HANDLES[name]

    def start_caches(self, node_ids: list[str]) -> None:
        """Make the caches of these nodes from this process (the job's driver), so each outlives the
        readers of its host: a reader's death does not take its host's cache (and its copies) with it.
        A node not started here (a host that joined or came back later) gets its cache from its first
        reader."""
        ray.get([self._cache(n).stats.remote() for n in dict.fromkeys(node_ids)])

    def end_cache(self, node_id: str) -> None:
        """End the cache of ``node_id`` this process made (its host leaves the job: nothing of the job may
        keep a drained node busy); a reader there later makes a new one."""
        with _HANDLES_LOCK:
            cache = _HANDLES.pop(_cache_name(self.name, node_id), None)
        if cache is not None:
            ray.kill(cache, no_restart=True)

    def _refuse_if_retired(self, version: int) -> None:
        if self.name in _RETIRED:
            raise _replaced(self.name, version)

    def close_caches(self, grace_s: float | None = None) -> None:
        """This channel is replaced: retire its cache on every node (see :meth:`_HostCache.retire`: their
        shared memory goes now; the actors, with their relay copies, after ``grace_s``, by default the
        inner channel's ``timeout_s``, the longest a load sent before now can take to arrive)."""
        if grace_s is None:
            grace_s = float(getattr(self.inner, "timeout_s", 120.0))
        retiring = []
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            name = _cache_name(self.name, node["NodeID"])
            # a handle this process made stays held: dropping it would end the tombstone at once
            with _HANDLES_LOCK:
                cache = _HANDLES.get(name)
            try:
                retiring.append((cache or ray.get_actor(name)).retire.remote(grace_s))
            except ValueError:  # no reader of that node read this channel
                continue
        for ref in retiring:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:  # it ended meanwhile (its host, or its owner, died)
                continue

    def warm(self) -> None:
        """Start this host's cache and let it join the inner channel (its store) before any version."""
        ray.get(self._cache().warm.remote())

    def fetch(self, version: int) -> dict[str, torch.Tensor]:

        self._refuse_if_retired(version)
        try:
            handle = ray.get(self._cache().get.remote(version))
        except ray.exceptions.RayActorError:  # its creator is gone: this host gets a new cache
            self._refuse_if_retired(version)  # or it was retired: then no new one
            with _HANDLES_LOCK:
                _HANDLES.pop(_cache_name(self.name, ray.get_runtime_context().get_node_id()), None)
            handle = ray.get(self._cache().get.remote(version))
        out = _map_shared(handle, version)
        return out


def host_cache_stats(channel_name: str) -> list[dict[str, Any]]:
    """``{node_ip, node_id, pid, fetches, sources, relay_parent, relay_fallbacks, cached, loading, retired}``
    of every host cache of a channel (one per host that read it; a cache ending meanwhile is left out)."""
    out = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        try:
            cache = ray.get_actor(_cache_name(channel_name, node["NodeID"]))
            out.append(ray.get(cache.stats.remote()))
        except ValueError:  # no reader on that node
            continue
        except ray.exceptions.RayActorError:  # it is ending (a retired tombstone, its host going)
            continue
    return out
