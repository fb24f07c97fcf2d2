"""Automatic hardware affinity (rollart.rollout.affinity): the order it derives from task shapes and the
hardware rooflines, and when it keeps the @hw_mapping order."""

import pytest

from rollart.engines.hardware import profile_for
from rollart.rollout.affinity import AutoAffinity, request_time_s
from rollart.rollout.config import RoutingConfig

BOTH = ("H800", "H20")


def feed(auto: AutoAffinity, tag: str, prompt: int, answer: int, n: int) -> None:
    for _ in range(n):
        auto.observe(tag, prompt, answer)


def test_prefill_heavy_prefers_h800_and_decode_heavy_prefers_h20():
    h800, h20 = profile_for("H800"), profile_for("H20")
    # the premise: a 4096/32 request is cheaper on H800, a 64/1024 one on H20 (datasheet rooflines)
    assert request_time_s(h800, 4096, 32, 32) < request_time_s(h20, 4096, 32, 32)
    assert request_time_s(h20, 64, 1024, 32) < request_time_s(h800, 64, 1024, 32)
    auto = AutoAffinity(lambda tag: BOTH, RoutingConfig(min_requests=4))
    feed(auto, "Prefill", 4096, 32, 4)
    assert auto.preference("Prefill") is None  # one profiled task: nothing to compare it with
    feed(auto, "Decode", 64, 1024, 3)
    assert auto.preference("Decode") is None  # three requests: below min_requests
    feed(auto, "Decode", 64, 1024, 1)
    assert auto.preference("Decode") == ("H20", "H800")
    assert auto.preference("Prefill") is None  # its order is the static one
    assert auto.mapping() == {"Decode": ["H20", "H800"]}


def test_the_order_is_relative_both_prefill_heavy_tasks_are_split():
    """Two tasks that both run faster on H800: the less prefill-heavy one still goes to H20 first."""
    auto = AutoAffinity(lambda tag: BOTH, RoutingConfig(min_requests=2))
    feed(auto, "long-prompt", 8192, 16, 2)
    feed(auto, "mid-prompt", 1024, 64, 2)
    assert auto.preference("long-prompt") is None
    assert auto.preference("mid-prompt") == ("H20", "H800")


def test_the_static_order_bounds_the_automatic_one():
    static = {"Decode": ("H800",), "Prefill": ("H20", "H800")}
    auto = AutoAffinity(lambda tag: static[tag], RoutingConfig(min_requests=1))
    feed(auto, "Decode", 64, 1024, 1)
    feed(auto, "Prefill", 4096, 32, 1)
    assert auto.preference("Decode") is None  # only H800 allowed: never H20
    assert auto.preference("Prefill") == ("H800", "H20")  # reordered, not extended


@pytest.mark.parametrize("hw", ["CPU", "A100"])
def test_hardware_without_a_profile_keeps_the_static_order(hw):
    auto = AutoAffinity(lambda tag: (hw, "H20"), RoutingConfig(min_requests=1))
    feed(auto, "a", 4096, 32, 1)
    feed(auto, "b", 64, 1024, 1)
    assert auto.mapping() == {}


def test_state_dict_round_trip_restores_the_orders():
    auto = AutoAffinity(lambda tag: BOTH, RoutingConfig(min_requests=2))
    feed(auto, "Prefill", 4096, 32, 2)
    feed(auto, "Decode", 64, 1024, 2)
    again = AutoAffinity(lambda tag: BOTH, RoutingConfig(min_requests=2))
    again.load_state_dict(auto.state_dict())
    assert again.mapping() == auto.mapping() == {"Decode": ["H20", "H800"]}


def test_routing_config_is_checked():
    from rollart.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match="routing.min_requests"):
        validate_config({"pools": {"train": {"hardware": "CPU", "cpus": 1}}, "routing": {"min_requests": 0}})
    with pytest.raises(ConfigError, match="routing.autoo"):
        validate_config({"pools": {"train": {"hardware": "CPU", "cpus": 1}}, "routing": {"autoo": True}})
