"""Tool calls in generated text: parsers that turn what the model wrote into OpenAI ``tool_calls``.

A model writes a tool call in the format its chat template taught it; the parser of that format
(``tool_parser``: ``hermes``, ``none`` or ``MODULE:FUNCTION``) returns the content left and the calls.
``hermes`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the format of
Qwen2.5, Hermes and rollart's own tool template); a block that is not valid JSON with a ``name`` stays
in the content as text, so the agent sees what the model wrote. The tokens that train are the tokens
the model generated, whatever the parser makes of them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


ToolParser = Callable[[str], tuple[str | None, list[ParsedCall]]]


def hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a completion in the Hermes format."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    pos = 0
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except (ValueError, RecursionError):  # what the model wrote is not JSON (or nested past any use)
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                json.loads(args)
            except (ValueError, RecursionError):
                continue
            arguments = args
        else:
            arguments = json.dumps(args, ensure_ascii=False)
        calls.append(ParsedCall(obj["name"], arguments))
        kept.append(text[pos : m.start()])
        pos = m.end()
    if not calls:
        return text, []
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def no_tools(text: str) -> tuple[str | None, list[ParsedCall]]:
    return text, []


PARSERS: dict[str, ToolParser] = {"hermes": hermes, "none": no_tools}


def tool_parser(name: str) -> ToolParser:
    """The parser ``name`` (``hermes``, ``none``) or a user's ``MODULE:FUNCTION`` of the same signature."""
    if name in PARSERS:
        return PARSERS[name]
    if ":" not in name:
        raise ValueError(f"tool_parser {name!r}: use one of {sorted(PARSERS)} or MODULE:FUNCTION")
    from rollart.plugins import import_object

    fn = import_object(name, "tool_parser")
    if not callable(fn):
        raise ValueError(f"tool_parser {name!r} is not a function")
    return fn  # type: ignore[no-any-return]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
