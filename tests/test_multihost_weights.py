"""Weight channels across hosts: a multi-task asynchronous pipeline on a three-host namespace cluster
(``rollart.testing.hosts``) with each weight channel (``ray``, ``dist``, ``mooncake``).

Hosts: ``head`` (the driver; H800), ``b`` (H800), ``c`` (H20 x2). Pools: train on one H800, rollout on
one H800 and two H20. Two tasks: ``reverse-3`` mapped to H800, ``reverse-2`` to H20. Asserted per
channel: every worker sits on a host of its hardware (by node IP) and the three hosts all serve;
trajectories of each tag were generated on its hardware only; after every sync every inference worker
serves the new version; staleness stays within alpha. Mooncake: the master listens on the head's IP
and each inference host fetched each version once (host C's two workers share one fetch).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(1500)

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "scripts" / "multihost_weights_driver.py"
STEPS = 3


@pytest.fixture(scope="module")
def hosts():
    from rollart.testing import HostSpec, skip_reason, start_hosts

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    specs = [
        HostSpec("head", {"H800": 1}, num_cpus=2),
        HostSpec("b", {"H800": 1}, num_cpus=2),
        HostSpec("c", {"H20": 2}, num_cpus=2),
    ]
    with start_hosts(specs, start_timeout_s=300) as cluster:  # a loaded 2-core machine starts Ray slowly
        yield cluster


@pytest.mark.parametrize("channel", ["ray", "dist", "mooncake"])
def test_async_multitask_pipeline_syncs_weights_across_hosts(hosts, channel, tmp_path):
    if channel == "mooncake":
        pytest.importorskip("mooncake.store")
    res = hosts.run_driver(
        [str(DRIVER), "--channel", channel, "--steps", str(STEPS), "--out", str(tmp_path / "run")],
        cwd=REPO,
        timeout=900,
    ).check()
    r = res.result
    print(r)  # shown when an assertion fails
    head, b, c = (hosts.host(n).ip for n in ("head", "b", "c"))
    assert r["driver_ip"] == head

    # placement: every worker on a host that has its hardware; the pools use all three hosts
    has = {"H800": {head, b}, "H20": {c}}
    for w in r["train"] + r["infer"]:
        assert w["ip"] in has[w["hardware"]], w
    [trainer] = r["train"]
    infer_ips = {w["ip"] for w in r["infer"]}
    assert sorted(w["hardware"] for w in r["infer"]) == ["H20", "H20", "H800"]
    assert trainer["ip"] not in infer_ips and infer_ips | {trainer["ip"]} == {head, b, c}

    # routing by tag: reverse-3 only on H800, reverse-2 only on H20
    assert len(r["hardware_by_tag"]) == STEPS
    for per_tag in r["hardware_by_tag"]:
        assert per_tag, "a step trained on nothing"
        for tag, hw in per_tag.items():
            assert set(hw) == ({"H800"} if tag == "reverse-3" else {"H20"}), (tag, hw)
    # tasks: ratio 0.5 each — both tasks in every batch
    assert all(set(per_tag) == {"reverse-3", "reverse-2"} for per_tag in r["hardware_by_tag"]), r["hardware_by_tag"]

    assert r["versions"] == list(range(1, STEPS + 1))
    assert max(r["max_staleness"]) <= 1
    if channel != "mooncake":  # every sync ends with every inference worker serving the new version
        assert [s["version"] for s in r["served"]] == r["versions"]
        for s in r["served"]:
            assert s["workers"] == [s["version"]] * 3, s
        return
    # mooncake: the driver never waited; every version was loaded everywhere or skipped for a newer one,
    # in order, and the run ends with every worker serving the last one
    assert r["mooncake_master"].startswith(f"{head}:")
    loaded, last = r["loaded"], r["versions"][-1]
    assert loaded == sorted(loaded) and loaded[-1] == last and sorted(loaded + r["skipped"]) == r["versions"]
    assert r["served"] == [{"version": last, "workers": [last] * 3}]
    fetched = {cache["node_ip"]: cache["fetches"] for cache in r["host_caches"]}
    assert set(fetched) == infer_ips
    for fetches in fetched.values():  # one fetch per host and version it served
        assert len(set(fetches)) == len(fetches) and set(loaded) <= set(fetches) <= set(r["versions"])
    # relay: the trainer's host sent each version once: one rollout host read every version from the
    # publisher, the other every version from that host's copy
    [root] = [x for x in r["host_caches"] if x["relay_parent"] is None]
    [child] = [x for x in r["host_caches"] if x["relay_parent"] is not None]
    assert set(root["sources"]) == {"publisher"} and root["node_ip"] == r["infer"][0]["ip"]
    assert child["relay_parent"] == root["node_ip"] and set(child["sources"]) == {root["node_ip"]}
    assert root["relay_fallbacks"] == child["relay_fallbacks"] == 0


def test_a_relay_child_reads_its_parents_copy_though_no_reader_of_the_parent_asked(hosts, tmp_path):
    """The relay parent's host has no reader asking (its worker busy, or restarting after a kill): the
    child's cache asks the parent's cache to fetch, so the child still reads every version from the
    parent's copy (before, it waited ``relay_wait_s`` and left the relay for good)."""
    pytest.importorskip("mooncake.store")
    b, c = hosts.host("b").ip, hosts.host("c").ip
    res = hosts.run_driver(
        [str(REPO / "tests" / "scripts" / "relay_prompt_driver.py"), "--parent", b, "--child", c]
        + ["--out", str(tmp_path / "run")],
        cwd=REPO,
        timeout=300,
    ).check()
    r = res.result
    assert r["same"] == [True, True, True], r
    caches = {x["node_ip"]: x for x in r["host_caches"]}
    assert caches[c]["relay_parent"] == b and caches[c]["sources"] == [b] * 3, caches
    assert caches[b]["sources"] == ["publisher"] * 3 and caches[b]["fetches"] == [1, 2, 3], caches
    assert caches[b]["relay_fallbacks"] == caches[c]["relay_fallbacks"] == 0


def test_a_segment_advertised_on_loopback_fails_at_once_naming_the_address_and_the_fix(hosts):
    """A host whose Mooncake client would advertise its segment on 127.0.0.1 (MC_TCP_BIND_ADDRESS left from
    a single-host run) in a three-host cluster: the first publish fails with the address and the fix,
    instead of every transfer from the other hosts failing until weights.timeout_s."""
    pytest.importorskip("mooncake.store")
    res = hosts.run_driver([str(REPO / "tests" / "scripts" / "loopback_segment_driver.py")], cwd=REPO)
    r = res.check().result
    assert r["nodes"] == 3 and r["master"].startswith(hosts.host("head").ip + ":"), r
    assert r["error"] is not None and "advertised on 127.0.0.1 (MC_TCP_BIND_ADDRESS=127.0.0.1)" in r["error"], r
    assert "the Ray cluster has 3 nodes" in r["error"] and "Unset MC_TCP_BIND_ADDRESS" in r["error"]


def test_rdma_needs_device_names_and_names_the_field(tmp_path):
    from rollart.config import ConfigError, load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "pools: {train: {hardware: CPU, cpus: 1}, rollout: {hardware: CPU, cpus: 1}}\n"
        "envs: [{name: reverse, groups: 8}]\n"
        "weights: {channel: mooncake, protocol: rdma}\n"
    )
    with pytest.raises(ConfigError, match=r"weights\.rdma_devices.*mlx5_0"):
        load_config(cfg)
    ok = load_config(cfg, {"weights.rdma_devices": ["mlx5_0", "mlx5_1"]})
    assert ok.weights.protocol == "rdma" and ok.weights.rdma_devices == ["mlx5_0", "mlx5_1"]
    with pytest.raises(ConfigError, match="channel mooncake only"):
        load_config(cfg, {"weights.channel": "dist", "weights.rdma_devices": ["mlx5_0"]})


def test_mooncake_channel_takes_protocol_and_devices():
    from rollart.weights.mooncake_channel import MooncakeChannel

    ch = MooncakeChannel("x", "10.0.0.1:5000", protocol="rdma", rdma_devices=["mlx5_0", "mlx5_1"])
    assert (ch.protocol, ch.rdma_devices) == ("rdma", "mlx5_0,mlx5_1")
    with pytest.raises(ValueError, match="weights.rdma_devices"):
        MooncakeChannel("x", "10.0.0.1:5000", protocol="rdma")
    with pytest.raises(ValueError, match="weights.protocol"):
        MooncakeChannel("x", "10.0.0.1:5000", protocol="udp")


def test_interface_is_the_one_carrying_the_ip():
    from rollart.resource_manager.net import interface_of

    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(ValueError, match="no interface of this host carries 192.0.2.77"):
        interface_of("192.0.2.77")  # TEST-NET-1: never on a host
