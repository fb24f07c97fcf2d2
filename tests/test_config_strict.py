"""Config values are taken as typed, never coerced: a number field refuses a boolean (YAML reads yes, no,
on and off as booleans), a boolean field refuses a number, and the error names the field and the type it
expects. Every section model of the config is held to it."""

from __future__ import annotations

import types
import typing

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from rollart.cli import main
from rollart.config import ConfigError, load_config, parse_sets, validate_config
from rollart.config_model import ConfigModel
from rollart.config_reference import sections
from rollart.resource_manager.specs import HardwareGroup, ResourceSpecError, parse_pools

MINIMAL = {
    "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
    "envs": [{"name": "reverse", "groups": 1}],
    "rollout": {"num_env_groups": 1, "group_size": 2, "batch_groups": 1},
}


def scalar_kinds(annotation: typing.Any) -> set[type]:
    """The scalar types a field takes (``int | None`` → {int}); empty for containers and models."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return scalar_kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return {k for a in typing.get_args(annotation) for k in scalar_kinds(a)}
    return {annotation} if annotation in (int, float, bool) else set()


def typed_fields() -> list[tuple[type[BaseModel], str, set[type]]]:
    found = [
        (s.model, name, scalar_kinds(f.annotation)) for s in sections() for name, f in s.model.model_fields.items()
    ]
    found += [(HardwareGroup, name, scalar_kinds(f.annotation)) for name, f in HardwareGroup.model_fields.items()]
    return [(m, n, k) for m, n, k in found if k]


def field_errors(model: type[BaseModel], name: str, value: typing.Any) -> list[dict]:
    try:
        model.model_validate({name: value})
    except ValidationError as err:
        return [e for e in err.errors() if e["loc"] and e["loc"][0] == name]
    return []


def test_every_section_model_is_strict():
    models = {s.model for s in sections()} | {HardwareGroup}
    assert all(issubclass(m, ConfigModel) and m.model_config.get("strict") for m in models), [
        m.__name__ for m in models if not m.model_config.get("strict")
    ]


def test_numbers_refuse_booleans_and_booleans_refuse_numbers_in_every_section():
    fields = typed_fields()
    assert len(fields) > 60  # every int, float and bool field of the config
    for model, name, kinds in fields:
        if bool not in kinds:
            assert field_errors(model, name, True), f"{model.__name__}.{name} took true as a number"
        if not kinds & {int, float}:
            assert field_errors(model, name, 1), f"{model.__name__}.{name} took 1 as a boolean"
            assert field_errors(model, name, "yes"), f"{model.__name__}.{name} took 'yes' as a boolean"


def test_set_yes_for_a_number_is_refused_naming_the_field_and_the_type(tmp_path, caplog):
    out = tmp_path / "never"
    code = main(["run", "quickstart", "--set", "rollout.alpha=yes", "--set", f"output_dir={out}"])
    assert code == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.endswith(
        "rollout.alpha: expects an integer, got true (YAML reads yes, no, on, off, true and false as booleans)"
    )
    assert not out.exists()  # refused before anything started


def test_problems_name_the_expected_type():
    cases = {
        "train.gradient_checkpointing=1": "train.gradient_checkpointing: expects true or false, got 1",
        "steps=5.0": "steps: expects an integer, got 5.0",
        "sampling.temperature=on": "sampling.temperature: expects a number, got true",
        "steps='5'": "steps: expects an integer, got the string '5'",
        "name=3": "name: expects a string, got 3",
    }
    for item, problem in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config("quickstart", parse_sets([item]))
        assert err.value.problems[0].startswith(problem), (item, err.value.problems)
    with pytest.raises(ResourceSpecError, match=r"pools.train.cpus: expects an integer, got true"):
        parse_pools({"train": {"hardware": "CPU", "cpus": True}})


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    """PyYAML alone reads 1e-3 as a string; strict number fields would refuse it."""
    cfg = load_config("quickstart", parse_sets(["train.lr=1e-3", "train.betas=[0.9, 0.95]"]))
    assert cfg.train.lr == 0.001 and cfg.train.betas == (0.9, 0.95)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(MINIMAL) + "train: {lr: 5e-4, weight_decay: 1E-2}\nsampling: {temperature: .5e1}\n")
    cfg = load_config(path)
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.sampling.temperature) == (0.0005, 0.01, 5.0)
    assert validate_config({**MINIMAL, "steps": 3}).steps == 3  # a YAML integer stays an integer
