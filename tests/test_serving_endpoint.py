"""The OpenAI-compatible endpoint with the real ``openai`` client and with plain ``httpx``: chat, tools,
streaming, n > 1, logprobs, stop sequences, completions, errors; and the session recording that
trains: the trajectory holds exactly the ids and log-probs the engine produced, also where the reply's
text re-tokenises into other ids.

The engine is scripted (``serving_fixtures.ScriptedEngine``: the test writes the reply into the
conversation); the inference worker, the LLMProxy, the endpoint and the tokenizer are the real ones.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving_fixtures import TOOLS, ServedPolicy, build_merging_tokenizer, script_logprob

import rollart as ra
from rollart.rollout.inference_worker import inference_worker_class

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "12+7"}}</tool_call>'


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory):
    folder = build_merging_tokenizer(tmp_path_factory.mktemp("tok"))
    rm = ra.ResourceManager({"rollout": {"hardware": "H20", "devices": 1}}, store=tmp_path_factory.mktemp("s") / "m.db")
    cluster = ra.Cluster(
        "infer",
        inference_worker_class({"*": ["H20"]}),
        rm,
        pool="rollout",
        worker_kwargs={"engine": {"kind": "serving_fixtures:ScriptedEngine", "model": str(folder)}},
    )
    policy = ServedPolicy(cluster, str(folder), serving={"max_n": 4})
    yield policy
    policy.close()
    cluster.shutdown()
    rm.shutdown()


def test_models_lists_the_policy_and_its_version(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["policy"]
    assert models.data[0].model_extra["version"] == served.proxy.version == 0
    served.run(served.proxy.model_update({}, 2))  # the workers now serve weight version 2
    assert served.client().models.list().data[0].model_extra["version"] == 2
    session = served.open_session()
    r = served.client(session).chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:v"}])
    assert r.system_fingerprint == "rollart-v2" and set(session.calls[0].choices[0].versions) == {2}
    r = httpx.get(f"{served.endpoint.url}/v1/models", headers=served.headers)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "policy"


def test_chat_with_the_openai_client_records_the_engines_tokens(served):
    session = served.open_session()
    client = served.client(session)
    r = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "SAY:hello world"}], logprobs=True
    )
    choice = r.choices[0]
    assert choice.message.content == "hello world" and choice.finish_reason == "stop"
    call = session.calls[0]
    out = call.choices[0]
    tok = served.endpoint.service.tokenizer
    assert out.token_ids == [*tok.encode("hello world", add_special_tokens=False), tok.eos_token_id]
    positions = range(len(call.prompt.token_ids), len(call.prompt.token_ids) + len(out.token_ids))
    assert out.logprobs == [script_logprob(t, p) for t, p in zip(out.token_ids, positions)]
    # the logprobs answered are the engine's, for the content tokens (the closing special token left out)
    assert [c.logprob for c in choice.logprobs.content] == out.logprobs[:-1]
    assert r.usage.prompt_tokens == len(call.prompt.token_ids)
    assert r.usage.completion_tokens == len(out.token_ids)
    assert r.system_fingerprint == f"rollart-v{served.proxy.version}"


def test_multi_turn_tool_session_trains_on_exactly_what_the_engine_produced(served):
    """Three calls: a tool call, an answer generated character by character (its text re-tokenises into
    other, merged ids), a last turn. The trajectory is the engine's ids and log-probs, token-exact."""
    session = served.open_session()
    client = served.client(session)
    tok = served.endpoint.service.tokenizer
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": f"SAY:{CALL}"}]
    r1 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    msg = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "calc"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"expression": "12+7"}
    messages += [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "SAY:SPLIT:hello 19"}]
    r2 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert r2.choices[0].message.content == "hello 19"
    messages += [r2.choices[0].message, {"role": "user", "content": "SAY:ok done"}]
    r3 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert r3.choices[0].message.content == "ok done"

    c1, c2, c3 = session.calls
    assert (c2.parent, c3.parent) == ((0, 0), (1, 0))  # each call continued the one before
    # prefix reuse: every prompt is the previous prompt + the reply's ids + new tokens
    for prev, nxt in ((c1, c2), (c2, c3)):
        head = prev.prompt.token_ids + prev.choices[0].token_ids
        assert nxt.prompt.token_ids[: len(head)] == head
    split_ids = [i for ch in "hello 19" for i in tok.encode(ch, add_special_tokens=False)]
    assert c2.choices[0].token_ids == [*split_ids, tok.eos_token_id]
    assert tok.encode("hello 19", add_special_tokens=False) != split_ids  # the text re-tokenises differently

    traj = session.trajectory("t0")
    assert traj.token_ids == c3.prompt.token_ids + c3.choices[0].token_ids
    actions = [(s, e) for s, e in traj.turns]
    assert len(actions) == 3
    for (s, e), call in zip(actions, (c1, c2, c3)):
        assert traj.token_ids[s:e] == call.choices[0].token_ids
        assert traj.logprobs[s:e] == call.choices[0].logprobs
        assert traj.logprobs[s:e] == [script_logprob(t, p) for p, t in enumerate(traj.token_ids[s:e], start=s)]
        assert traj.loss_mask[s:e] == [1] * (e - s)
        assert traj.versions[s:e] == [served.proxy.version] * (e - s)
    assert sum(traj.loss_mask) == sum(e - s for s, e in actions)
    assert traj.prompt_length == len(c1.prompt.token_ids)
    # what a stateless server would train on (the history rendered and encoded again) is other ids
    renderer = served.endpoint.service.renderer
    history = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    rendered = renderer.prompt(history, TOOLS)
    assert rendered != c3.prompt.token_ids
    assert tok.decode(rendered) == tok.decode(c3.prompt.token_ids)  # the same text, other ids


def test_a_rewritten_history_starts_a_new_chain(served):
    session = served.open_session()
    client = served.client(session)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:first"}])
    # the harness edits the reply before sending the history back: nothing to continue
    msgs = [
        {"role": "user", "content": "SAY:first"},
        {"role": "assistant", "content": "edited"},
        {"role": "user", "content": "SAY:second"},
    ]
    client.chat.completions.create(model="policy", messages=msgs)
    assert session.calls[1].parent is None
    traj = session.trajectory("t")
    assert traj.info["chains"] == 2 and traj.info["calls_off_chain"] == 1
    assert traj.token_ids == session.calls[1].prompt.token_ids + session.calls[1].choices[0].token_ids


def test_streaming_sends_the_same_reply_in_chunks(served):
    session = served.open_session()
    client = served.client(session)
    plain = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:hello world 12"}])
    stream = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "SAY:hello world 12"}],
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content == "hello world 12"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    streamed_lps = [
        lp.logprob for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content
    ]
    assert streamed_lps == session.calls[1].choices[0].logprobs[:-1]
    # tool calls stream too
    calls = list(
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": f"SAY:{CALL}"}], tools=TOOLS, stream=True
        )
    )
    deltas = [tc for c in calls for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "calc" and calls[-1].choices[0].finish_reason == "tool_calls"


def test_n_choices_seed_and_stop(served):
    session = served.open_session()
    client = served.client(session)
    r = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "SAY:alpha STOP beta"}], n=3, stop=["STOP"], seed=7
    )
    assert len(r.choices) == 3 and {c.index for c in r.choices} == {0, 1, 2}
    assert all(c.message.content == "alpha " and c.finish_reason == "stop" for c in r.choices)
    call = session.calls[0]
    assert len(call.choices) == 3
    tok = served.endpoint.service.tokenizer
    kept = call.choices[0].token_ids
    assert "STOP" in tok.decode(kept) and "beta" not in tok.decode(kept)  # the stop sequence's tokens train
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in call.choices)
    # the next call continues choice 1 when the harness sends it back
    r2 = client.chat.completions.create(
        model="policy",
        messages=[
            {"role": "user", "content": "SAY:alpha STOP beta"},
            {"role": "assistant", "content": "alpha "},
            {"role": "user", "content": "SAY:more"},
        ],
    )
    assert r2.choices[0].message.content == "more" and session.calls[1].parent is not None


def test_completions_continue_the_session_tokens(served):
    session = served.open_session()
    client = served.client(session)
    r1 = client.completions.create(model="policy", prompt="SAY:SPLIT:hello", max_tokens=20)
    assert r1.choices[0].text == "hello"
    r2 = client.completions.create(model="policy", prompt="SAY:SPLIT:hello" + "hello" + "\nSAY:world", max_tokens=20)
    assert r2.choices[0].text == "world"
    c1, c2 = session.calls
    assert c2.parent == (0, 0)
    assert c2.prompt.token_ids[: len(c1.prompt.token_ids) + len(c1.choices[0].token_ids)] == (
        c1.prompt.token_ids + c1.choices[0].token_ids
    )
    # the length limit answers finish_reason length
    r3 = client.completions.create(model="policy", prompt="SAY:RAMBLE", max_tokens=5)
    assert r3.choices[0].finish_reason == "length" and r3.usage.completion_tokens == 5
    # token-id prompts are taken as they are
    ids = served.endpoint.service.tokenizer.encode("SAY:ok", add_special_tokens=False)
    assert client.completions.create(model="policy", prompt=ids, max_tokens=4).choices[0].text == "ok"


def test_reward_and_session_trajectory_over_http(served):
    session = served.open_session()
    served.client(session).chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:x"}])
    url = f"{served.endpoint.url}/sessions/{session.id}"
    assert httpx.post(f"{url}/reward", json={"reward": 0.75}, headers=served.headers).json()["reward"] == 0.75
    again = httpx.post(f"{url}/reward", json={"reward": 1.0}, headers=served.headers)
    assert again.status_code == 400 and again.json()["error"]["param"] == "reward"
    shown = httpx.get(url, params={"trajectory": "true"}, headers=served.headers).json()
    assert shown["reward"] == 0.75 and shown["calls"] == 1
    assert shown["trajectory"]["token_ids"] == session.trajectory("x").token_ids
    # an external harness opens its own session over HTTP
    opened = httpx.post(f"{served.endpoint.url}/sessions", json={"tag": "agent"}, headers=served.headers).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key=served.endpoint.token)
    assert (
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:hi"}])
        .choices[0]
        .message.content
        == "hi"
    )
    assert httpx.delete(f"{served.endpoint.url}/sessions/{opened['id']}", headers=served.headers).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:hi"}])


def test_errors_with_the_openai_client(served):
    session = served.open_session()
    msgs = [{"role": "user", "content": "SAY:x"}]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.endpoint.session_url(session), api_key="wrong").chat.completions.create(
            model="policy", messages=msgs
        )
    client = served.client(session, max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=msgs)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="policy", messages=msgs, temperature=5)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="policy", messages=msgs, logit_bias={"1": 5})
    assert bad.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="policy", messages=msgs, top_logprobs=3, logprobs=True)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="policy", messages=msgs, n=5)  # max_n 4
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model="policy", messages=msgs, max_tokens=100_000)
    assert long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(
            base_url=f"{served.endpoint.url}/sessions/nope/v1", api_key=served.endpoint.token, max_retries=0
        ).chat.completions.create(model="policy", messages=msgs)
    # calls in flight over max_concurrency: 429 with Retry-After (the client retries 429s; not here)
    service = served.endpoint.service

    async def saturate(n: int) -> None:
        service.in_flight += n

    served.run(saturate(service.max_concurrency))
    try:
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(model="policy", messages=msgs)
        assert limited.value.response.headers["retry-after"] == "1"
    finally:
        served.run(saturate(-service.max_concurrency))


@pytest.mark.parametrize(
    "body,status,param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"model": "policy"}).encode(), 422, "messages"),
        (json.dumps({"model": "policy", "messages": []}).encode(), 422, "messages"),
        (json.dumps({"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 422, None),
        (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}], "n": 0}).encode(), 422, "n"),
        (
            json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}).encode(),
            422,
            "max_tokens",
        ),
        (
            json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 9}).encode(),
            422,
            "stop",
        ),
        (
            json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}], "bogus": 1}).encode(),
            422,
            "bogus",
        ),
        (
            json.dumps(
                {"model": "policy", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}
            ).encode(),
            400,
            "tool_choice",
        ),
        (
            json.dumps({"model": "policy", "messages": [{"role": "assistant", "content": "x"}]}).encode(),
            400,
            "messages",
        ),
        (("[" * 10_000 + "]" * 10_000).encode(), 400, None),
    ],
)
def test_hostile_and_malformed_bodies_get_openai_error_objects(served, body, status, param):
    r = httpx.post(
        f"{served.endpoint.url}/v1/chat/completions",
        content=body,
        headers={**served.headers, "Content-Type": "application/json"},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


def test_httpx_requests_and_guards(served):
    url = served.endpoint.url
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "SAY:plain"}]},
        headers=served.headers,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == {"role": "assistant", "content": "plain"}
    no_token = httpx.post(f"{url}/v1/chat/completions", json={"model": "policy", "messages": []})
    assert no_token.status_code == 401 and no_token.headers["www-authenticate"] == "Bearer"
    assert no_token.json()["error"]["type"] == "authentication_error"  # before the body is looked at
    big = httpx.post(f"{url}/v1/completions", content=b"x" * (9 << 20), headers=served.headers)
    assert big.status_code == 413
    bad_ids = httpx.post(f"{url}/v1/completions", json={"model": "policy", "prompt": [10**9]}, headers=served.headers)
    assert bad_ids.status_code == 400 and bad_ids.json()["error"]["param"] == "prompt"
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "SAY:sse"}], "stream": True},
        headers=served.headers,
    ) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "sse"
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_a_sessions_calls_stay_on_the_worker_that_served_it(make_rm, tmp_path):
    """Two inference workers, load-balanced: plain calls spread over both; a session's calls all go to
    the worker of its first call (whose prefix cache may hold the earlier turns)."""
    folder = build_merging_tokenizer(tmp_path / "tok")
    rm = make_rm({"sticky": {"hardware": "H20", "devices": 2}})
    cluster = ra.Cluster(
        "infer",
        inference_worker_class({"*": ["H20"]}),
        rm,
        pool="sticky",
        worker_kwargs={"engine": {"kind": "serving_fixtures:ScriptedEngine", "model": str(folder)}},
    )
    served = ServedPolicy(cluster, str(folder), batch_requests=True)
    try:
        plain = served.client()
        for _ in range(4):
            plain.chat.completions.create(model="policy", messages=[{"role": "user", "content": "SAY:x"}])
        assert {m["rank"] for m in served.run(served.proxy.worker_metrics()) if m["requests"] > 0} == {0, 1}
        session = served.open_session()
        client = served.client(session)
        messages = [{"role": "user", "content": "SAY:one"}]
        for word in ("two", "three", "four"):
            r = client.chat.completions.create(model="policy", messages=messages)
            messages += [r.choices[0].message, {"role": "user", "content": f"SAY:{word}"}]
        ranks = [c.choices[0].rank for c in session.calls]
        assert len(ranks) == 3 and len(set(ranks)) == 1
    finally:
        served.close()
        cluster.shutdown()


def test_tools_n_and_logprobs_over_plain_httpx(served):
    """The same requests the openai client makes, as raw JSON: what a curl user or another SDK sees."""
    session = served.open_session()
    url = f"{served.endpoint.session_url(session)}/chat/completions"
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": f"SAY:{CALL}"}],
        "tools": TOOLS,
        "n": 2,
        "logprobs": True,
    }
    r = httpx.post(url, json=body, headers=served.headers).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for c in r["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"] == {"name": "calc", "arguments": '{"expression": "12+7"}'}
        entries = c["logprobs"]["content"]
        assert "".join(e["token"] for e in entries) == CALL
        assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in entries)
    assert r["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in session.calls[0].choices)
    echoed = {"role": "assistant", "content": None, "tool_calls": r["choices"][1]["message"]["tool_calls"]}
    follow = {
        "model": "policy",
        "tools": TOOLS,
        "messages": [*body["messages"], echoed, {"role": "tool", "tool_call_id": "x", "content": "SAY:19"}],
    }
    r2 = httpx.post(url, json=follow, headers=served.headers).json()
    assert r2["choices"][0]["message"]["content"] == "19"
    # it continued the first call (the two choices are the same reply here: either one's tokens)
    assert session.calls[1].parent[0] == 0
