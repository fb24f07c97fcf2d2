"""One fetch per host: a weight channel whose readers share each version inside their host (seed 004
§5.2: "inference workers fetch them on demand, then model update within clusters").

:class:`HostSharedChannel` wraps another channel (the Mooncake store across clusters). Publishing goes
straight to the wrapped channel. A reader's ``fetch(v)`` asks the cache actor of its own Ray node
(``rollart-weights-host:<channel>:<node id>``, pinned to that node, created by the first reader
there): the cache fetches ``v`` from the wrapped channel once, whatever the number of readers asking
at the same time, puts the snapshot into that node's object store and hands every reader the same
reference; readers then read the node-local copy. So the cross-host transfer happens once per host
and version, and the rest is a local memory copy.

Invariants: the snapshot in the node's object store is the one the wrapped channel verified (its
checksum), and the newest ``keep`` versions stay cached. A cache lives as long as the process that
created it (its owner keeps the handle); a new one is created on demand after that.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollart.cluster.net import node_ip
from rollart.weights.base import WeightChannel
from rollart.weights.snapshot import owning_storage

logger = logging.getLogger(__name__)

_PREFIX = "rollart-weights-host"
# handles this process holds: a named actor that is not detached ends when its creator drops the handle
_HANDLES: dict[str, Any] = {}
_HANDLES_LOCK = threading.Lock()


@ray.remote(num_cpus=0)
class _HostCache:
    """On one node: each version fetched once from ``channel``, kept in this node's object store."""

    def __init__(self, channel: WeightChannel, keep: int):
        self.channel = channel
        self.keep = keep
        self.refs: dict[int, list] = {}  # version -> [ObjectRef] (boxed: a bare ref would be resolved)
        self.loading: dict[int, asyncio.Future] = {}
        self.fetches: list[int] = []

    async def get(self, version: int) -> list:
        if version in self.refs:
            return self.refs[version]
        if version in self.loading:  # another reader of this host asked first: share its fetch
            return await asyncio.shield(self.loading[version])
        fut = asyncio.get_running_loop().create_future()
        self.loading[version] = fut
        try:
            boxed = await asyncio.get_running_loop().run_in_executor(None, self._fetch, version)
        except BaseException as err:
            fut.set_exception(err)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self.loading.pop(version, None)
        self.refs[version] = boxed
        for old in sorted(self.refs)[: -self.keep]:
            del self.refs[old]
        fut.set_result(boxed)
        return boxed

    def _fetch(self, version: int) -> list:
        # views into one buffer would each put the whole buffer into the object store
        state = owning_storage(self.channel.fetch(version))
        self.fetches.append(version)
        logger.debug("host cache %s: fetched version %d", node_ip(), version)
        return [ray.put(state)]

    def stats(self) -> dict[str, Any]:
        return {
            "node_ip": node_ip(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "fetches": list(self.fetches),
            "cached": sorted(self.refs),
        }


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
                ).remote(self.inner, self.keep)
            return _HANDLES[name]

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        try:
            boxed = ray.get(self._cache().get.remote(version))
        except ray.exceptions.RayActorError:  # its creator is gone: this host gets a new cache
            with _HANDLES_LOCK:
                _HANDLES.pop(_cache_name(self.name, ray.get_runtime_context().get_node_id()), None)
            boxed = ray.get(self._cache().get.remote(version))
        return ray.get(boxed[0])


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
