"""RayServerPool.restore: a server killed after the run's last call (no event loop left to refresh it)
comes back at its restarted actor's new URL and leaves the down list."""

import asyncio
import os
import signal

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rollart.envservice.ray_backend import RayServerPool

pytestmark = pytest.mark.timeout(300)


def test_restore_brings_back_a_server_killed_outside_the_run(ray_local):
    pg = placement_group([{"CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    pool = RayServerPool("reverse", {"reverse": "reverse"}, [(pg, 0)], start_timeout_s=120)
    try:
        pool.start()
        (old,) = pool.urls
        pid = pool.servers[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        pool.mark_down(old)  # no running event loop: nothing refreshes it yet
        assert pool.down == {old} and pool.urls == [old]
        asyncio.run(pool.restore())
        (new,) = pool.urls
        assert new != old and pool.down == set()
        assert pool.servers[0]["pid"] != pid  # a new process, restarted by Ray in the same bundle
    finally:
        pool.stop()
        remove_placement_group(pg)


def test_a_pools_servers_listen_on_loopback_and_answer_its_token_only(ray_local):
    import httpx

    pg = placement_group([{"CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    pool = RayServerPool("reverse", {"reverse": "reverse"}, [(pg, 0)], start_timeout_s=120)
    try:
        pool.start()
        (url,) = pool.urls
        assert url.startswith("http://127.0.0.1:")  # the driver is on this node: not on the node's address
        assert httpx.post(url + "/describe", json={"env": "reverse"}).status_code == 401
        other = httpx.post(url + "/describe", json={"env": "reverse"}, headers={"Authorization": "Bearer " + "x" * 43})
        assert other.status_code == 401
        assert asyncio.run(pool.describe("reverse")).tag  # the pool's own client holds the token
    finally:
        pool.stop()
        remove_placement_group(pg)
