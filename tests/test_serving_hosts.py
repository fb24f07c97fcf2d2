"""An agent harness on another host reaches the policy endpoint over the network.

Two namespace hosts (``rollart.testing.hosts``): the driver on ``head`` (10.201.0.1) serves the
endpoint on its IP and plays ``agent`` episodes whose function (the calculator example's
``remote.solve_elsewhere``) starts the agent on host ``b`` (10.201.0.2) with ``ip netns exec``. The
agent's calls come from b's address, are recorded and trained on; its reward comes back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart.testing import HostSpec, skip_reason, start_hosts

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def hosts2():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with start_hosts([HostSpec("head", {"H20": 1}, num_cpus=2), HostSpec("b", {}, num_cpus=1)]) as cluster:
        yield cluster


def test_an_agent_on_another_host_trains_through_the_endpoint_ip(hosts2, tmp_path):
    b = hosts2.host("b")
    res = hosts2.run_driver(
        [str(HERE / "scripts" / "agent_host_driver.py"), str(tmp_path)],
        env={"CALCULATOR_AGENT_PREFIX": f"ip netns exec {b.namespace}"},
        timeout=420,
    ).check()
    result = res.result
    assert result["url"].startswith(f"http://{hosts2.head.ip}:")
    for ep in result["episodes"]:
        assert ep["status"] == "ok", ep
        assert ep["reward"] == 1.0 and ep["calls"] == 1 and ep["actions"] > 0
        assert ep["clients"] == [b.ip]  # the calls came over the network from host b
