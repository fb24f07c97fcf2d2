"""Messages to token ids through the model's chat template, token-in/token-out across turns.

A first call is rendered with the template (and its ``tools``) and encoded. A later call of a session
whose history is an earlier call's messages plus the reply it got plus new messages is *continued*:
its prompt is that call's prompt tokens, the reply's tokens exactly as the engine generated them, then
the text the template puts after the reply (the end of the assistant turn, the new messages, the
generation prompt) encoded on its own (:meth:`ChatRenderer.continuation_ids`). The reply is never
re-encoded from its text, so a reply whose text re-tokenises differently (BPE merges across what the
model generated as two tokens, a byte sequence that decodes to a replacement character) trains on the
ids the model produced. The rule is the one of :mod:`rollart.rollout.chat`, for a list of messages.
"""

from __future__ import annotations

import json
from typing import Any

from rollart.rollout.chat import ChatFormat, ChatTemplateError, resolve_template

# ChatML with Hermes-style tools: the tool names and schemas in a system turn, an assistant's calls as
# <tool_call>{json}</tool_call>, tool results in a ``tool`` turn. For tokenizers with the ChatML special
# tokens (the tiny model built with chat=True) whose own template has no tools.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] if m['content'] is not none else '' }}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatRenderer(ChatFormat):
    """One tokenizer and its chat template, with tools."""

    def __init__(self, tokenizer: Any, template: str):
        super().__init__(tokenizer, template)
        probe = [{"role": "user", "content": "x"}]
        tool = [{"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": {}}}]
        self.renders_tools = self.render(probe, generation_prompt=True, tools=tool) != self.render(
            probe, generation_prompt=True
        )
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = [t for t in dict.fromkeys([eos, *self.stop_token_ids]) if t is not None]

    def render(  # type: ignore[override]
        self, messages: list[dict[str, Any]], *, generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        if not tools:
            return super().render(messages, generation_prompt=generation_prompt)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as err:
            raise ChatTemplateError(f"chat template: rendering with tools failed: {type(err).__name__}: {err}") from err
        return str(text)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A first call: the whole conversation rendered with the generation prompt, encoded."""
        return self.encode(self.render(_arguments_as_objects(messages), generation_prompt=True, tools=tools))

    def continuation_text(
        self, generated_ids: list[int], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The text after a reply whose tokens were ``generated_ids``: the rest of its assistant turn,
        ``messages`` as the template renders them after an assistant turn, the generation prompt."""
        closing = self._closing
        if self._turn_end_text and generated_ids and generated_ids[-1] == self.turn_end_id:
            closing = closing[len(self._turn_end_text) :]  # the model closed its turn itself
        base = self._base_rendering(tools)
        full = self.render([*self._base, *_arguments_as_objects(messages)], generation_prompt=True, tools=tools)
        if not full.startswith(base):
            raise ChatTemplateError(
                "chat template: adding messages re-renders the earlier ones differently, so a call cannot continue "
                "the session's tokens; use a template whose rendering of a conversation is a prefix of its "
                "rendering with more messages"
            )
        return closing + full[len(base) :]

    def _base_rendering(self, tools: list[dict[str, Any]] | None) -> str:
        """The rendering of the fixed conversation a continuation is cut from (kept, per tool set)."""
        if not tools:
            return self._base_text
        key = json.dumps(tools, sort_keys=True)
        cache: dict[str, str] = self.__dict__.setdefault("_base_with_tools", {})
        text = cache.get(key)
        if text is None:
            text = self.render(self._base, generation_prompt=False, tools=tools)
            if len(cache) >= 64:
                cache.pop(next(iter(cache)))
            cache[key] = text
        return text

    def continuation_ids(
        self, generated_ids: list[int], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.encode(self.continuation_text(generated_ids, messages, tools))

    def forced_call_prefix(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], name: str | None) -> str:
        """The opening of an assistant tool call, as the template renders one, that follows the
        generation prompt when a call is forced: up to the arguments of ``name`` (the model writes the
        arguments and the rest), or up to the function's name when ``name`` is None (the model picks the
        tool). Found by rendering a call with marker values; a template whose rendering of a tool call
        does not continue its generation prompt, or that does not write the name and arguments as
        given, cannot force a call exactly: :class:`ChatTemplateError`."""
        msgs = _arguments_as_objects(messages)
        head = self.render(msgs, generation_prompt=True, tools=tools)
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": name or _NAME_MARK, "arguments": {_ARGS_MARK: 0}},
        }
        full = self.render(
            [*msgs, {"role": "assistant", "content": "", "tool_calls": [call]}], generation_prompt=False, tools=tools
        )
        tail = full[len(head) :] if full.startswith(head) else ""
        if name is None:
            cut = tail.find(_NAME_MARK)
        else:
            marker = tail.find(_ARGS_MARK)
            cut = tail.rfind("{", 0, marker) if marker >= 0 else -1
            if cut >= 0 and name not in tail[:cut]:
                cut = -1
        if cut <= 0:
            raise ChatTemplateError(
                "tool_choice: this chat template does not render an assistant tool call as a continuation of its "
                "generation prompt with the name and arguments as given, so a call cannot be forced exactly; use "
                "tool_choice 'auto' (or a template that renders tool calls that way)"
            )
        return tail[:cut]


_NAME_MARK = "rollart_forced_name_0"
_ARGS_MARK = "rollart_forced_arguments_0"


def _arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments as objects (Hugging Face templates render them with ``tojson``), not the JSON
    text OpenAI messages carry; arguments that are not JSON stay text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_checked_call(c) for c in calls]}
        out.append(m)
    return out


def _checked_call(call: dict[str, Any]) -> dict[str, Any]:
    args: Any = call["function"].get("arguments") or "{}"
    try:
        args = json.loads(args)
    except (ValueError, TypeError, RecursionError):
        pass
    return {**call, "function": {**call["function"], "arguments": args}}


def chat_renderer(tokenizer: Any, setting: str = "auto") -> ChatRenderer:
    """The renderer of ``tokenizer`` under a template setting (``auto``: its own; a path or inline Jinja)."""
    template = resolve_template(tokenizer, setting)
    if template is None:
        raise ChatTemplateError(
            "the chat endpoint needs a chat template: the tokenizer has none; give one (a file or inline Jinja)"
        )
    return ChatRenderer(tokenizer, template)
