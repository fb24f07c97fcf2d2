"""One fetch per host: a weight channel whose readers share each version inside their host (seed 004
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
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollart.cluster.net import node_ip
from rollart.weights.base import WeightChannel
from rollart.weights.snapshot import pack_state, unpack_state

logger = logging.getLogger(__name__)

_PREFIX = "rollart-weights-host"
# handles this process holds: a named actor that is not detached ends when its creator drops the handle
_HANDLES: dict[str, Any] = {}
_HANDLES_LOCK = threading.Lock()


class SupersededVersion(RuntimeError):
    """A host cache no longer holds this version (``keep`` newer ones arrived): load a newer one."""


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
    """On one node: each version fetched once from ``channel`` into shared memory, newest ``keep`` kept."""

    def __init__(self, channel: WeightChannel, keep: int, channel_name: str):
        self.channel = channel
        self.keep = keep
        self.channel_name = channel_name
        self.shared: dict[int, tuple[_Shared, list[dict[str, Any]]]] = {}
        self.loading: dict[int, asyncio.Future] = {}
        self.fetches: deque[int] = deque(maxlen=1000)  # the versions fetched, the last 1000 (bounded memory)
        self.newest = -1

    async def get(self, version: int) -> dict[str, Any]:

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
        if version not in self.shared:
            raise SupersededVersion(f"weight channel {self.channel_name!r}: version {version} was superseded")
        shm, layout = self.shared[version]
        return {"pid": os.getpid(), "fd": shm.fd, "name": shm.name, "nbytes": shm.nbytes, "layout": layout}

    async def _load(self, version: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.loading[version] = fut
        try:
            entry = await asyncio.get_running_loop().run_in_executor(None, self._fetch, version)
        except BaseException as err:
            fut.set_exception(err)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self.loading.pop(version, None)
        self.shared[version] = entry
        self.newest = max(self.newest, version)
        for old in sorted(self.shared)[: -self.keep]:
            self.shared.pop(old)[0].close()
        fut.set_result(None)

    def _fetch(self, version: int) -> tuple[_Shared, list[dict[str, Any]]]:

        name = f"rollart-w-{self.channel_name}-v{version}"
        made: list[_Shared] = []

        def alloc(nbytes: int) -> torch.Tensor:
            made.append(_Shared(name, nbytes))
            return made[-1].flat()

        try:
            fetch_into = getattr(self.channel, "fetch_into", None)
            if fetch_into is not None:  # the inner channel writes its bytes straight into shared memory
                _, layout = fetch_into(version, alloc)
            else:
                flat, layout = pack_state(self.channel.fetch(version))
                alloc(flat.numel()).copy_(flat)
        except BaseException:
            for shm in made:
                shm.close()
            raise
        self.fetches.append(version)
        logger.debug("host cache %s: fetched version %d", node_ip(), version)
        return made[-1], layout

    def warm(self) -> None:
        warm = getattr(self.channel, "warm", None)
        if warm is not None:
            warm()

    def stats(self) -> dict[str, Any]:
        return {
            "node_ip": node_ip(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "fetches": list(self.fetches),
            "cached": sorted(self.shared),
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

    def __init__(self, inner: WeightChannel, keep: int = 2):
        self.inner = inner
        self.name = inner.name
        self.keep = keep

    def __repr__(self) -> str:
        return f"HostSharedChannel({self.inner!r})"

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> Any:
        return self.inner.publish(state, version)

    def publish_async(self, state: Mapping[str, torch.Tensor], version: int, *, copy: bool = True) -> Future:
        return self.inner.publish_async(state, version, copy=copy)

    @property
    def packs_on_publish(self) -> bool:
        return bool(getattr(self.inner, "packs_on_publish", False))

    def latest(self) -> int | None:
        return self.inner.latest()

    def _cache(self) -> Any:
        node_id = ray.get_runtime_context().get_node_id()
        name = _cache_name(self.name, node_id)
        with _HANDLES_LOCK:
            if name not in _HANDLES:
                _HANDLES[name] = _HostCache.options(
                    name=name,
                    get_if_exists=True,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(self.inner, self.keep, self.name)
            return _HANDLES[name]

    def warm(self) -> None:
        """Start this host's cache and let it join the inner channel (its store) before any version."""
        ray.get(self._cache().warm.remote())

    def fetch(self, version: int) -> dict[str, torch.Tensor]:

        try:
            handle = ray.get(self._cache().get.remote(version))
        except ray.exceptions.RayActorError:  # its creator is gone: this host gets a new cache
            with _HANDLES_LOCK:
                _HANDLES.pop(_cache_name(self.name, ray.get_runtime_context().get_node_id()), None)
            handle = ray.get(self._cache().get.remote(version))
        out = _map_shared(handle, version)
        return out


def host_cache_stats(channel_name: str) -> list[dict[str, Any]]:
    """``{node_ip, node_id, fetches, cached}`` of every host cache of a channel (one per host that read it)."""
    out = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        try:
            cache = ray.get_actor(_cache_name(channel_name, node["NodeID"]))
        except ValueError:  # no reader on that node
            continue
        out.append(ray.get(cache.stats.remote()))
    return out
