"""Chat templates, token-in/token-out (issue #16).

An instruct model is trained on conversations rendered with its chat template. :class:`ChatFormat`
renders an env's first observation as ``[system, user]`` messages with the generation prompt, and
every later observation as one more ``user`` (or ``tool``) message. It never re-encodes the
conversation: the tokens of a trajectory are the prompt's tokens, then each action's tokens exactly as
the engine generated them, then the tokens of the text the template puts between that action and the
next generation (the end of the assistant turn, the new message and the generation prompt), encoded
on their own. Encoding the whole rendered conversation again could merge characters across those
boundaries into other tokens (BPE) and train the policy on ids it never produced.

The text between two generations is found by rendering a fixed two-message conversation with and
without the new message (the suffix), and by rendering an assistant message with a marker content
(what follows the content closes the turn). A generation that ended on the turn's closing token
(its stop token) already holds that token; a generation cut by the length limit gets it appended as
an observation token.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_MARK = "\u2063rollart-marker\u2063"  # an assistant content no template rewrites


class ChatTemplateError(ValueError):
    """The chat template cannot render a conversation token-in/token-out; the message says why."""


def looks_like_template(setting: str) -> bool:
    """Whether ``setting`` is inline Jinja rather than a path."""
    return "{%" in setting or "{{" in setting


def check_template_setting(setting: str) -> str:
    """Validate ``env_manager.chat_template``: ``auto``, ``none``, an existing file or inline Jinja."""
    if setting in ("auto", "none") or looks_like_template(setting) or Path(setting).expanduser().is_file():
        return setting
    raise ValueError(
        f"{setting!r} is not 'auto', 'none', an existing file or a Jinja template "
        "(inline text with {% ... %} or {{ ... }}); fix the path or use auto"
    )


def resolve_template(tokenizer: Any, setting: str) -> str | None:
    """The Jinja text to render with, or None for raw text. ``auto``: the tokenizer's own template
    when it has one; ``none``: raw text; else a file path or the template itself."""
    check_template_setting(setting)
    if setting == "none":
        return None
    if setting == "auto":
        return getattr(tokenizer, "chat_template", None) or None
    if looks_like_template(setting):
        return setting
    return Path(setting).expanduser().read_text()


PROMPT_CACHE = 4096  # first prompts a ChatFormat keeps rendered


class ChatFormat:
    """One tokenizer with one chat template; renders prompts and the token delta of each turn."""

    def __init__(self, tokenizer: Any, template: str, observation_role: str = "user"):
        self.tokenizer = tokenizer
        self.template = template
        self._prompts: dict[tuple[str, str | None], tuple[int, ...]] = {}  # see prompt_ids
        self.observation_role = observation_role
        base = [{"role": "user", "content": "x"}]
        with_mark = self.render([*base, {"role": "assistant", "content": _MARK}], generation_prompt=False)
        cut = with_mark.rfind(_MARK)
        if cut < 0:
            raise ChatTemplateError("chat_template: the template drops the assistant message's content")
        self._closing = with_mark[cut + len(_MARK) :]  # what ends an assistant turn, e.g. "<|im_end|>\n"
        self._base = [*base, {"role": "assistant", "content": "y"}]
        self._base_text = self.render(self._base, generation_prompt=False)
        closing_ids = self.encode(self._closing)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        # the token that closes a turn, when it is a special token: generation stops on it
        self.turn_end_id: int | None = closing_ids[0] if closing_ids and closing_ids[0] in special else None
        self._turn_end_text = self.tokenizer.decode([self.turn_end_id]) if self.turn_end_id is not None else ""
        if self._turn_end_text and not self._closing.startswith(self._turn_end_text):
            self.turn_end_id, self._turn_end_text = None, ""

    @property
    def stop_token_ids(self) -> list[int]:
        return [] if self.turn_end_id is None else [self.turn_end_id]

    def render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as err:
            roles = [m["role"] for m in messages]
            raise ChatTemplateError(
                f"chat_template: rendering roles {roles} failed: {type(err).__name__}: {err}"
            ) from err
        if not isinstance(text, str):
            raise ChatTemplateError(f"chat_template: rendering gave {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) become their ids,
        and nothing is added around it (the template writes any BOS itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def messages(self, observation: str, system: str | None) -> list[dict[str, str]]:
        first = [{"role": "system", "content": system}] if system else []
        return [*first, {"role": "user", "content": observation}]

    def prompt_ids(self, observation: str, system: str | None = None) -> list[int]:
        """The first prompt: ``[system?, user]`` rendered with the generation prompt, encoded. The
        members of a group share their prompt: the last :data:`PROMPT_CACHE` prompts are kept (in a
        profile of the throughput bench's driver, rendering every member's prompt took 17% of its event
        loop's time)."""
        key = (observation, system)
        ids = self._prompts.get(key)
        if ids is None:
            ids = tuple(self.encode(self.render(self.messages(observation, system), generation_prompt=True)))
            if len(self._prompts) >= PROMPT_CACHE:
                self._prompts.pop(next(iter(self._prompts)))  # the oldest first
            self._prompts[key] = ids
        return list(ids)

    def observation_text(self, observation: str, generated_ids: list[int]) -> str:
        """The text after an action whose tokens were ``generated_ids``: the rest of the assistant turn,
        the observation as a ``observation_role`` message, then the generation prompt."""
        closing = self._closing
        if self._turn_end_text and generated_ids and generated_ids[-1] == self.turn_end_id:
            closing = closing[len(self._turn_end_text) :]  # the model already closed its turn
        message = {"role": self.observation_role, "content": observation}
        full = self.render([*self._base, message], generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ChatTemplateError(
                "chat_template: adding a message re-renders the earlier ones differently, so a turn's tokens "
                "cannot be appended without re-encoding the conversation; use a template whose rendering of a "
                "conversation is a prefix of its rendering with one more message"
            )
        return closing + full[len(self._base_text) :]

    def observation_ids(self, observation: str, generated_ids: list[int]) -> list[int]:
        """:meth:`observation_text` encoded on its own (never merged with the generated tokens)."""
        return self.encode(self.observation_text(observation, generated_ids))


def chat_format(tokenizer: Any, setting: str = "auto", observation_role: str = "user") -> ChatFormat | None:
    """The :class:`ChatFormat` for ``tokenizer`` under ``env_manager.chat_template``, or None (raw text)."""
    template = resolve_template(tokenizer, setting)
    if template is None:
        return None
    return ChatFormat(tokenizer, template, observation_role)
