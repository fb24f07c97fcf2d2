"""Envs as services across hosts: the multi-task agentic pipeline (reverse-1 and FrozenLake) with its envs
on the ``ray`` backend, the env servers on the hosts of the CPU env pool, one of them killed mid-episode;
reverse's reward rises as the same run's with local envs does.

Hosts (rollart.testing.hosts): head 10.201.0.1 (driver, train H800, no CPU for Ray), b 10.201.0.2
(rollout H20, 3 CPUs), c 10.201.0.3 (3 CPUs). The env pool's 4 CPUs can only be on b and c.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest

SCRIPT = str(Path(__file__).parent / "scripts" / "envservice_driver.py")
ENV_HOSTS = {"10.201.0.2", "10.201.0.3"}

pytestmark = pytest.mark.timeout(600)


def test_ray_backend_envs_run_on_the_env_pool_hosts_and_a_server_killed_mid_episode_loses_nothing(tmp_path):
    from rollart.testing import HostSpec, skip_reason, start_hosts

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    kill = tmp_path / "kill"
    kill.touch()
    specs = [
        HostSpec("head", {"H800": 1}, num_cpus=0),
        HostSpec("b", {"H20": 1}, num_cpus=3),
        HostSpec("c", {}, num_cpus=3),
    ]
    with start_hosts(specs) as cluster:
        out = cluster.run_driver([SCRIPT, str(tmp_path / "run"), "-", str(kill)], timeout=540).check().result
        # the same run with its envs inside the driver (backend local), nothing killed: the reference curve
        local = cluster.run_driver([SCRIPT, str(tmp_path / "local"), "-", "", "local"], timeout=540).check().result
    assert isinstance(out, dict) and isinstance(local, dict)
    servers = out["servers"]
    # every env server sits on a host of the env pool; reverse's two are spread, one per host
    assert {s["node_ip"] for s in servers} <= ENV_HOSTS, servers
    reverse_servers = [s for s in servers if not s["task"].endswith(":frozen_lake")]
    assert sorted(s["node_ip"] for s in reverse_servers) == sorted(ENV_HOSTS), servers
    assert len(servers) == 3
    assert all(urlparse(s["url"]).hostname == s["node_ip"] for s in servers)  # served on the node's IP
    pool = next(p for name, p in out["pools"].items() if len(p["urls"]) == 2)
    servers = reverse_servers
    assert all(urlparse(u).hostname in ENV_HOSTS for u in pool["urls"])  # also the restarted server's URL
    # one server died mid-episode (a step took the kill file): its episodes failed and were played again
    assert (tmp_path / "kill.taken").exists() and not kill.exists()
    # Ray restarted it and the pool took its new URL in place of the dead one (during the run, or in
    # restore() after it when the restart outlasted the run)
    assert pool["down"] == [] and len(pool["urls"]) == 2
    assert len(set(pool["urls"]) - {s["url"].rstrip("/") for s in servers}) == 1, (pool, servers)
    history = out["history"]
    print("envservice across hosts:", history, pool)  # the numbers, in the test log
    assert [h["step"] for h in history] == list(range(1, 11))
    assert sum(h["trajectories_failed"] for h in history) >= 1  # counted, never trained on, never scored
    for h in history:  # the envs' own rewards, both tasks in every batch
        assert set(h["reward_by_tag"]) == {"reverse-1", "FrozenLake"}
        assert 0.0 <= h["reward_by_tag"]["reverse-1"] <= 1.0
    # reverse's reward rises as with local envs: a random policy scores ~0.05-0.1, a well-formed answer 0.5
    remote_curve = [h["reward_by_tag"]["reverse-1"] for h in history]
    local_curve = [h["reward_by_tag"]["reverse-1"] for h in local["history"]]
    print("reward per step, ray backend:", remote_curve, "local:", local_curve)
    for curve in (remote_curve, local_curve):
        first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
        assert last >= first + 0.2 and last >= 0.35, curve
    assert abs(sum(remote_curve[-3:]) - sum(local_curve[-3:])) / 3 <= 0.2, (remote_curve, local_curve)
