"""A tool-using agent written only against the ``openai`` SDK: it offers a calculator tool, runs the
calls the model makes, sends the results back and reads the model's final answer. Nothing in it knows
about rollart: pointed at any OpenAI-compatible server, it runs the same way. Its reward is 1 for the
right number, else 0."""

from __future__ import annotations

import json
import re

import openai

SYSTEM = "Solve it with calc."
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an expression of two whole numbers and + or -.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
MAX_TURNS = 3


def calc(expression: str) -> str:
    """The tool: ``A+B`` or ``A-B`` of whole numbers (never ``eval``)."""
    m = re.fullmatch(r"\s*(\d{1,6})\s*([+-])\s*(\d{1,6})\s*", expression)
    if m is None:
        return "error: write A+B or A-B"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b)


async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
    """Play one problem; the reward of the episode."""
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="calculator", messages=messages, tools=[CALC], max_tokens=80)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            answer = (message.content or "").strip()
            return 1.0 if answer == str(task["answer"]) else 0.0
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))
            except (ValueError, AttributeError):
                expression = ""
            result = calc(expression) if call.function.name == "calc" else f"error: no tool {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
