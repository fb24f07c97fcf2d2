"""A config's model must be loadable offline (a Hugging Face folder, or a model the offline Hugging Face cache
holds): a wrong one is a config error naming the key and the fix, before Ray or any worker starts."""

from __future__ import annotations

import pytest

from rollart.config import ConfigError, validate_config
from rollart.models import default_tiny_path

BASE = {
    "name": "m",
    "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
    "envs": [{"name": "reverse", "groups": 8}],
}


def problems(**fields) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate_config({**BASE, **fields})
    return err.value.problems


def test_a_model_folder_that_does_not_exist_is_a_config_error(tmp_path):
    [msg] = problems(model=str(tmp_path / "no-such-model"))
    assert msg.startswith("model: ") and "no-such-model" in msg
    assert "offline Hugging Face cache" in msg and "leave it out for the built-in tiny model" in msg


def test_a_folder_without_config_json_and_a_file_are_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"0")
    msgs = problems(model=str(tmp_path), train={"model": str(tmp_path / "weights.bin")})
    assert msgs[0].startswith("model: ") and "folder without a config.json" in msgs[0]
    assert msgs[1].startswith("train.model: ") and "is a file" in msgs[1]


def test_reported_with_the_other_config_errors(tmp_path):
    msgs = problems(model="not/cached-anywhere", steps=0)
    assert any(m.startswith("steps:") for m in msgs) and any(m.startswith("model:") for m in msgs)


def test_a_hugging_face_folder_and_a_cached_model_name_pass(tmp_path, monkeypatch):
    assert validate_config({**BASE, "model": str(default_tiny_path())}).model == str(default_tiny_path())
    # an offline Hugging Face cache holding acme/tiny (the layout huggingface_hub writes)
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--acme--tiny"
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "snapshots" / "0123abc" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert validate_config({**BASE, "model": "acme/tiny"}).model == "acme/tiny"
    [msg] = problems(model="acme/other")
    assert str(tmp_path / "hub") in msg


def test_engines_that_load_no_hugging_face_model_are_not_checked():
    cfg = validate_config({**BASE, "engine": {"kind": "simulated", "model": "-"}})
    assert cfg.engine.model == "-"
    [msg] = problems(engine={"kind": "torch", "model": "-"})
    assert msg.startswith("engine.model: ")


def test_rollart_run_exits_with_the_error_before_anything_starts(tmp_path, capsys, caplog):
    import yaml

    from rollart.cli import main

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**BASE, "model": str(tmp_path / "missing")}))
    assert main(["run", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err + caplog.text
    assert "model: " in err and "Traceback" not in err
