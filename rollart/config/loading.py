"""Reading a config: the YAML file (or a shipped config by name), ``--set`` overrides, and validation into
one :class:`~rollart.config.errors.ConfigError` that lists every problem with its field path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from rollart.config.checks import cross_field_problems
from rollart.config.errors import ConfigError
from rollart.config.pipeline import PipelineConfig
from rollart.config.plugin_step import load_plugins
from rollart.config_model import load_yaml, type_problem


def shipped_configs() -> dict[str, Path]:
    """The configs that ship with rollart (``rollart.pipelines``), by name: ``{"quickstart": .../quickstart.yaml}``."""
    from importlib.resources import files

    folder = files("rollart.pipelines")
    return {Path(e.name).stem: Path(str(e)) for e in folder.iterdir() if e.name.endswith(".yaml")}


def resolve_config_path(path: str | Path) -> Path:
    """``path`` when that file exists, else the shipped config of that name (``quickstart`` or
    ``quickstart.yaml``), so ``rollart run quickstart`` works from any directory."""
    p = Path(path)
    if p.exists():
        return p
    name = Path(path).name.removesuffix(".yaml").removesuffix(".yml")
    shipped = shipped_configs()
    if name in shipped and (len(p.parts) == 1 or p.parent.name == "pipelines"):
        return shipped[name]
    raise ConfigError(f"config file {p} does not exist (shipped configs, usable by name: {', '.join(sorted(shipped))})")


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as ``load_config`` overrides (each value read as YAML); a malformed item
    exits with the fix."""
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--set {item!r}: use key=value, e.g. --set steps=5")
        key, value = item.split("=", 1)
        try:
            out[key] = load_yaml(value)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at column {mark.column + 1}" if mark is not None else ""
            raise SystemExit(
                f"--set {item!r}: the value is not valid YAML{where} ({getattr(err, 'problem', err)}); "
                "quote it, e.g. --set 'name=\"a: b\"'"
            ) from None
    return out


def yaml_error_line(err: yaml.YAMLError, source: str | Path) -> str:
    """A YAML error as one line: ``FILE:LINE:COLUMN: what`` (line and column counted from 1)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(source)
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and start is not mark:
        context = f"{context} (from line {start.line + 1}, column {start.column + 1})"
    problem = getattr(err, "problem", None)
    what = ", ".join(str(p) for p in (context, problem) if p) or str(err).splitlines()[0]
    return f"{where}: YAML syntax error: {what}"


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping of a YAML config file; a ConfigError naming the file, line and column on a syntax error."""
    try:
        raw = load_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(yaml_error_line(err, path)) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config is a mapping of keys (name:, pools:, ...), not a {type(raw).__name__}")
    return raw


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read and validate a YAML config; ``overrides`` are dotted keys (``{"steps": 3}``)."""
    p = resolve_config_path(path)
    raw = read_yaml(p)
    for dotted, value in (overrides or {}).items():
        set_dotted(raw, dotted, value)
    return validate_config(raw, source=p)


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Put ``value`` at the dotted key ``dotted`` (``"train.lr"``) of a raw config mapping, making the
    mappings on the way."""
    node = raw
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def _where(loc: tuple[Any, ...]) -> str:
    """A pydantic location as a config path: ``("envs", 0, "name")`` → ``envs[0].name``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _section_fields(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the config section that holds ``loc``'s last key ([] when unknown)."""
    import typing

    model: Any = PipelineConfig
    keyed = False  # the previous field was a dict of sections: this part is one of its keys
    for part in loc[:-1]:
        if isinstance(part, int) or keyed:
            keyed = False
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        keyed = typing.get_origin(field.annotation) is dict
        todo, model = [field.annotation], None
        while todo:  # the first pydantic model inside Optional[...] / list[...] / dict[..., ...]
            t = todo.pop(0)
            if isinstance(t, type) and issubclass(t, BaseModel):
                model = t
                break
            todo.extend(typing.get_args(t))
        if model is None:
            return []
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _problem(error: Any) -> str:
    loc = tuple(error["loc"])
    where = _where(loc)
    msg = str(error["msg"]).removeprefix("Value error, ")
    msg = msg.removeprefix(f"{where}: ")
    if not loc or msg.startswith((f"{where}.", f"{where}=")):
        return msg  # a section's own check, which names its fields (``rollout.batch_groups=9 exceeds ...``)
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        import difflib

        close = difflib.get_close_matches(str(loc[-1]), _section_fields(loc), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        msg = f"unknown key; {hint}remove it or fix its spelling"
    elif kind == "missing":
        msg = "required; add it"
    elif type_problem(error) is not None:
        msg = str(type_problem(error))
    elif kind != "value_error" and "input" in error and not isinstance(error["input"], (dict, list)):
        msg = f"{msg} (got {error['input']!r})"
    return f"{where}: {msg}"


def validate_config(raw: dict[str, Any], source: str | Path | None = None) -> PipelineConfig:
    """``PipelineConfig`` from a YAML mapping, or one :class:`ConfigError` listing every problem with
    its field path: the fields' own checks, env names and constructor kwargs, loss / aggregation /
    advantage names and parameters, the pipeline class, the plug-in modules' imports. Nothing is
    started. ``source`` (the YAML file) adds its folder to where plug-in modules are looked up."""
    context = {"config_dir": str(Path(source).resolve().parent)} if source is not None else {}
    if isinstance(raw, dict):  # the plug-ins first, in one reported step: the names they register are known below
        load_plugins(raw.get("plugins"), context.get("config_dir"))
    try:
        cfg = PipelineConfig.model_validate(raw, context=context)
    except ValidationError as err:
        errors = err.errors()
        problems = [line for e in errors for line in _problem(e).split("\n")]
        if any(e["loc"] for e in errors):  # field errors: the cross-field checks did not run; run them here
            problems += cross_field_problems(raw) if isinstance(raw, dict) else []
        problems = list(dict.fromkeys(problems))
    else:
        if cfg.data or cfg.eval is not None:
            cfg = _check_data(cfg, Path(source) if source is not None else Path("config.yaml"))
        return cfg
    head = f"{source}: " if source is not None else ""
    if len(problems) == 1:
        raise ConfigError(f"{head}{problems[0]}", problems)
    lines = "\n".join(f"  - {x}" for x in problems)
    raise ConfigError(f"{head}{len(problems)} problems in the config:\n{lines}", problems)


def _check_data(cfg: PipelineConfig, path: Path) -> PipelineConfig:
    """Data paths resolved against the config's folder (made importable, for verifiers next to it), every
    dataset, column and verifier loaded once: a missing one is a ConfigError now, not in a running job."""
    from rollart.data.prompts import check_config, resolve_paths
    from rollart.data.sources import DataError

    data, eval_cfg = resolve_paths(cfg.data, cfg.eval, path.parent)
    try:
        check_config(data, eval_cfg)
    except DataError as err:
        raise ConfigError(f"{path}: {err}", [str(err)]) from None
    return cfg.model_copy(update={"data": data, "eval": eval_cfg})
