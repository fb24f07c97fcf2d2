"""The base of every config section model: unknown keys refused, field docstrings as descriptions, and
strict types.

Strict means a value must already be of the field's type: a number field refuses ``true`` (YAML reads
``yes``, ``no``, ``on`` and ``off`` as booleans too, so ``--set rollout.alpha=yes`` would otherwise
have run with alpha 1), a boolean field refuses ``1`` and ``"yes"``, an integer field refuses ``2.0``
and ``"2"``, a string field refuses ``3``. An integer is accepted where a number (float) is expected.
YAML configs and ``--set`` values are read with :data:`ConfigLoader`, which reads ``1e-3`` as a number
(PyYAML alone reads it as a string). A field that takes a YAML list as a tuple says so with
``Field(strict=False)`` and strict items (``tuple[StrictFloat, StrictFloat]``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigLoader", "ConfigModel", "load_yaml", "type_problem"]


class ConfigModel(BaseModel):
    """A config section: ``extra="forbid"``, attribute docstrings as field descriptions, strict types."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True)


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with numbers in exponent form (``1e-3``, ``5E4``, ``1.5e3``) read as floats,
    as YAML 1.2 reads them; PyYAML reads them as strings unless they hold a dot and a signed exponent."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> object:
    """``text`` read as YAML with :class:`ConfigLoader`."""
    return yaml.load(text, Loader=ConfigLoader)


_EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
}


def type_problem(error: Mapping[str, Any]) -> str | None:
    """A pydantic error about a value of the wrong type, as ``expects an integer, got true (...)``; None
    for any other error."""
    expected = _EXPECTED.get(str(error.get("type")))
    if expected is None:
        return None
    got = error.get("input")
    if isinstance(got, bool):
        return f"expects {expected}, got {str(got).lower()} (YAML reads yes, no, on, off, true and false as booleans)"
    if isinstance(got, str):
        return f"expects {expected}, got the string {got!r}"
    if isinstance(got, (dict, list)):
        return f"expects {expected}, got a {'mapping' if isinstance(got, dict) else 'list'}"
    return f"expects {expected}, got {got!r}"
