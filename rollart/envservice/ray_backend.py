"""Backend ``ray``: env servers as Ray actors on the config's CPU env pool (RollArt paper §3.1).

Each server is one :class:`EnvServerActor` in one one-CPU bundle of the pool's placement group(s):
the actor runs the env server (:func:`~rollart.envservice.server.build_env_app`, uvicorn in a thread)
on a free port and reports its URL. It listens on 127.0.0.1 when it shares the node of the driver
(the only client of its sessions), else on its node's IP (``ray.util.get_node_ip_address()``, the
address the driver's host reaches it on). Every pool makes a random bearer token of its own and gives
it to its servers (an actor argument, never an environment variable): a server answers only its pool. A task's servers form a :class:`RayServerPool` (sessions spread by least
sessions). An actor that dies is restarted by Ray in its bundle (``max_restarts``); the pool marks its
old URL down and takes the new one when the restarted actor answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollart.cluster.serverless import RetryPolicy
from rollart.envservice.client import DEFAULT_RETRY, ServerPool, endpoint_url

log = logging.getLogger(__name__)


class EnvServerActor:
    """One env server process (a Ray actor): serves ``envs`` ({served name: registry name or
    MODULE:CLASS}) to the holders of ``token``, on 127.0.0.1 when this is ``client_ip``'s node, else on
    this node's IP."""

    def __init__(
        self,
        envs: dict[str, str],
        plugin_paths: list[str],
        settings: dict[str, Any],
        token: str | None = None,
        client_ip: str | None = None,
    ):
        from rollart.plugins import add_search_path

        add_search_path(plugin_paths)  # after the installed packages: a user's file never shadows one
        from rollart.envservice.server import EnvServerSettings, ThreadedServer, build_env_app

        self.ip = str(ray.util.get_node_ip_address())
        self.restarts = int(ray.get_runtime_context().was_current_actor_reconstructed)
        config = EnvServerSettings.model_validate(settings)
        app = build_env_app(envs, config, token=token)
        host = "127.0.0.1" if client_ip == self.ip else self.ip
        self.server = ThreadedServer(app, host=host, limits=config.connection_limits()).start()
        logging.getLogger(__name__).info("env server %s serves %s", self.server.url, sorted(envs))

    def info(self) -> dict[str, Any]:
        return {"url": self.server.url, "node_ip": self.ip, "pid": os.getpid(), "restarts": self.restarts}

    def stop(self) -> None:
        self.server.stop()


class RayServerPool(ServerPool):
    """``servers`` env server actors for one task, each in one of ``bundles`` (placement group, index)."""

    def __init__(
        self,
        name: str,
        envs: dict[str, str],
        bundles: list[tuple[PlacementGroup, int]],
        *,
        plugin_paths: list[str] | None = None,
        settings: dict[str, Any] | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        max_restarts: int = 3,
        start_timeout_s: float = 120.0,
    ):
        super().__init__(name, retry=retry, token=secrets.token_urlsafe(32))
        self.envs, self.bundles = envs, bundles
        self.plugin_paths = list(plugin_paths or [])
        self.settings = dict(settings or {})
        self.max_restarts, self.start_timeout_s = max_restarts, start_timeout_s
        self.actors: list[Any] = []
        self.url_of: dict[int, str] = {}  # actor index -> its current URL
        self.servers: list[dict[str, Any]] = []  # info() of every server, as started
        self._refreshing: set[int] = set()

    def start(self) -> None:
        cls = ray.remote(EnvServerActor)
        env_vars = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        for pg, index in self.bundles:
            actor = cls.options(
                name=None,
                num_cpus=1,
                max_restarts=self.max_restarts,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
                runtime_env={"env_vars": env_vars},
            ).remote(self.envs, self.plugin_paths, self.settings, self.token, str(ray.util.get_node_ip_address()))
            self.actors.append(actor)
        try:
            infos = ray.get([a.info.remote() for a in self.actors], timeout=self.start_timeout_s)
        except Exception:
            self.stop()
            raise
        for i, info in enumerate(infos):
            self.url_of[i] = endpoint_url(info["url"])
            self.add(info["url"])
        self.servers = infos
        log.info("task %s: env servers %s", self.name, [i["url"] for i in infos])

    def mark_down(self, url: str) -> None:
        super().mark_down(url)
        for i, u in self.url_of.items():
            if u == url and i not in self._refreshing:
                try:
                    asyncio.get_running_loop().create_task(self._refresh(i, url))
                except RuntimeError:  # no event loop: the next caller finds it down
                    pass

    async def _refresh(self, i: int, old: str) -> None:
        """Wait for actor ``i`` (restarted by Ray) to answer, then serve its new URL instead of ``old``."""
        self._refreshing.add(i)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        try:
            for attempt in range(1_000_000):
                try:
                    info = await asyncio.wait_for(self.actors[i].info.remote(), max(0.1, deadline - loop.time()))
                    break
                except ray.exceptions.ActorUnavailableError:  # restarting: ask again
                    if loop.time() >= deadline:
                        raise
                    await asyncio.sleep(self.retry.delay(min(attempt, 6)))
        except Exception as err:  # died for good (restarts used up) or did not come back in time
            log.warning("task %s: env server %s did not come back: %s: %s", self.name, old, type(err).__name__, err)
            return
        finally:
            self._refreshing.discard(i)
        new = endpoint_url(info["url"])
        if new != old:
            self.remove(old)
        self.url_of[i] = new
        self.servers[i] = info
        self.add(new)
        log.info("task %s: env server %s is back as %s", self.name, old, new)

    async def restore(self) -> None:
        """Bring back every server marked down whose actor Ray has restarted, waiting for each (up to the
        start timeout); a run that ends before a restart finishes leaves the pool as the next one needs it."""
        for i, url in list(self.url_of.items()):
            if url in self.down and i not in self._refreshing:
                await self._refresh(i, url)

    def stop(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as err:  # already gone
                log.debug("killing env server actor: %s", err)
        self.actors.clear()
