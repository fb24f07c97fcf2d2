"""The error of a config that cannot run."""

from __future__ import annotations


class ConfigError(ValueError):
    """A pipeline config that cannot run; the message names the field of every problem (``problems``:
    one ``"field.path: what is wrong and the fix"`` line each)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]
