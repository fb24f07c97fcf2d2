"""Weight channels, engines and training strategies declare what they can do, and a new one is one file.

A user's module next to the config registers a weight channel and a training strategy and defines an
engine class; the config names them, refuses by name what they do not declare (before anything starts),
and a run trains with all three (each leaves a mark in the process it ran in). The built-ins' declared
capabilities agree with their classes."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from rollart.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(600)

PARTS = '''
"""A weight channel, a training strategy and two engines: everything a config needs to name them."""
import os
from pathlib import Path

from rollart.engines.simulated import SimulatedEngine
from rollart.engines.torch_engine import TorchEngine
from rollart.pipeline.weight_sync import RaySync
from rollart.training.kinds import register_strategy
from rollart.training.torch_strategy import TorchTrainWorker
from rollart.weights.kinds import register_weight_channel

MARKS = Path(__file__).with_name("marks")


def mark(what):
    MARKS.mkdir(exist_ok=True)
    (MARKS / f"{what}-{os.getpid()}").touch()


@register_weight_channel("counted", serves_joiners=False)
class CountedSync(RaySync):
    """The Ray object store, marking each version it syncs."""

    async def sync(self, rollout, version):
        mark(f"sync{version}")
        return await super().sync(rollout, version)


@register_strategy("marked")
class MarkedWorker(TorchTrainWorker):
    """The torch strategy's worker, marking the process it runs in; declares no train feature."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        mark("train")


class MarkedEngine(TorchEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        mark("engine")


class Sleepless(SimulatedEngine):
    """An engine without a sleep mode."""


class OneDevice(TorchEngine):
    """An engine that runs colocated on a one-device train pool only."""

    max_colocated_devices = 1
'''


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``my_parts.py`` in the config's folder; the registries and ``sys.path`` are put back afterwards."""
    from rollart.training.kinds import STRATEGIES
    from rollart.weights.kinds import WEIGHT_CHANNELS

    monkeypatch.setattr(sys, "path", list(sys.path))
    channels, strategies = dict(WEIGHT_CHANNELS), dict(STRATEGIES)
    (tmp_path / "my_parts.py").write_text(textwrap.dedent(PARTS))
    yield tmp_path
    sys.modules.pop("my_parts", None)
    WEIGHT_CHANNELS.clear()
    WEIGHT_CHANNELS.update(channels)
    STRATEGIES.clear()
    STRATEGIES.update(strategies)


def config(folder: Path, **over) -> Path:
    raw = {
        "name": "kinds",
        "plugins": ["my_parts"],
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
        "envs": [{"name": "reverse", "groups": 2, "kwargs": {"length": 2}}],
        "rollout": {"num_env_groups": 2, "group_size": 2, "batch_groups": 2},
        "sampling": {"max_new_tokens": 3},
        "tiny_model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
        "steps": 2,
        "output_dir": str(folder / "run"),
        "cluster": {"metadata_store": str(folder / "meta.sqlite")},
    }
    raw.update(over)
    path = folder / "config.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return err.value.problems


def test_what_a_registered_part_does_not_declare_is_refused_by_name(parts: Path) -> None:
    # a channel that cannot serve workers joining later, on an elastic pool
    elastic = {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "H20", "devices": 1, "max_devices": 2}}
    got = problems(config(parts, pools=elastic, weights={"channel": "counted"}))
    assert got == [
        "pools.rollout.max_devices: an elastic pool needs weights that workers joining later can load; "
        "weights.channel counted does not declare serves_joiners: use ray or mooncake"
    ]
    # a strategy that declares no train feature
    got = problems(config(parts, train={"strategy": "marked", "sharding": "fsdp"}))
    assert got == [
        "train.sharding is implemented for train.strategy: torch only in this version (strategy marked does not "
        "declare it); remove train.sharding or use strategy: torch"
    ]
    # colocated mode: neither this strategy nor an engine without a sleep mode
    colocated = {"train": {"hardware": "H800", "devices": 1}, "rollout": {"colocate_with": "train"}}
    got = problems(config(parts, pools=colocated, train={"strategy": "marked"}, engine={"kind": "my_parts:Sleepless"}))
    assert any(p.startswith("engine.kind: my_parts:Sleepless does not implement sleep and wake_up") for p in got), got
    assert any(p.startswith("train.strategy: 'marked' is not supported in colocated mode") for p in got), got
    assert any("does not declare colocates" in p for p in got), got
    # colocated mode on more devices than an engine declares it runs on
    two = {"train": {"hardware": "H800", "devices": 2}, "rollout": {"colocate_with": "train"}}
    got = problems(config(parts, pools=two, engine={"kind": "my_parts:OneDevice"}))
    assert got == [
        "engine.kind: my_parts:OneDevice in colocated mode (pools.rollout: {colocate_with: train}) needs a one-device "
        "train pool (2 here): the engine declares max_colocated_devices 1 (each rank's in-process engine would set "
        "up a torch.distributed group of its own beside the trainer's); use torch, or devices: 1"
    ]
    load_config(config(parts, pools={**two, "train": {"hardware": "H800", "devices": 1}}, engine={"kind": "vllm"}))
    # a name nothing registered: the registered ones and the closest
    got = problems(config(parts, weights={"channel": "countd"}, train={"strategy": "torhc"}, engine={"kind": "vlm"}))
    assert any(p.startswith("weights.channel: unknown weight channel 'countd'; did you mean 'counted'?") for p in got)
    assert any(p.startswith("train.strategy: unknown training strategy 'torhc'; did you mean 'torch'?") for p in got)
    assert any(p.startswith("engine.kind: unknown engine 'vlm'; did you mean 'vllm'?") for p in got)


def test_a_run_trains_with_a_channel_a_strategy_and_an_engine_each_one_file(ray_local, parts: Path) -> None:
    from rollart.pipelines.agentic import AgenticPipeline

    cfg = load_config(
        config(
            parts,
            weights={"channel": "counted"},
            train={"strategy": "marked"},
            engine={"kind": "my_parts:MarkedEngine"},
        )
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
    finally:
        pipe.shutdown()
    assert [h["step"] for h in history] == [1, 2]
    marks = sorted(p.name for p in (parts / "marks").iterdir())
    kinds = {m.rsplit("-", 1)[0] for m in marks}
    assert {"engine", "train", "sync1", "sync2"} <= kinds, marks
    here = str(os.getpid())
    # the engine and the strategy ran in the workers, the channel's sync in the driver
    assert all(m.rsplit("-", 1)[1] != here for m in marks if m.startswith(("engine", "train"))), marks
    assert all(m.rsplit("-", 1)[1] == here for m in marks if m.startswith("sync")), marks


def test_the_built_in_kinds_declare_what_their_classes_do() -> None:
    from rollart.engines.base import InferenceEngine
    from rollart.engines.kinds import ENGINES
    from rollart.engines.sglang_engine import SGLangEngine
    from rollart.engines.simulated import SimulatedEngine
    from rollart.engines.torch_engine import TorchEngine
    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.pipeline.weight_sync import WeightSync
    from rollart.training.kinds import STRATEGIES, TRAIN_FEATURES
    from rollart.training.torch_strategy import TorchTrainWorker
    from rollart.weights.kinds import WEIGHT_CHANNELS

    engines = {"torch": TorchEngine, "vllm": VLLMEngine, "sglang": SGLangEngine, "simulated": SimulatedEngine}
    assert list(engines) == list(ENGINES)
    for name, cls in engines.items():  # their modules import without the engine's library
        kind = ENGINES[name]
        assert kind.target == f"{cls.__module__}:{cls.__qualname__}"
        declared = (kind.sleeps, kind.loads_model, kind.max_colocated_devices)
        assert declared == (cls.sleeps(), cls.loads_model, cls.max_colocated_devices), name
    assert [k for k, e in ENGINES.items() if e.max_colocated_devices is not None] == ["vllm"]
    assert not InferenceEngine.sleeps() and InferenceEngine.max_colocated_devices is None
    for name, channel in WEIGHT_CHANNELS.items():
        sync = channel.sync_class()
        assert issubclass(sync, WeightSync) and sync.kind == name
    assert [k for k, c in WEIGHT_CHANNELS.items() if not c.serves_joiners] == ["dist", "inprocess"]
    assert [k for k, c in WEIGHT_CHANNELS.items() if c.colocated] == ["inprocess"]
    torch_kind = STRATEGIES["torch"]
    assert torch_kind.worker_class() is TorchTrainWorker and torch_kind.features == frozenset(TRAIN_FEATURES)
    assert STRATEGIES["megatron"].features == frozenset() and STRATEGIES["megatron"].requires == (
        "megatron.core",
        "megatron",
    )


def test_the_plugins_load_in_one_reported_step(parts: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``plugins:`` are imported before the config is checked, and one line says what each registered."""
    import logging

    with caplog.at_level(logging.INFO, logger="rollart.config"):
        cfg = load_config(config(parts, weights={"channel": "counted"}))
    assert cfg.weights.channel == "counted"
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plugins: my_parts")]
    assert line.endswith("registered weight channel counted; training strategy marked"), line
    assert str(parts / "my_parts.py") in line
