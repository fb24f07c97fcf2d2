"""A tool-using agent written only against the ``openai`` SDK: it offers a calculator tool, runs the
calls the model makes, sends the results back and reads the model's final answer. Nothing in it knows
about rollart: pointed at any OpenAI-compatible server, it runs the same way. Its reward is 1 for the
right number; 0.5 for a wrong answer when the calculator's last result was the right number (the right
operation on the right quantities, then a wrong copy); else 0. The calculator evaluates ``X+Y`` or
``X-Y`` where each side is a whole number or one of the question's named quantities (``a``, ``b``)."""

from __future__ import annotations

import json
import re

import openai

SYSTEM = "Solve it with calc."
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate X+Y or X-Y; X and Y are whole numbers or the question's quantities a and b.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
MAX_TURNS = 3


def calc(expression: str, values: dict[str, int]) -> str:
    """The tool: ``X+Y`` or ``X-Y``, each side a whole number or a named quantity (never ``eval``)."""
    m = re.fullmatch(r"\s*(\w{1,6})\s*([+-])\s*(\w{1,6})\s*", expression)

    def value(token: str) -> int | None:
        return int(token) if token.isdigit() else values.get(token)

    x, y = (value(m.group(1)), value(m.group(3))) if m else (None, None)
    if m is None or x is None or y is None:
        return "error: write X+Y or X-Y with numbers or " + ", ".join(sorted(values))
    return str(x + y if m.group(2) == "+" else x - y)


async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
    """Play one problem; the reward of the episode."""
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    last = ""  # the calculator's last result
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="calculator", messages=messages, tools=[CALC], max_tokens=64)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            answer = (message.content or "").strip()
            return score(answer, last, task)
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))
            except (ValueError, AttributeError):
                expression = ""
            if call.function.name == "calc":
                result = calc(expression, task["values"])
                last = result
            else:
                result = f"error: no tool {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return score("", last, task)


def score(answer: str, last: str, task: dict) -> float:
    """1 for the right number; 0.5 for a wrong answer whose last calculation gave the right number."""
    right = str(task["answer"])
    if answer == right:
        return 1.0
    return 0.5 if last == right else 0.0
