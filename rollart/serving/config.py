"""Settings of the policy endpoint (``serving:`` in a pipeline config, ``rollart serve policy`` flags)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollart.rollout.chat import check_template_setting


class ServingConfig(BaseModel):
    """The OpenAI-compatible endpoint in front of the LLMProxy.

    ``host``/``port``: where it listens (port 0: a free port, chosen at start). Harnesses in the driver
    reach it on ``host``; harnesses elsewhere (another process, host or pod) on ``advertise_host``
    (default: ``host``, or this node's IP when ``host`` is ``0.0.0.0``). Every call carries the job's
    bearer token: the value of ``token_env`` when set, else a random token made per job.
    """

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    advertise_host: str | None = None
    token_env: str | None = None
    model_name: str | None = None  # the model id clients send (default: the pipeline's name)
    chat_template: str = (
        "auto"  # auto: the tokenizer's own; else a file or inline Jinja (tools need one that renders them)
    )
    tool_parser: str = "hermes"  # hermes, none or MODULE:FUNCTION (rollart.serving.tools)
    max_concurrency: int = Field(default=1024, ge=1)  # calls in flight; more get 429 + Retry-After
    max_sessions: int = Field(default=4096, ge=1)
    session_ttl_s: float = Field(default=3600.0, gt=0)
    max_calls: int = Field(default=256, ge=1)  # calls per session
    max_n: int = Field(default=16, ge=1)
    max_body_bytes: int = Field(default=8 << 20, gt=0)

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
