"""The endpoint's compatibility surface with the official clients: legacy ``logprobs: N`` and chat
``top_logprobs`` (checked against the model's own distribution), forced ``tool_choice``, the Responses
API (``/v1/responses``) and the Anthropic Messages API (``/v1/messages``), each recorded token-exactly
into the session's trajectory; and what stays unsupported answered 400 naming the field.

Two policies: the tiny Qwen2 model on the built-in torch engine (log-probs need a real distribution),
and the scripted engine of ``serving_fixtures`` (the test writes the reply into the conversation).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from serving_fixtures import TOOLS, ServedPolicy, build_merging_tokenizer

import rollart as ra
from rollart.engines.base import EngineRequest, SamplingParams
from rollart.engines.sampling import process_logits
from rollart.models import build_tiny
from rollart.rollout.inference_worker import inference_worker_class
from rollart.serving.render import _arguments_as_objects


def _served(tmp_path_factory, folder, engine, pool):
    rm = ra.ResourceManager({pool: {"hardware": "H20", "devices": 1}}, store=tmp_path_factory.mktemp("s") / "m.db")
    cluster = ra.Cluster(
        f"infer-{pool}", inference_worker_class({"*": ["H20"]}), rm, pool=pool, worker_kwargs={"engine": engine}
    )
    return rm, cluster, ServedPolicy(cluster, str(folder), serving={"max_n": 2})


@pytest.fixture(scope="module")
def tiny(ray_local, tmp_path_factory):
    folder = build_tiny(
        tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=1, intermediate_size=64, seed=4, chat=True
    )
    rm, cluster, policy = _served(
        tmp_path_factory, folder, {"kind": "torch", "model": str(folder), "options": {"device": "cpu"}}, "compat-tiny"
    )
    yield policy
    policy.close()
    cluster.shutdown()
    rm.shutdown()


@pytest.fixture(scope="module")
def scripted(ray_local, tmp_path_factory):
    folder = build_merging_tokenizer(tmp_path_factory.mktemp("tok"))
    rm, cluster, policy = _served(
        tmp_path_factory, folder, {"kind": "serving_fixtures:ScriptedEngine", "model": str(folder)}, "compat-scripted"
    )
    yield policy
    policy.close()
    cluster.shutdown()
    rm.shutdown()


@pytest.fixture(scope="module")
def model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny.model_path).eval()


def _distribution(model, ids: list[int], start: int) -> torch.Tensor:
    """The greedy-sampling distribution (log-softmax of the raw logits) of every position from ``start``."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return process_logits(logits[start - 1 : len(ids) - 1], SamplingParams(temperature=0))


# ---------------------------------------------------------------------- log-probs
def test_engine_top_logprobs_are_the_sampling_distributions_top_k(tiny, model):
    """The torch engine's top-k at temperature 0.7 / top-p 0.9 are the k largest log-probs of the very
    distribution the sampled token's log-prob is taken from; a request that asks none gets none."""
    from rollart.engines.torch_engine import TorchEngine

    engine = TorchEngine(tiny.model_path)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_new_tokens=5, top_logprobs=4)
    engine.add_request(EngineRequest("top", [5, 6, 7], params))
    engine.add_request(EngineRequest("plain", [5, 6, 7], params.model_copy(update={"top_logprobs": 0})))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    out = outs["top"]
    assert outs["plain"].output_top_logprobs == [] and len(out.output_top_logprobs) == len(out.output_token_ids)
    seq = [5, 6, 7, *out.output_token_ids]
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, 2:-1]
    for i, (tok, lp, top) in enumerate(zip(out.output_token_ids, out.output_logprobs, out.output_top_logprobs)):
        dist = process_logits(logits[i : i + 1], params)[0]
        values, ids = torch.topk(dist, 4)
        kept = [(int(t), float(v)) for t, v in zip(ids, values) if v > float("-inf")]
        assert [t for t, _ in top] == [t for t, _ in kept]
        assert [v for _, v in top] == pytest.approx([v for _, v in kept], abs=1e-4)
        assert lp == pytest.approx(float(dist[tok]), abs=1e-4)  # the sampled log-prob: the same distribution


def test_chat_top_logprobs_with_the_openai_client(tiny, model):
    session = tiny.open_session()
    client = tiny.client(session)
    messages = [{"role": "user", "content": "the cat sat"}]
    r = client.chat.completions.create(
        model="policy", messages=messages, logprobs=True, top_logprobs=3, temperature=0, max_tokens=6
    )
    call = session.calls[0]
    choice = call.choices[0]
    # token-exact: the prompt is the template's rendering, encoded; the reply the engine's ids
    renderer = tiny.endpoint.service.renderer
    assert call.prompt.token_ids == renderer.prompt(messages)
    traj = session.trajectory("t")
    assert traj.token_ids == call.prompt.token_ids + choice.token_ids
    assert traj.logprobs[len(call.prompt.token_ids) :] == choice.logprobs
    tok = tiny.endpoint.service.tokenizer
    special = set(tok.all_special_ids)
    content = [(i, t) for i, t in enumerate(choice.token_ids) if t not in special]
    entries = r.choices[0].logprobs.content
    assert len(entries) == len(content) > 0
    dist = _distribution(model, call.prompt.token_ids + choice.token_ids, len(call.prompt.token_ids))
    for entry, (i, t) in zip(entries, content):
        assert len(entry.top_logprobs) == 3
        # greedy: the most likely token is the sampled one, with the sampled token's log-prob
        assert entry.top_logprobs[0].token == entry.token == tok.decode([t])
        assert entry.top_logprobs[0].logprob == entry.logprob == choice.logprobs[i]
        values, ids = torch.topk(dist[i], 3)
        assert [a.token for a in entry.top_logprobs] == [tok.decode([int(x)]) for x in ids]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    # streamed: the same entries, chunk by chunk
    stream = client.chat.completions.create(
        model="policy", messages=messages, logprobs=True, top_logprobs=3, temperature=0, max_tokens=6, stream=True
    )
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, [a.token for a in e.top_logprobs]) for e in streamed] == [
        (e.token, [a.token for a in e.top_logprobs]) for e in entries
    ]
    # (the second call's prompt comes from the prefix cache: the same numbers up to float rounding)
    for got, want in zip(streamed, entries):
        assert [a.logprob for a in got.top_logprobs] == pytest.approx([a.logprob for a in want.top_logprobs], abs=1e-4)


def test_legacy_completions_logprobs_1_with_the_openai_client(tiny, model):
    session = tiny.open_session()
    client = tiny.client(session)
    r = client.completions.create(model="policy", prompt="the cat", logprobs=1, temperature=0, max_tokens=5)
    call = session.calls[0]
    choice = call.choices[0]
    tok = tiny.endpoint.service.tokenizer
    assert call.prompt.token_ids == tok.encode("the cat", add_special_tokens=False)  # token-exact
    assert session.trajectory("t").token_ids == call.prompt.token_ids + choice.token_ids
    lp = r.choices[0].logprobs
    special = set(tok.all_special_ids)
    content = [(i, t) for i, t in enumerate(choice.token_ids) if t not in special]
    assert lp.tokens == [tok.decode([t]) for _, t in content]
    assert lp.token_logprobs == [choice.logprobs[i] for i, _ in content]
    dist = _distribution(model, call.prompt.token_ids + choice.token_ids, len(call.prompt.token_ids))
    for top, token, value, (i, _) in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs, content):
        best = int(torch.argmax(dist[i]))
        # the top 1 (here the sampled token, greedy), keyed by its text, as OpenAI answers logprobs: 1
        assert top == {token: value} and tok.decode([best]) == token
        assert value == pytest.approx(float(dist[i, best]), abs=1e-4)


def test_top_logprobs_from_an_engine_that_has_none_is_refused(scripted):
    with pytest.raises(openai.BadRequestError, match="does not report top log-probabilities") as err:
        scripted.client().chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "SAY:x"}], logprobs=True, top_logprobs=2
        )
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        scripted.client().chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "SAY:x"}], top_logprobs=2
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("logit_bias", {"5": 1.0})],
)
def test_unsupported_fields_are_refused_naming_them(scripted, field, value):
    r = httpx.post(
        f"{scripted.endpoint.url}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "SAY:x"}], field: value},
        headers=scripted.headers,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


# ---------------------------------------------------------------------- forced tool choice
def test_forced_tool_choice_is_a_call_with_its_opening_as_prompt_tokens(scripted):
    session = scripted.open_session()
    client = scripted.client(session)
    tok = scripted.endpoint.service.tokenizer
    renderer = scripted.endpoint.service.renderer
    messages = [{"role": "user", "content": 'What is 12+7? SAY:{"expression": "12+7"}}</tool_call>'}]
    r = client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "calc"}}
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "calc"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"expression": "12+7"}
    call = session.calls[0]
    prefix = '<tool_call>{"name": "calc", "arguments": '
    # the forced opening is prompt (context) tokens after the generation prompt; the model wrote the rest
    head = renderer.prompt(messages, TOOLS)
    assert call.prompt.token_ids == head + tok.encode(prefix, add_special_tokens=False)
    reply = call.choices[0].token_ids
    assert reply == [*tok.encode('{"expression": "12+7"}}</tool_call>', add_special_tokens=False), tok.eos_token_id]
    # the whole is the template's rendering of the conversation with that call
    done = [*messages, {"role": "assistant", "content": "", "tool_calls": [msg.tool_calls[0].model_dump()]}]
    rendered = renderer.render(_arguments_as_objects(done), generation_prompt=False, tools=TOOLS)
    assert tok.decode(call.prompt.token_ids + reply, skip_special_tokens=False) == rendered.removesuffix("\n")

    messages += [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "19 SAY:It is 19."}]
    r2 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert r2.choices[0].message.content == "It is 19." and session.calls[1].parent == (0, 0)
    traj = session.trajectory("t")
    assert traj.token_ids == session.calls[1].prompt.token_ids + session.calls[1].choices[0].token_ids
    (s1, e1), (s2, e2) = traj.turns
    assert traj.token_ids[s1:e1] == reply and e1 - s1 == len(reply)
    assert traj.loss_mask[len(head) : s1] == [0] * (s1 - len(head))  # the forced opening does not train
    assert sum(traj.loss_mask) == (e1 - s1) + (e2 - s2)


def test_required_tool_choice_lets_the_model_name_the_tool(scripted):
    session = scripted.open_session()
    tools = [*TOOLS, {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    r = scripted.client(session).chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": 'SAY:search", "arguments": {"q": "x"}}</tool_call>'}],
        tools=tools,
        tool_choice="required",
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "search" and json.loads(call.function.arguments) == {"q": "x"}
    tok = scripted.endpoint.service.tokenizer
    assert session.calls[0].prompt.token_ids[-len(tok.encode('<tool_call>{"name": "', add_special_tokens=False)) :] == (
        tok.encode('<tool_call>{"name": "', add_special_tokens=False)
    )


def test_forcing_a_call_with_a_template_that_cannot_is_refused(scripted):
    from rollart.rollout.chat import ChatTemplateError
    from rollart.serving.render import CHATML_TOOLS_TEMPLATE, ChatRenderer

    # a template that opens an assistant turn with tool calls differently from its generation prompt
    odd = CHATML_TOOLS_TEMPLATE.replace(
        "<|im_start|>{{ m['role'] }}\n",
        "<|im_start|>{{ m['role'] }}{% if m['tool_calls'] is defined and m['tool_calls'] %} calls{% endif %}\n",
    )
    renderer = ChatRenderer(scripted.endpoint.service.tokenizer, odd)
    with pytest.raises(ChatTemplateError, match="tool_choice"):
        renderer.forced_call_prefix([{"role": "user", "content": "x"}], TOOLS, "calc")
    r = httpx.post(
        f"{scripted.endpoint.url}/v1/chat/completions",
        json={
            "model": "policy",
            "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        headers=scripted.headers,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice" and "nope" in r.text


# ---------------------------------------------------------------------- /v1/responses
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "calc",
        "description": "evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }
]
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "12+7"}}</tool_call>'


def _check_continued(session, n_calls: int) -> None:
    """Each call continued the one before: its prompt is the previous prompt + the reply's ids + new
    tokens, and the trajectory is the last prompt + its reply, the replies' ids training."""
    calls = session.calls
    assert len(calls) == n_calls and [c.parent for c in calls] == [None, *((i, 0) for i in range(n_calls - 1))]
    for prev, nxt in zip(calls, calls[1:]):
        head = prev.prompt.token_ids + prev.choices[0].token_ids
        assert nxt.prompt.token_ids[: len(head)] == head
    traj = session.trajectory("t")
    assert traj.token_ids == calls[-1].prompt.token_ids + calls[-1].choices[0].token_ids
    assert [traj.token_ids[s:e] for s, e in traj.turns] == [c.choices[0].token_ids for c in calls]
    assert sum(traj.loss_mask) == sum(len(c.choices[0].token_ids) for c in calls)


def test_responses_multi_turn_with_a_tool_via_previous_response_id(scripted):
    session = scripted.open_session()
    client = scripted.client(session)
    r1 = client.responses.create(
        model="policy", instructions="Use the calculator.", input=f"What is 12+7? SAY:{CALL}", tools=RESPONSES_TOOLS
    )
    [fc] = [item for item in r1.output if item.type == "function_call"]
    assert fc.name == "calc" and json.loads(fc.arguments) == {"expression": "12+7"} and r1.status == "completed"
    r2 = client.responses.create(
        model="policy",
        instructions="Use the calculator.",
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "19 SAY:SPLIT:It is 19"}],
        tools=RESPONSES_TOOLS,
    )
    assert r2.output_text == "It is 19"
    r3 = client.responses.create(
        model="policy",
        instructions="Use the calculator.",
        previous_response_id=r2.id,
        input="Thanks. SAY:ok done",
        tools=RESPONSES_TOOLS,
    )
    assert r3.output_text == "ok done" and r3.usage.output_tokens == len(session.calls[2].choices[0].token_ids)
    _check_continued(session, 3)
    # token-exact: the first prompt is the chat rendering of the same conversation
    renderer = scripted.endpoint.service.renderer
    first = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": f"What is 12+7? SAY:{CALL}"},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in RESPONSES_TOOLS]
    assert session.calls[0].prompt.token_ids == renderer.prompt(first, tools)


def test_responses_multi_turn_with_input_items(scripted):
    """The same conversation sent whole each time, the output items repeated as input items."""
    session = scripted.open_session()
    client = scripted.client(session)
    items: list = [{"role": "user", "content": [{"type": "input_text", "text": f"SAY:{CALL}"}]}]
    r1 = client.responses.create(model="policy", input=items, tools=RESPONSES_TOOLS)
    fc = r1.output[0]
    items += [o.model_dump(exclude_none=True) for o in r1.output]
    items.append({"type": "function_call_output", "call_id": fc.call_id, "output": "19 SAY:done"})
    r2 = client.responses.create(model="policy", input=items, tools=RESPONSES_TOOLS)
    assert r2.output_text == "done"
    _check_continued(session, 2)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):  # a response of another session
        scripted.client(scripted.open_session()).responses.create(
            model="policy", previous_response_id=r2.id, input="SAY:x"
        )
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        client.responses.create(model="policy", input="SAY:x", reasoning={"effort": "high"})


def test_responses_streamed(scripted):
    session = scripted.open_session()
    client = scripted.client(session)
    with client.responses.stream(model="policy", input=f"SAY:{CALL}", tools=RESPONSES_TOOLS) as stream:
        kinds = [e.type for e in stream]
        r1 = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    [fc] = r1.output
    assert fc.type == "function_call" and json.loads(fc.arguments) == {"expression": "12+7"}
    output = {"type": "function_call_output", "call_id": fc.call_id, "output": "19 SAY:SPLIT:It is 19"}
    with client.responses.stream(
        model="policy", previous_response_id=r1.id, input=[output], tools=RESPONSES_TOOLS
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        r2 = stream.get_final_response()
    # the text streams as it is decoded; with tools, a space waits for what follows it (a tool call's
    # surrounding whitespace is stripped from the content)
    assert "".join(deltas) == r2.output_text == "It is 19" and deltas == ["I", "t", " i", "s", " 1", "9"]
    _check_continued(session, 2)


# ---------------------------------------------------------------------- /v1/messages (Anthropic)
ANTHROPIC_TOOLS = [
    {
        "name": "calc",
        "description": "evaluate an arithmetic expression",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }
]


def _anthropic(policy, session=None, **kwargs):
    import anthropic

    base = f"{policy.endpoint.url}/sessions/{session.id}" if session is not None else policy.endpoint.url
    return anthropic.Anthropic(base_url=base, api_key=policy.endpoint.token, max_retries=0, **kwargs)


def test_anthropic_two_turn_tool_use(scripted):
    session = scripted.open_session()
    client = _anthropic(scripted, session)
    messages: list = [{"role": "user", "content": f"What is 12+7? SAY:{CALL}"}]
    m1 = client.messages.create(
        model="policy", max_tokens=64, system="Use the calculator.", messages=messages, tools=ANTHROPIC_TOOLS
    )
    assert m1.stop_reason == "tool_use"
    [use] = [b for b in m1.content if b.type == "tool_use"]
    assert use.name == "calc" and use.input == {"expression": "12+7"}
    messages += [
        {"role": "assistant", "content": m1.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "19 SAY:SPLIT:It is 19"}],
        },
    ]
    m2 = client.messages.create(
        model="policy", max_tokens=64, system="Use the calculator.", messages=messages, tools=ANTHROPIC_TOOLS
    )
    assert m2.stop_reason == "end_turn" and [b.text for b in m2.content] == ["It is 19"]
    assert m2.usage.output_tokens == len(session.calls[1].choices[0].token_ids)
    _check_continued(session, 2)
    renderer = scripted.endpoint.service.renderer
    first = [{"role": "system", "content": "Use the calculator."}, messages[0]]
    tools = [
        {
            "type": "function",
            "function": {**{k: v for k, v in t.items() if k != "input_schema"}, "parameters": t["input_schema"]},
        }
        for t in ANTHROPIC_TOOLS
    ]
    assert session.calls[0].prompt.token_ids == renderer.prompt(first, tools)  # token-exact


def test_anthropic_streaming_and_errors(scripted):
    session = scripted.open_session()
    client = _anthropic(scripted, session)
    with client.messages.stream(
        model="policy", max_tokens=64, messages=[{"role": "user", "content": "SAY:hello world"}]
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == "hello world" and final.stop_reason == "end_turn"
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)
    tok = scripted.endpoint.service.tokenizer
    assert session.calls[0].choices[0].token_ids == [
        *tok.encode("hello world", add_special_tokens=False),
        tok.eos_token_id,
    ]
    assert (
        session.trajectory("t").token_ids == session.calls[0].prompt.token_ids + session.calls[0].choices[0].token_ids
    )
    # a streamed tool call: a tool_use block whose input arrives as JSON deltas
    with client.messages.stream(
        model="policy", max_tokens=64, messages=[{"role": "user", "content": f"SAY:{CALL}"}], tools=ANTHROPIC_TOOLS
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"expression": "12+7"}

    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        client.messages.create(
            model="policy", max_tokens=8, extra_body={"top_k": 5}, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(
            model="policy",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}],
        )
    with pytest.raises(anthropic.AuthenticationError):
        _anthropic(scripted, session).with_options(api_key="wrong-token-0123456789").messages.create(
            model="policy", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )


# ---------------------------------------------------------------------- streaming, shown by a held reply
def _first_text_then_rest(protocol: str, policy, session, directive: str, max_tokens: int):
    """Open a stream of ``protocol`` and return (an iterator of its text pieces, a closer). The client's
    timeout is short: an endpoint that held the text back until the reply ended would block forever."""
    messages = [{"role": "user", "content": directive}]
    if protocol == "anthropic":
        client = _anthropic(policy, session, timeout=60)
        manager = client.messages.stream(model="policy", max_tokens=max_tokens, messages=messages)
        stream = manager.__enter__()
        return (e.delta.text for e in stream if e.type == "content_block_delta"), lambda: manager.__exit__(
            None, None, None
        )
    client = policy.client(session).with_options(timeout=60, max_retries=0)
    if protocol == "completions":
        stream = client.completions.create(model="policy", prompt=directive, max_tokens=max_tokens, stream=True)
        return (c.choices[0].text for c in stream if c.choices and c.choices[0].text), stream.close
    if protocol == "chat":
        stream = client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens, stream=True)
        return (c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content), stream.close
    stream = client.responses.create(model="policy", input=directive, max_output_tokens=max_tokens, stream=True)
    return (e.delta for e in stream if e.type == "response.output_text.delta"), stream.close


@pytest.mark.parametrize("protocol", ["completions", "chat", "responses", "anthropic"])
def test_a_streams_first_text_reaches_the_client_while_the_engine_still_holds_the_reply(scripted, protocol, tmp_path):
    """The scripted engine decodes one token, then holds the request until the test creates a file: the
    client has the first text of each protocol's stream while the worker's step records show the reply
    not yet ended (no timing), and the rest follows once the test lets the engine go on."""
    gate = tmp_path / "gate"
    session = scripted.open_session()
    pieces, close = _first_text_then_rest(protocol, scripted, session, f"SAY:GATE:{gate}", max_tokens=8)
    try:
        first = next(pieces)
        assert first == "a" and not session.calls  # the call is still running: nothing recorded yet
        # the worker's own step records: the request's first token was handed out, its end not decoded
        records = {k: v for per_worker in scripted.cluster.stream_records().result() for k, v in per_worker.items()}
        record = records[f"{session.id}:0:0"]
        assert record["first_step"] is not None and record["end_step"] is None
        gate.touch()
        rest = list(pieces)
    finally:
        close()
    assert first + "".join(rest) == "a" * 8
    [reply] = session.calls[0].choices
    tok = scripted.endpoint.service.tokenizer
    assert tok.decode(reply.token_ids) == "a" * 8
