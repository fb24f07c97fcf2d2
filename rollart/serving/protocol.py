"""The OpenAI wire format the endpoint speaks: request bodies (validated), response bodies, errors.

Only what the endpoint implements is accepted: a field the policy cannot honour (a penalty, a logit
bias, a response format) is refused with a 400 naming it, never ignored; an unknown field is a 422. Fields clients send that change nothing here (``user``, ``metadata``,
``store``, ``parallel_tool_calls``) are accepted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4  # stop sequences per request, as OpenAI allows
MAX_STOP_CHARS = 1000  # characters of one stop sequence
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed integer, what the engines' generators take


class APIError(Exception):
    """An error answered as an OpenAI error object: ``{"error": {message, type, param, code}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "service_unavailable",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        out = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}
        if self.status == 401:
            out["WWW-Authenticate"] = "Bearer"
        return out


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # streamed deltas carry it; a message echoed back may too


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of ``messages``; extra fields an SDK echoes back (``refusal``, ``annotations``,
    ``audio``, ``function_call``) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (``developer`` renders as ``system``)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def key(self) -> tuple[Any, ...]:
        """What identifies the message when a later call sends the history again (ids and names an SDK
        may drop or rewrite are left out; tool-call arguments compared as parsed JSON where they parse)."""
        calls = tuple((c.function.name, _canonical_json(c.function.arguments)) for c in self.tool_calls or [])
        role = "system" if self.role == "developer" else self.role
        return (role, self.text(), calls)


def _canonical_json(text: str) -> str:
    import json

    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError, RecursionError):
        return text


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class _Sampling(_Body):
    """The sampling fields both endpoints share."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"give at most {MAX_STOP} non-empty stop sequences of at most {MAX_STOP_CHARS} characters")
        return stops

    def unsupported(self) -> APIError | None:
        """A 400 for a field the engine cannot honour (never silently ignored)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return APIError(400, f"{name} is not supported by this endpoint; leave it unset or 0", param=name)
        if self.logit_bias:
            return APIError(400, "logit_bias is not supported by this endpoint; leave it unset", param="logit_bias")
        return None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> APIError | None:
        err = super().unsupported()
        if err is not None:
            return err
        if self.top_logprobs and not self.logprobs:
            return APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.tool_choice is not None and self.tool_choice not in ("none", "auto"):
            try:
                self.forced_tool()
            except APIError as err:
                return err
        if self.response_format is not None and self.response_format.type != "text":
            return APIError(
                400,
                "response_format: only {'type': 'text'} is supported (no constrained decoding)",
                param="response_format",
            )
        if self.messages[-1].role == "assistant":
            return APIError(
                400,
                "the last message is an assistant message: continuing a prefilled reply is not supported",
                param="messages",
            )
        return None

    def forced_tool(self) -> tuple[bool, str | None]:
        """``(forced, name)``: whether ``tool_choice`` forces a call (``"required"`` or one function),
        and the function it names (None: the model picks among the tools)."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return False, None
        names = [t.function.name for t in self.tools or []]
        if not names:
            raise APIError(400, f"tool_choice: {choice!r} forces a tool call; give the tools", param="tool_choice")
        if choice == "required":
            return True, names[0] if len(names) == 1 else None
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                "tool_choice: give 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                param="tool_choice",
            )
        if name not in names:
            raise APIError(400, f"tool_choice: {name!r} is not one of the tools {names}", param="tool_choice")
        return True, name

    def top_wanted(self) -> int:
        """Top log-probs per token the reply lists (0: none)."""
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> APIError | None:
        err = super().unsupported()
        if err is not None:
            return err
        if self.echo:
            return APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            return APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            return APIError(400, "best_of is not supported; use n", param="best_of")
        return None

    def top_wanted(self) -> int:
        return self.logprobs or 0


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
