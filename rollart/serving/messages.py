"""The Anthropic Messages API (``POST /v1/messages``) on top of the chat path.

A request is turned into the chat request it stands for (:func:`to_chat`): ``system`` a system
message; a user message's ``tool_result`` blocks ``tool`` messages (in their order) and its text
blocks a user message; an assistant message's text blocks its content and its ``tool_use`` blocks its
tool calls (``input`` as JSON arguments); ``tools`` (``input_schema``) chat tools; ``tool_choice``
``auto`` / ``any`` / ``tool`` / ``none`` as chat's ``auto`` / ``required`` / a function / ``none``;
``max_tokens``, ``temperature``, ``top_p``, ``stop_sequences`` as in chat. It is then served and
recorded exactly as a chat call, so an Anthropic conversation continues its session's tokens like a
chat one (the assistant message a harness sends back is the reply: its text and its ``tool_use``
blocks, compared with the reply's tool calls as parsed JSON).

The reply (:func:`message_body`) has a ``text`` block (when there is text, or nothing else) and a
``tool_use`` block per tool call; ``stop_reason`` is ``tool_use``, ``max_tokens``, ``stop_sequence``
(with ``stop_sequence``) or ``end_turn``. ``stream: true`` answers Anthropic's events
(:func:`stream_events`: ``message_start``, per block ``content_block_start`` / ``content_block_delta``
(``text_delta``, ``input_json_delta``) / ``content_block_stop``, ``message_delta``, ``message_stop``)
once the generation ends, as chat streams. What the endpoint cannot honour (images and documents,
extended thinking, ``top_k``) is refused with a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart.serving.protocol import MAX_STOP, APIError, ChatCompletionRequest, completion_id
from rollart.serving.service import Choice, Result


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/messages`` (the fields the endpoint reads; unknown ones are a 422)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def unsupported(self) -> APIError | None:
        if self.top_k is not None:
            return APIError(400, "top_k is not supported by this endpoint; leave it unset", param="top_k")
        if self.thinking and self.thinking.get("type") != "disabled":
            return APIError(400, "thinking is not supported by this endpoint; leave it unset", param="thinking")
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                return APIError(
                    400, f"tools.{i}: only custom tools (name, input_schema) are supported", param=f"tools.{i}.type"
                )
        return None


def _block_text(blocks: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise APIError(
                400, f"{where}.{j}: only text blocks are supported here (got {str(kind)[:32]!r})", param=f"{where}.{j}"
            )
        out.append(block["text"])
    return "".join(out)


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (OpenAI's form)."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _block_text(body.system, "system")})
    for i, msg in enumerate(body.messages):
        where = f"messages.{i}.content"
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(msg.content):
            kind = block.get("type")
            at = f"{where}.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and msg.role == "assistant":
                name, cid, args = block.get("name"), block.get("id"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(cid, str):
                    raise APIError(400, f"{at}: a tool_use block needs id and name", param=at)
                calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}})
            elif kind == "tool_result" and msg.role == "user":
                cid = block.get("tool_use_id")
                if not isinstance(cid, str):
                    raise APIError(400, f"{at}: a tool_result block needs tool_use_id", param=at)
                if texts:  # text before a result stays before it
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                content = _block_text(block.get("content") or "", f"{at}.content")
                out.append({"role": "tool", "tool_call_id": cid, "content": content})
            else:
                raise APIError(
                    400,
                    f"{at}: {str(kind)[:32]!r} blocks are not supported in {msg.role} messages (text, tool_use in "
                    "assistant messages and tool_result in user messages are)",
                    param=at,
                )
        if msg.role == "assistant":
            out.append(
                {"role": "assistant", "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {})}
            )
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    choice: Any = None
    if body.tool_choice is not None:
        kind = body.tool_choice.get("type")
        name = body.tool_choice.get("name")
        if kind == "tool" and isinstance(name, str):
            choice = {"type": "function", "function": {"name": name}}
        elif kind in ("auto", "none"):
            choice = kind
        elif kind == "any":
            choice = "required"
        else:
            raise APIError(
                400,
                "tool_choice: give {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                param="tool_choice",
            )
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description else {}),
                "parameters": t.input_schema,
            },
        }
        for t in body.tools or []
    ]
    return ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": chat_messages(body),
            "tools": tools or None,
            "tool_choice": choice,
            "max_completion_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stop": body.stop_sequences or None,
        }
    )


def _stop_reason(choice: Choice) -> str:
    if choice.tool_calls:
        return "tool_use"
    if choice.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if choice.stop is not None else "end_turn"


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return {}


def content_blocks(choice: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.text or not choice.tool_calls:
        blocks.append({"type": "text", "text": choice.text})
    for cid, call in choice.tool_calls:
        blocks.append({"type": "tool_use", "id": cid, "name": call.name, "input": _arguments(call.arguments)})
    return blocks


def message_body(model: str, result: Result, choice: Choice, *, message_id: str | None = None) -> dict[str, Any]:
    return {
        "id": message_id or completion_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(choice),
        "stop_reason": _stop_reason(choice),
        "stop_sequence": choice.stop,
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": len(choice.token_ids)},
    }


def stream_start(model: str, message_id: str, prompt_tokens: int) -> tuple[str, dict[str, Any]]:
    """``message_start``: the message before its content."""
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }
    return "message_start", {"type": "message_start", "message": start}


def text_block_start(index: int = 0) -> tuple[str, dict[str, Any]]:
    return "content_block_start", {
        "type": "content_block_start",
        "index": index,
        "content_block": {"type": "text", "text": ""},
    }


def text_delta(piece: str, index: int = 0) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {
        "type": "content_block_delta",
        "index": index,
        "delta": {"type": "text_delta", "text": piece},
    }


def stream_rest(
    head: dict[str, Any], pieces: list[str], *, text_open: bool = False
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The events after ``message_start`` (and after the text sent live when ``text_open``: the text
    block was opened, ``pieces`` are its unsent text); ``head``: the message body."""
    for index, block in enumerate(head["content"]):
        if block["type"] == "text":  # the first block, when there is one
            if not text_open:
                yield text_block_start(index)
            for piece in pieces:
                if piece:
                    yield text_delta(piece, index)
        else:
            opening = {**block, "input": {}}
            yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": opening}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": head["stop_reason"], "stop_sequence": head["stop_sequence"]},
            "usage": {"output_tokens": head["usage"]["output_tokens"]},
        },
    )
    yield "message_stop", {"type": "message_stop"}


def stream_events(
    model: str, result: Result, choice: Choice, pieces: list[str]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of a streamed reply; ``pieces``: the text, one piece per token."""
    head = message_body(model, result, choice)
    yield stream_start(model, head["id"], result.prompt_tokens)
    yield from stream_rest(head, pieces)
