"""The OpenAI Responses API (``POST /v1/responses``) on top of the chat path.

A request is turned into the chat request it stands for (:func:`to_chat`): ``instructions`` a system
message, ``input`` (a string, or input items: messages, ``function_call`` and ``function_call_output``
items) the messages after the history of ``previous_response_id``, function ``tools`` chat tools,
``tool_choice`` and ``max_output_tokens`` as in chat. It is then served and recorded exactly as a chat
call (:meth:`rollart.serving.service.PolicyService.chat`), so a Responses conversation continues its
session's tokens like a chat one: whether its turns arrive through ``previous_response_id`` or as
input items that repeat the output (a ``message`` and its ``function_call`` items are one assistant
message).

The reply (:func:`response_body`) has a ``message`` item with the content (``output_text``) and a
``function_call`` item per tool call. The conversation of each response (its history, its input and
its output; not its instructions, as OpenAI does) is kept in a bounded store
(:class:`ResponseStore`) for ``previous_response_id``; a response of a session continues only in that
session. Fields the endpoint cannot honour (reasoning, a structured text format, ``include``,
``truncation: auto``, ``top_logprobs``) are refused with a 400 naming them.

``stream: true`` answers the Responses events (:func:`stream_events`: ``response.created``,
``response.in_progress``, per output item ``response.output_item.added`` ... ``response.output_item.done``
with the text deltas or function-call argument deltas between, ``response.completed``) once the
generation ends, as chat streams.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    ToolCall,
    completion_id,
    now,
)
from rollart.serving.service import Choice, Result

MAX_STORED = 4096  # responses kept for previous_response_id (the oldest go first)


class ResponsesTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (the fields the endpoint reads; unknown ones are a 422)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> APIError | None:
        if self.reasoning:
            return APIError(400, "reasoning is not supported by this endpoint; leave it unset", param="reasoning")
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict) or fmt.get("type") != "text":
            return APIError(400, "text.format: only {'type': 'text'} is supported", param="text.format")
        if self.include:
            return APIError(400, "include is not supported by this endpoint; leave it unset", param="include")
        if self.truncation == "auto":
            return APIError(400, "truncation: only 'disabled' is supported", param="truncation")
        if self.top_logprobs:
            return APIError(400, "top_logprobs is not supported on /v1/responses; use chat", param="top_logprobs")
        for i, tool in enumerate(self.tools or []):
            if tool.type != "function" or not tool.name:
                return APIError(
                    400, f"tools.{i}: only function tools (type 'function' with a name) are supported", param="tools"
                )
        return None


class ResponseStore:
    """The conversations of the last :data:`MAX_STORED` responses, by id, with the session they belong to."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit = limit
        self._items: OrderedDict[str, tuple[str | None, list[ChatMessage]]] = OrderedDict()

    def get(self, response_id: str, session: str | None) -> list[ChatMessage]:
        item = self._items.get(response_id)
        if item is None or item[0] != session:
            raise APIError(
                404,
                f"previous_response_id: no response {response_id[:64]!r} here (responses are kept in their session, "
                f"the last {self.limit})",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        self._items.move_to_end(response_id)
        return list(item[1])

    def put(self, response_id: str, session: str | None, conversation: list[ChatMessage]) -> None:
        self._items[response_id] = (session, conversation)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


def _text(content: Any, where: str) -> str:
    """The text of an item's content: a string, or parts of type ``input_text`` / ``output_text`` / ``text``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: give a string or a list of text parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(
                400, f"{where}.{j}: only text parts are supported (got {str(kind)[:32]!r})", param=f"{where}.{j}"
            )
        out.append(part["text"])
    return "".join(out)


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """Input items as chat messages: a ``function_call`` joins the assistant message before it (or opens
    one), a ``function_call_output`` is a ``tool`` message."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message" and "role" in item:
            role = item["role"]
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: {str(role)[:32]!r} is not a message role", param=f"{where}.role")
            out.append(ChatMessage(role=role, content=_text(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(cid, str):
                raise APIError(400, f"{where}: a function_call needs name, arguments and call_id", param=where)
            call = ToolCall(id=cid, function=FunctionCall(name=name, arguments=args))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            cid, output = item.get("call_id"), item.get("output")
            if not isinstance(cid, str):
                raise APIError(400, f"{where}: a function_call_output needs its call_id", param=where)
            out.append(ChatMessage(role="tool", content=_text(output, f"{where}.output"), tool_call_id=cid))
        else:
            raise APIError(
                400,
                f"{where}: items of type {str(kind)[:32]!r} are not supported (messages, function_call and "
                "function_call_output are)",
                param=where,
            )
    return out


def to_chat(body: ResponsesRequest, history: list[ChatMessage]) -> tuple[ChatCompletionRequest, list[ChatMessage]]:
    """The chat request ``body`` stands for, and the conversation it adds to (history + input)."""
    conversation = [*history, *input_messages(body.input)]
    if not conversation:
        raise APIError(400, "input: give at least one message", param="input")
    messages = ([ChatMessage(role="system", content=body.instructions)] if body.instructions else []) + conversation
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in body.tools or []
    ]
    choice: Any = body.tool_choice
    if isinstance(choice, dict):
        name = choice.get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError(
                400,
                "tool_choice: give 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": name}}
    chat = ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": [m.model_dump(exclude_none=True) for m in messages],
            "tools": [{k: v for k, v in t.items() if v is not None} for t in tools] or None,
            "tool_choice": choice,
            "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
        }
    )
    return chat, conversation


def reply_message(choice: Choice) -> ChatMessage:
    """The reply as the assistant message the conversation continues with."""
    calls = [
        ToolCall(id=cid, function=FunctionCall(name=c.name, arguments=c.arguments)) for cid, c in choice.tool_calls
    ]
    return ChatMessage(role="assistant", content=choice.text or None, tool_calls=calls or None)


def response_body(
    response_id: str,
    model: str,
    body: ResponsesRequest,
    result: Result,
    choice: Choice,
    *,
    message_id: str | None = None,
) -> dict[str, Any]:
    """The response; ``message_id``: its message item's id (one a stream announced already)."""
    output: list[dict[str, Any]] = []
    if choice.text or not choice.tool_calls:
        output.append(
            {
                "id": message_id or completion_id("msg"),
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": choice.text, "annotations": []}],
            }
        )
    for cid, call in choice.tool_calls:
        output.append(
            {
                "id": completion_id("fc"),
                "type": "function_call",
                "status": "completed",
                "call_id": cid,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
    incomplete = choice.finish_reason == "length"
    completion = len(choice.token_ids)
    return {
        "id": response_id,
        "object": "response",
        "created_at": now(),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": output,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "store": body.store if body.store is not None else True,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + completion,
        },
    }


def response_head(response_id: str, model: str, body: ResponsesRequest) -> dict[str, Any]:
    """A response's fields before its reply is known (what ``response.created`` carries)."""
    return response_body(response_id, model, body, Result([], 0, 0), Choice(0, [], [], "", "stop"))


class EventSeq:
    """Numbers the events of one streamed response (``sequence_number``)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        self.n += 1
        return kind, {"type": kind, "sequence_number": self.n - 1, **data}


def stream_opening(response: dict[str, Any], seq: EventSeq) -> Iterator[tuple[str, dict[str, Any]]]:
    """``response.created`` and ``response.in_progress`` (``response``: its head, or the whole body)."""
    opening = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield seq("response.created", response=opening)
    yield seq("response.in_progress", response=opening)


def stream_text_opening(item_id: str, seq: EventSeq) -> Iterator[tuple[str, dict[str, Any]]]:
    """The opening of the message item (output 0) whose text streams."""
    item = {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    yield seq("response.output_item.added", output_index=0, item=item)
    part = {"type": "output_text", "text": "", "annotations": []}
    yield seq("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part)


def text_delta(item_id: str, piece: str, seq: EventSeq) -> tuple[str, dict[str, Any]]:
    return seq("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=piece, logprobs=[])


def stream_rest(
    response: dict[str, Any], pieces: list[str], seq: EventSeq, *, text_open: bool = False
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The events after the opening (and after the text sent live when ``text_open``: the message
    item was opened, ``pieces`` are its unsent text)."""
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":  # the first item, when there is one
            if not text_open:
                yield from stream_text_opening(item["id"], seq)
            part = item["content"][0]
            for piece in pieces:
                if piece:
                    yield seq("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[])
            yield seq("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            yield seq("response.content_part.done", **at, content_index=0, part=part)
        else:
            yield seq(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            yield seq("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield seq("response.function_call_arguments.done", **at, arguments=item["arguments"], name=item["name"])
        yield seq("response.output_item.done", output_index=index, item=item)
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield seq(done, response=response)


def stream_events(response: dict[str, Any], pieces: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(event type, data)`` of a streamed response; ``pieces``: the message's text, one piece per token."""
    seq = EventSeq()
    yield from stream_opening(response, seq)
    yield from stream_rest(response, pieces, seq)
