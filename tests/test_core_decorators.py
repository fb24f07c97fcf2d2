"""The decorators only attach metadata, and refuse bad declarations with a message that names the fix."""

import pytest

import rollart as ra
from rollart.decorators import HW_MAPPING_ATTR, REGISTER_ATTR, SERVERLESS_ATTR


def test_register_attaches_metadata_and_returns_the_same_function():
    def f(self, x):
        return x + 1

    g = ra.register(dispatch=ra.Dispatch.DP_SPLIT)(f)
    assert g is f
    spec = getattr(f, REGISTER_ATTR)
    assert spec.dispatch is ra.Dispatch.DP_SPLIT and spec.execute is ra.Execute.ALL
    assert f(None, 1) == 2


def test_register_accepts_string_modes_and_custom_pairs():
    f = ra.register(dispatch="all_to_all")(lambda self, x: x)
    assert getattr(f, REGISTER_ATTR).dispatch is ra.Dispatch.ALL_TO_ALL
    pair = (lambda n, a, k: [(a, k)] * n, lambda rs: sum(rs))
    g = ra.register(dispatch=pair)(lambda self: 1)
    spec = getattr(g, REGISTER_ATTR)
    assert spec.dispatch is None and spec.dispatch_fn is pair[0] and spec.collect_fn is pair[1]


def test_register_rejects_unknown_modes():
    with pytest.raises(ValueError, match="unknown mode; use one of ONE_TO_ALL"):
        ra.register(dispatch="scatter")
    with pytest.raises(ValueError, match="execute=RANK_ZERO"):
        ra.register(dispatch=ra.Dispatch.DP_SPLIT, execute=ra.Execute.RANK_ZERO)
    with pytest.raises(TypeError, match="dispatch_fn, collect_fn"):
        ra.register(dispatch=(1, 2))


def test_hw_mapping_preference_and_wildcard():
    @ra.hw_mapping({"FrozenLake": ["H800", "H20"], "*": ["H20", "H800"]})
    def generate(self, request, tag_name):
        return None

    spec = getattr(generate, HW_MAPPING_ATTR)
    assert spec.preference("FrozenLake") == ("H800", "H20")
    assert spec.preference("Sokoban") == ("H20", "H800")
    assert spec.hardware_types == {"H800", "H20"}


def test_hw_mapping_unknown_tag_without_wildcard_is_a_clear_error():
    @ra.hw_mapping({"FrozenLake": ["H800"]})
    def generate(self, request, tag_name):
        return None

    with pytest.raises(LookupError, match=r"'Sokoban' has no hardware mapping .*FrozenLake.*\"\*\""):
        getattr(generate, HW_MAPPING_ATTR).preference("Sokoban")


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({}, "non-empty dict"),
        ({"A": []}, r"hw_mapping\['A'\] must be a non-empty list"),
        ({"A": "H800"}, r"hw_mapping\['A'\] must be a non-empty list"),
        ({"A": ["H800", "H800"]}, "lists a hardware type twice"),
    ],
)
def test_hw_mapping_rejects_bad_mappings(mapping, message):
    with pytest.raises(ValueError, match=message):
        ra.hw_mapping(mapping)


def test_hw_mapping_needs_a_tag_name_parameter():
    with pytest.raises(TypeError, match="must take a 'tag_name' parameter"):

        @ra.hw_mapping({"*": ["H20"]})
        def generate(self, request):
            return None


def test_register_serverless_metadata_and_validation():
    @ra.register_serverless(url="http://127.0.0.1:8100/rewards/math", timeout_s=30, retries=5, token_env="TOK")
    def compute_rewards(self, trajectories):
        raise AssertionError("never runs locally")

    spec = getattr(compute_rewards, SERVERLESS_ATTR)
    assert (spec.url, spec.timeout_s, spec.retries, spec.token_env) == (
        "http://127.0.0.1:8100/rewards/math",
        30.0,
        5,
        "TOK",
    )
    with pytest.raises(ValueError, match="absolute http"):
        ra.register_serverless(url="127.0.0.1:8100/rewards")
    with pytest.raises(ValueError, match="timeout_s"):
        ra.register_serverless(url="http://127.0.0.1:1/x", timeout_s=0)
    with pytest.raises(ValueError, match="retries"):
        ra.register_serverless(url="http://127.0.0.1:1/x", retries=-1)
