"""An env class declares its tag: the config reads it from the class (``tag``, or ``tag_for(kwargs)``) and
builds no env; an env that sets its tag only when it is built is refused by name where the tag is needed
(``tasks:``); where an env is built, a tag other than the declared one is refused, naming ``envs[i].tag``."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from rollart.config import ConfigError, load_config, task_tags
from rollart.envs import EnvSpec, env_class, make_env, registered_envs

ENVS = '''
from rollart.envs import TextEnv
from rollart.envs.reverse import ReverseTask

BUILT = []  # every env built from this module


class _Env(TextEnv):
    def reset(self, seed=None):
        return "", {}

    def step(self, action):
        return "", 0.0, True, False, {}


class Declared(_Env):
    """Its tag from its arguments; building one is recorded and fails."""

    tag = "declared"

    def __init__(self, level: int = 2):
        BUILT.append(type(self).__name__)
        raise RuntimeError("Declared was built")

    @classmethod
    def tag_for(cls, kwargs):
        return f"declared-{kwargs['level']}"


class Plain(_Env):
    """Its class attribute tag; building one is recorded and fails."""

    tag = "plain"

    def __init__(self):
        BUILT.append(type(self).__name__)
        raise RuntimeError("Plain was built")


class Late(_Env):
    """Its tag is known once it is built."""

    def __init__(self, name: str = "late"):
        BUILT.append(type(self).__name__)
        self.tag = name


class LateReverse(ReverseTask):
    """A subclass that renames its tag in __init__ without declaring tag_for."""

    def __init__(self, length: int = 3):
        super().__init__(length)
        self.tag = f"late-reverse-{length}"


class Liar(_Env):
    """Declares one tag and builds with another."""

    def __init__(self):
        BUILT.append(type(self).__name__)
        self.tag = "built-liar"

    @classmethod
    def tag_for(cls, kwargs):
        return "declared-liar"
'''


@pytest.fixture
def envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``tag_envs.py`` in the config's folder (its ``BUILT`` lists what was built); put back afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "tag_envs.py").write_text(textwrap.dedent(ENVS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("tag_envs", None)


def built() -> list[str]:
    return sys.modules["tag_envs"].BUILT


def config(folder: Path, envs: list[dict], **over) -> Path:
    raw = {
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
        "envs": envs,
        "rollout": {"num_env_groups": len(envs), "group_size": 2, "batch_groups": len(envs)},
        **over,
    }
    path = folder / "config.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return err.value.problems


def test_the_config_reads_each_env_tag_from_its_class_and_builds_no_env(envs: Path) -> None:
    entries = [
        {"name": "tag_envs:Declared", "kwargs": {"level": 5}},
        {"name": "tag_envs:Plain"},
        {"name": "tag_envs:Declared"},  # tag_for sees the constructor's defaults
        {"name": "reverse", "kwargs": {"length": 4}},
    ]
    tasks = {t: {"ratio": 1} for t in ("declared-5", "plain", "declared-2", "reverse-4")}
    cfg = load_config(config(envs, entries, tasks=tasks))
    assert task_tags(cfg) == [
        ("envs[0]", "declared-5"),
        ("envs[1]", "plain"),
        ("envs[2]", "declared-2"),
        ("envs[3]", "reverse-4"),
    ]
    assert cfg.task_quotas() == {"declared-5": 1, "plain": 1, "declared-2": 1, "reverse-4": 1}
    assert built() == []  # validating built nothing (each of these raises when built)


def test_an_env_that_sets_its_tag_when_built_is_refused_by_name_where_the_tag_is_needed(envs: Path) -> None:
    fix = "(or declare it in the class: the class attribute tag, or the class method tag_for(kwargs))"
    got = problems(config(envs, [{"name": "tag_envs:Late"}], tasks={"late": {"ratio": 1}}))
    assert got == [f"envs[0]: env tag_envs:Late sets its tag when it is built; set envs[0].tag {fix}"]
    # a subclass renaming the tag in its __init__ without declaring tag_for
    entries = [{"name": "reverse"}, {"name": "tag_envs:LateReverse"}]
    got = problems(config(envs, entries, tasks={"reverse-3": {"ratio": 1}}))
    assert got == [f"envs[1]: env tag_envs:LateReverse sets its tag when it is built; set envs[1].tag {fix}"]
    # the tag set in the config, or no tasks: (the tag is not needed): accepted
    cfg = load_config(config(envs, [{"name": "tag_envs:Late", "tag": "late"}], tasks={"late": {"ratio": 1}}))
    assert task_tags(cfg) == [("envs[0]", "late")]
    load_config(config(envs, [{"name": "tag_envs:Late"}]))
    assert built() == []


def test_where_an_env_is_built_a_tag_other_than_the_declared_one_is_refused(envs: Path) -> None:
    from rollart.config.sections import EnvEntry
    from rollart.envservice.backends import EnvPools

    entries = [
        EnvEntry(name="tag_envs:Liar"),
        EnvEntry(name="tag_envs:Liar", tag="mine"),
        EnvEntry(name="reverse", kwargs={"length": 4}),
        EnvEntry(name="tag_envs:Late"),
    ]
    pools = EnvPools(entries, rm=None)  # local envs only: built here
    with pytest.raises(ValueError) as err:
        pools.make(0, EnvSpec(name="tag_envs:Liar"))
    assert str(err.value) == (
        "envs[0]: env tag_envs:Liar was built with tag 'built-liar', but its class declares (tag, tag_for) "
        "'declared-liar'; make the class declare the tag it builds, or set envs[0].tag"
    )
    assert pools.make(1, EnvSpec(name="tag_envs:Liar", tag="mine")).tag == "mine"
    assert pools.make(2, EnvSpec(name="reverse", kwargs={"length": 4})).tag == "reverse-4"
    assert pools.make(3, EnvSpec(name="tag_envs:Late")).tag == "late"  # declares none: nothing to compare


def test_every_built_in_env_declares_the_tag_it_builds() -> None:
    from rollart.envs import declared_tag

    for name in registered_envs():
        assert declared_tag(env_class(name), {}) == make_env(name).tag, name
    reverse = env_class("reverse")
    assert declared_tag(reverse, {"length": 7}) == make_env("reverse", length=7).tag == "reverse-7"
    from rollart.envs.dataset import DatasetEnv

    assert declared_tag(DatasetEnv, {}) is None  # its tag is its prompt set's: known once built
