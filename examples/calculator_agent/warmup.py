"""The starting policy: rollart's tiny character-level model (built offline; two layers) with a ChatML
template that renders tools and ``<tool_call>`` / ``</tool_call>`` as one token each (as in Qwen's
vocabulary: a call is then 54 tokens, not 75), after a short supervised warm-up on transcripts of the
agent's format. Every token of a transcript costs time in the warm-up, in rollout and in training,
which is why the model is this small and the markers are single tokens.

The transcripts show the format — a ``<tool_call>`` to ``calc`` with the two quantities of the
question, then the tool's result as the answer — but their operator is a coin flip: the warm-up teaches
the tool-call format and copying (its loss counts the answer's one or two tokens once more on their
own, else the model learns the fifty tokens of the call long before it learns to copy), not which
operation the words ask for. Starting from it the model picks ``+`` about as often for ``gets ... more``
as for ``gives ... away``; reinforcement learning through the endpoint has to learn which one the words
ask for.

The transcripts are the exact token ids the endpoint gives the model (:class:`rollart.serving.render.ChatRenderer`
renders the prompt and continues it after each reply), so the warm-up and the served conversation agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path

from agent import CALC, SYSTEM, calc
from tasks import make_task

log = logging.getLogger("calculator_agent")

MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 384}
RECIPE = 4  # the warm-up's loss, data and tokens: a cached policy is rebuilt when they change
POOL = 2048  # distinct warm-up transcripts, rendered once
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # added to the character-level vocabulary
CALL = '<tool_call>{{"name": "calc", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def transcript(renderer, tok, task: dict, rng: random.Random) -> tuple[list[int], list[int], int]:
    """(ids, labels, where the answer's turn starts) of one episode with a coin-flip operator; labels
    -100 off the model's replies."""
    expression = f"a{rng.choice('+-')}b"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    prompt = renderer.prompt(messages, [CALC])
    reply1 = tok.encode(CALL.format(expression=expression), add_special_tokens=False) + [end]
    result = calc(expression, task["values"])
    tool = [{"role": "tool", "tool_call_id": "c", "content": result}]
    between = renderer.continuation_ids(reply1, tool, [CALC])
    reply2 = tok.encode(result, add_special_tokens=False) + [end]
    ids = prompt + reply1 + between + reply2
    labels = [-100] * len(prompt) + reply1 + [-100] * len(between) + reply2
    return ids, labels, len(prompt) + len(reply1) + len(between)


def copied(model, tok, renderer, n: int = 16) -> float:
    """Of ``n`` greedy second replies (after a tool result), the fraction that repeat the result."""
    import torch

    model.eval()
    hits = 0
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for i in range(n):
        task = make_task(7_000_000 + i)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
        reply1 = tok.encode(CALL.format(expression=task["expression"]), add_special_tokens=False) + [end]
        result = calc(task["expression"], task["values"])
        tool = [{"role": "tool", "tool_call_id": "c", "content": result}]
        ids = renderer.prompt(messages, [CALC]) + reply1 + renderer.continuation_ids(reply1, tool, [CALC])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        hits += tok.decode(out[0, len(ids) :], skip_special_tokens=True).strip() == result
    return hits / n


def warm_up(folder: Path, steps: int, batch: int, lr: float, seed: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollart.serving.render import ChatRenderer

    tok = AutoTokenizer.from_pretrained(str(folder))
    renderer = ChatRenderer(tok, tok.chat_template)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    # rendered once (rendering a batch takes about half as long as its training pass), then drawn from
    pool = [transcript(renderer, tok, make_task(10**9 + rng.randrange(10**9)), rng) for _ in range(POOL)]
    losses = []
    for step in range(steps):
        rows = rng.sample(pool, batch)
        width = max(len(row[0]) for row in rows)
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        weights = torch.zeros((2, batch, width))  # the tool call's tokens, the answer's tokens
        for i, (x, y, cut) in enumerate(rows):
            ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
            weights[0, i, :cut], weights[1, i, cut : len(y)] = 1.0, 1.0
            weights[:, i] *= labels[i] != -100
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
        ).view(batch, -1)
        # every reply token, plus the answer's tokens once more on their own: the answer's one or two
        # tokens would otherwise be lost among the tool call's fifty, and the model would learn the
        # format long before it learns to copy
        every, answer = weights.sum(0)[:, 1:], weights[1, :, 1:]
        loss = (nll * every).sum() / every.sum() + (nll * answer).sum() / answer.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 100 == 0 or step == steps - 1:
            log.info(
                "warm-up step %d: loss %.3f, tool results repeated %.2f", step, losses[-1], copied(model, tok, renderer)
            )
            model.train()
    model.save_pretrained(str(folder), safe_serialization=True)
    return losses


def build_policy(
    root: str | os.PathLike[str], steps: int = 200, batch: int = 32, lr: float = 3e-3, seed: int = 0
) -> Path:
    """The warmed-up model folder under ``root`` (built once per setting, then reused)."""
    from rollart.models.tiny import build_tiny
    from rollart.serving.render import CHATML_TOOLS_TEMPLATE

    key = hashlib.sha256(
        json.dumps([RECIPE, MODEL, steps, batch, lr, seed, CHATML_TOOLS_TEMPLATE]).encode()
    ).hexdigest()[:10]
    target = Path(root) / f"calculator-policy-{key}"
    if (target / "warmup.json").exists():
        return target
    log.info(
        "building the starting policy: %d supervised warm-up steps (a few minutes at most on a 2-core CPU; "
        "once: later runs reuse %s)",
        steps,
        target,
    )
    tmp = Path(root) / f"calculator-policy-{key}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    rng = random.Random(seed)
    corpus = []
    for i in range(2000):
        task = make_task(i)
        corpus.append(
            task["question"] + " " + CALL.format(expression=task["expression"]) + f" {task['answer']} error: write\n"
        )
    build_tiny(tmp, corpus=corpus, vocab_size=280, chat=True, seed=seed, max_position_embeddings=512, **MODEL)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp))
    tok.chat_template = CHATML_TOOLS_TEMPLATE  # ChatML that renders tools and tool calls
    tok.add_tokens(TOOL_TOKENS)
    tok.save_pretrained(str(tmp))
    model = AutoModelForCausalLM.from_pretrained(str(tmp))
    model.resize_token_embeddings(len(tok), mean_resizing=False)  # random like the rest: the model is untrained
    model.save_pretrained(str(tmp), safe_serialization=True)
    losses = warm_up(tmp, steps, batch, lr, rng.randrange(2**31))
    (tmp / "warmup.json").write_text(json.dumps({"steps": steps, "batch": batch, "lr": lr, "loss": losses}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target
