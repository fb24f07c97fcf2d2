"""Settings of the policy endpoint (``serving:`` in a pipeline config, ``rollart serve policy`` flags)."""

from __future__ import annotations

from pydantic import Field, field_validator

from rollart.config_model import ConfigModel
from rollart.rollout.chat import check_template_setting


class ServingConfig(ConfigModel):
    """The OpenAI-compatible endpoint in front of the LLMProxy (`agent` envs play through it)."""

    host: str = "127.0.0.1"
    """The address it listens on: `127.0.0.1` for agents in the driver; `0.0.0.0` or this node's IP for agents
    on other hosts or in pods.
    """
    port: int = Field(default=0, ge=0, le=65535)
    """Its port; 0: a free port, chosen when it starts."""
    advertise_host: str | None = None
    """The address agents elsewhere use; null: `host` (this node's IP when `host` is `0.0.0.0`)."""
    token_env: str | None = None
    """Environment variable holding the bearer token every call carries; null: a random token per job."""
    model_name: str | None = None
    """The model id clients send as `model`; null: the pipeline's `name`."""
    chat_template: str = "auto"
    """`auto` (the tokenizer's own), a Jinja file or inline Jinja; `tools` need a template that renders them."""
    tool_parser: str = "hermes"
    """How tool calls are read from generated text: `hermes` (`<tool_call>{json}</tool_call>`), `none`, or
    `MODULE:FUNCTION`.
    """
    processes: int = Field(default=1, ge=0, le=64)
    """Server processes the endpoint runs in, beside the driver, each on its own port (`port + i` when `port` is
    set): HTTP, rendering, tokenising, streaming and the sessions' records run there, and the driver does per agent
    call what a direct LLMProxy call does. More processes serve more calls at once. 0: in the driver's event loop
    (a small job; every call then costs the driver's CPU).
    """
    batch_window_s: float = Field(default=0.02, ge=0, le=1)
    """With `processes`: calls that reach the processes within this many seconds after the last ones sent to
    the LLMProxy wait and go together, which sends them to a worker in one Ray call (the driver's CPU per call
    falls with the calls per Ray call). An idle endpoint sends a call at once; 0: every call at once.
    """
    harness_processes: int = Field(default=0, ge=0, le=256)
    """Processes the `agent` envs' harnesses play their episodes in, each with its own event loop and `openai`
    clients (whose CPU per call exceeds the endpoint's); the harness is imported there by its `MODULE:FUNCTION`.
    0: in the driver's event loop (its clients' CPU is then the driver's).
    """
    max_concurrency: int = Field(default=1024, ge=1)
    """Calls in flight at once (shared evenly by the processes); more are answered 429 with `Retry-After`."""
    max_sessions: int = Field(default=4096, ge=1)
    """Sessions open at once (shared evenly by the processes)."""
    session_ttl_s: float = Field(default=3600.0, gt=0)
    """An idle session expires after this many seconds."""
    max_calls: int = Field(default=256, ge=1)
    """Calls one session may make."""
    max_n: int = Field(default=16, ge=1)
    """The largest `n` a request may ask for."""
    max_body_bytes: int = Field(default=8 << 20, gt=0)
    """Larger request bodies are answered 413."""
    max_connections: int = Field(default=2048, gt=0)
    """Connections open at once (shared evenly by the processes); one more is answered 503 and closed at once."""
    read_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds a client has to send a request's headers, and as long again for its body (408 past it)."""

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str) -> str:
        return check_template_setting(value)

    @field_validator("tool_parser")
    @classmethod
    def _parser(cls, value: str) -> str:
        from rollart.serving.tools import tool_parser

        tool_parser(value)
        return value
