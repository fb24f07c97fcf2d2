"""Which backend runs each task's envs (``envs: [{name, backend: local | ray | kubernetes, ...}]``) and
the env objects the EnvManagers drive: the env itself (``local``) or a :class:`RemoteEnv` over a pool
of warm servers (``ray``, ``kubernetes``).

A backend is a :class:`~rollart.envservice.client.ServerPool` subclass. ``ray`` is
:class:`~rollart.envservice.ray_backend.RayServerPool`. ``kubernetes`` is looked up as
``rollart.envservice.kubernetes:create_pool`` (a function ``(task: EnvTask) -> ServerPool`` returning
a started pool); until that module exists the backend is refused with a clear error.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any

from rollart.envservice.client import RemoteEnv, ServerPool
from rollart.envservice.config import KUBERNETES_MODULE, kubernetes_problem
from rollart.envservice.protocol import EnvDescription, EnvOverrides

log = logging.getLogger(__name__)


class EnvBackendUnavailable(ValueError):
    """The config names a backend this installation cannot run."""


@dataclass
class EnvTask:
    """What a backend needs to start the servers of one task (one ``envs:`` entry)."""

    index: int  # position in ``envs:``
    name: str  # the env as the server serves it: registry name or MODULE:CLASS
    entry: Any  # the config's EnvEntry (servers, call_timeout_s, kubernetes, ...)
    job_id: str
    plugin_paths: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"envs[{self.index}]:{self.name}"


class EnvPools:
    """The env of every EnvManager of a pipeline: local envs built here, remote ones as a
    :class:`RemoteEnv` on the task's pool of warm servers (started here: on the ``ray`` backend in the
    CPU env pool's bundles, the ``kubernetes`` backend through its module)."""

    def __init__(self, entries: list[Any], rm: Any, *, plugin_paths: list[str] | None = None):
        self.entries = entries
        self.pools: dict[int, ServerPool] = {}
        self.descriptions: dict[int, EnvDescription] = {}
        self._next_bundle: dict[str, int] = {}
        self._bundles: dict[str, list[tuple[Any, int]]] = {}
        self._tags: dict[int, str | None] = {}  # per task: the tag its entry sets or its env class declares
        try:
            for i, entry in enumerate(entries):
                backend = getattr(entry, "backend", "local")
                if backend == "local":
                    continue
                task = EnvTask(i, entry.name, entry, rm.job_id, list(plugin_paths or []))
                pool = self._ray_pool(task, rm) if backend == "ray" else self._kubernetes_pool(task)
                self.pools[i] = pool
                self.descriptions[i] = describe(pool, entry.name, entry.kwargs, overrides_of(entry))
                self.check_tag(i, self.descriptions[i].tag)
        except BaseException:
            self.stop()
            raise

    def _ray_pool(self, task: EnvTask, rm: Any) -> ServerPool:
        from rollart.envservice.ray_backend import RayServerPool

        entry = task.entry
        if entry.pool not in self._bundles:
            self._bundles[entry.pool] = spread_bundles(rm.pool_groups(entry.pool))
        bundles = self._bundles[entry.pool]
        first = self._next_bundle.get(entry.pool, 0)
        mine = bundles[first : first + entry.servers]
        if len(mine) < entry.servers:
            raise EnvBackendUnavailable(
                f"envs[{task.index}].servers: pool {entry.pool!r} has {len(bundles)} CPUs, "
                f"{first} taken by earlier tasks; raise pools.{entry.pool}.cpus"
            )
        self._next_bundle[entry.pool] = first + entry.servers
        pool = RayServerPool(
            task.label,
            {entry.name: entry.name},
            mine,
            plugin_paths=task.plugin_paths,
            settings={"call_timeout_s": entry.call_timeout_s},
        )
        pool.start()
        return pool

    def _kubernetes_pool(self, task: EnvTask) -> ServerPool:
        problem = kubernetes_problem()
        if problem is not None:
            raise EnvBackendUnavailable(f"envs[{task.index}].{problem}")
        mod = importlib.import_module(KUBERNETES_MODULE)
        pool = mod.create_pool(task)
        if not isinstance(pool, ServerPool):
            raise TypeError(f"{KUBERNETES_MODULE}.create_pool returned {pool!r}, not a ServerPool")
        return pool

    def make(self, index: int, spec: Any) -> Any:
        """The env of one EnvManager of task ``index`` (``spec``: its EnvSpec)."""
        if index not in self.pools:
            from rollart.envs import make_env

            env = make_env(spec)
            self.check_tag(index, str(env.tag))
            return env
        entry = self.entries[index]
        return RemoteEnv(
            self.pools[index],
            entry.name,
            self.descriptions[index],
            kwargs=entry.kwargs,
            overrides=overrides_of(entry),
            timeout_s=entry.call_timeout_s,
        )

    def check_tag(self, index: int, built: str) -> None:
        """The tag of task ``index``'s env as built against the one the config read for it (``envs[i].tag``,
        else what its class declares: :func:`~rollart.envs.registry.declared_tag`); raises ``ValueError``
        when they differ. An env that sets its tag only when built declares none: nothing to compare."""
        entry = self.entries[index]
        if index not in self._tags:
            from rollart.envs import declared_tag, env_class

            try:
                self._tags[index] = entry.tag or declared_tag(env_class(entry.name), entry.kwargs)
            except ValueError as err:
                raise ValueError(f"envs[{index}]: env {entry.name}: {err}; set envs[{index}].tag") from None
        declared = self._tags[index]
        if declared is not None and built != declared:
            said = f"envs[{index}].tag is" if entry.tag else "its class declares (tag, tag_for)"
            raise ValueError(
                f"envs[{index}]: env {entry.name} was built with tag {built!r}, but {said} {declared!r}; make the "
                f"class declare the tag it builds, or set envs[{index}].tag"
            )

    def servers(self) -> list[dict[str, Any]]:
        """Every remote server: task, URL and (ray) node IP and pid."""
        out = []
        for i, pool in self.pools.items():
            infos = getattr(pool, "servers", None) or [{"url": u} for u in pool.urls]
            out += [{"task": pool.name, "index": i, **info} for info in infos]
        return out

    def stop(self) -> None:
        for pool in self.pools.values():
            try:
                pool.stop()
            except Exception as err:
                log.warning("stopping env servers of %s: %s: %s", pool.name, type(err).__name__, err)


def spread_bundles(groups: list[Any]) -> list[tuple[Any, int]]:
    """The one-CPU bundles of a pool's placement groups, ordered so that consecutive bundles sit on
    different nodes where they can (one node after the other, round robin): a task's servers spread
    over the pool's hosts, so one host going down takes only part of them."""
    from ray.util import placement_group_table

    by_node: dict[str, list[tuple[Any, int]]] = {}
    for g in groups:
        nodes = placement_group_table(g.placement_group).get("bundles_to_node_id", {})
        for b in range(g.group.amount):
            by_node.setdefault(str(nodes.get(b, "")), []).append((g.placement_group, b))
    out: list[tuple[Any, int]] = []
    queues = list(by_node.values())
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def overrides_of(entry: Any) -> EnvOverrides:
    return EnvOverrides(tag=entry.tag, max_steps=entry.max_steps, max_new_tokens=entry.max_new_tokens)


def describe(pool: ServerPool, env: str, kwargs: dict[str, Any], overrides: EnvOverrides) -> EnvDescription:
    """The env's tag and sizes, asked of one of the pool's servers (a blocking call, before the event
    loop of the rollout starts)."""
    from rollart.cluster.serverless import call_serverless

    url = pool.acquire_any()
    body = {"env": env, "kwargs": kwargs, "overrides": overrides.model_dump()}
    return EnvDescription.model_validate(
        call_serverless(url + "/describe", body, timeout_s=60.0, retry=pool.retry, token=pool.token)
    )
