"""The configuration reference, generated from the pydantic models of a pipeline config.

``markdown()`` renders every section of :class:`rollart.config.PipelineConfig` as a table of its keys
(type with its bounds, default, description). The reference page of the documentation,
``docs/config.md``, holds it between two markers (:data:`BEGIN`, :data:`END`), so the Markdown file
reads whole without the site; ``python -m rollart.config_reference --write docs/config.md`` writes it
again after a config model changed (a test fails while the page and the models differ).
``undocumented()`` lists the fields without a description (a test keeps it empty).
``python -m rollart.config_reference`` prints the reference.
"""

from __future__ import annotations

import enum
import inspect
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Section:
    """One config section: its path in a YAML config (``train.lora``, ``envs[i]``) and its model."""

    path: str
    model: type[BaseModel]

    @property
    def anchor(self) -> str:
        path = self.path.replace("[i]", "").replace("<tag>", "tag").replace("<key>", "key")
        if "<" in path:  # one section for several keys: fault.<inference|train|...> -> fault-role
            path = path[: path.index("<")] + "role"
        return "cfg-" + (path.replace(".", "-").replace("_", "-") or "top")


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside ``annotation`` (``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _child_path(parent: str, name: str, annotation: Any) -> str:
    base = f"{parent}.{name}" if parent else name
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
        origin = typing.get_origin(annotation)
    if origin is list:
        return f"{base}[i]"
    if origin is dict:
        return f"{base}.<tag>" if name == "tasks" else f"{base}.<key>"
    return base


def sections(root: type[BaseModel] | None = None) -> list[Section]:
    """Every section reachable from ``root`` (default: the pipeline config), depth first, each model
    once (at the first path that reaches it)."""
    if root is None:
        from rollart.config import PipelineConfig

        root = PipelineConfig
    out: list[Section] = []
    seen: set[type[BaseModel]] = set()

    def walk(path: str, model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        out.append(Section(path, model))
        users: dict[type[BaseModel], list[str]] = {}  # child model -> the fields holding it
        for name, field in model.model_fields.items():
            for child in _models_in(field.annotation):
                users.setdefault(child, []).append(name)
        for child, names in users.items():
            if len(names) == 1:
                annotation = model.model_fields[names[0]].annotation
                walk(_child_path(path, names[0], annotation), child)
            else:  # one model under several keys (fault.inference, fault.train, ...): one section for all
                walk(f"{path}.<{'|'.join(names)}>" if path else f"<{'|'.join(names)}>", child)

    walk("", root)
    return out


def undocumented(root: type[BaseModel] | None = None) -> list[str]:
    """``section.key`` of every config field without a description."""
    return [
        f"{s.path or '(top level)'}.{name}"
        for s in sections(root)
        for name, field in s.model.model_fields.items()
        if not (field.description or "").strip()
    ]


def _type(annotation: Any, links: dict[type[BaseModel], Section]) -> str:
    """A short reading of a type: ``int``, ``"ray" | "mooncake"``, ``list[str]``, ``section`` links."""
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        section = links.get(annotation)
        return f"[section](#{section.anchor})" if section is not None else "mapping"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f'`"{m.value}"`' for m in annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0], links)
    if origin is typing.Literal:
        return " \\| ".join(f"`{_yaml(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a, links) for a in args)
    if origin in (list, tuple, set, frozenset):
        inner = ", ".join(_type(a, links) for a in args if a is not Ellipsis) or "any"
        return f"list of {inner}"
    if origin is dict:
        key, value = args if args else (str, Any)
        return f"mapping of {_type(key, links)} to {_type(value, links)}"
    if isinstance(annotation, type):
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation).replace("typing.", "")


def _bounds(field: FieldInfo) -> str:
    marks = {
        annotated_types.Ge: ("≥", "ge"),
        annotated_types.Gt: (">", "gt"),
        annotated_types.Le: ("≤", "le"),
        annotated_types.Lt: ("<", "lt"),
    }
    out = []
    for meta in field.metadata:
        for kind, (sign, attr) in marks.items():
            if isinstance(meta, kind):
                out.append(f"{sign} {getattr(meta, attr)}")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def _yaml(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return repr(value)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default if field.default is not PydanticUndefined else None
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    return f"`{_yaml(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _intro(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")  # the model's own docstring, never BaseModel's
    return inspect.cleandoc(doc) if doc else ""


def _rows(section: Section, links: dict[type[BaseModel], Section]) -> Iterator[str]:
    yield "| key | type | default | description |"
    yield "| --- | --- | --- | --- |"
    for name, field in section.model.model_fields.items():
        kind = _type(field.annotation, links)
        bounds = _bounds(field)
        if bounds:
            kind += f" ({bounds})"
        yield f"| `{name}` | {kind} | {_cell(_default(field))} | {_cell(field.description or '')} |"


def markdown(root: type[BaseModel] | None = None, heading: str = "##") -> str:
    """The reference of every section as Markdown: one heading and one table per section."""
    found = sections(root)
    links = {s.model: s for s in found}
    parts: list[str] = []
    for section in found:
        title = f"`{section.path}`" if section.path else "Top level"
        parts.append(f"{heading} {title} {{#{section.anchor}}}")
        intro = _intro(section.model)
        if intro:
            parts.append(intro)
        parts.append("\n".join(_rows(section, links)))
    return "\n\n".join(parts) + "\n"


BEGIN = "<!-- config-reference: generated by `python -m rollart.config_reference --write docs/config.md` -->"
END = "<!-- end of the generated config reference -->"


def page(text: str) -> str:
    """``text`` (the reference page) with the reference between :data:`BEGIN` and :data:`END` written anew."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"the page has no {BEGIN!r} ... {END!r} markers to write the reference between")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n\n{markdown()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"] and len(argv) == 2:
        path = Path(argv[1])
        path.write_text(page(path.read_text()))
        return 0
    if argv:
        sys.stderr.write("usage: python -m rollart.config_reference [--write docs/config.md]\n")
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
