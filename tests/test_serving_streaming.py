"""Real streaming through the policy endpoint: the built-in torch engine on the tiny model, a real Ray
inference worker and LLMProxy, and the official ``openai`` and ``anthropic`` clients.

The real engine hands a streamed reply's tokens out step by step — shown from the worker's own step
records (``InferenceWorker.stream_records``), not from timing; the streamed text is the unstreamed
answer, and the recorded trajectory is token-exact and the same as the unstreamed call's. That the
client has the first text before the reply ends, for every protocol, is shown without timing in
``test_serving_compat.py`` (a scripted engine that holds the reply until the test lets it go on).
"""

from __future__ import annotations

import os

import httpx
import pytest
from serving_fixtures import ServedPolicy

import rollart as ra
from rollart.models import build_tiny
from rollart.rollout.inference_worker import inference_worker_class

os.environ.setdefault("OMP_NUM_THREADS", "1")

LONG = 256  # tokens a streamed reply runs for (the tiny model's context is 512)
PROMPT = "hello world "


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory):
    folder = build_tiny(tmp_path_factory.mktemp("tiny"), seed=3, chat=True)
    rm = ra.ResourceManager({"rollout": {"hardware": "H20", "devices": 1}}, store=tmp_path_factory.mktemp("s") / "m.db")
    cluster = ra.Cluster(
        "infer",
        inference_worker_class({"*": ["H20"]}),
        rm,
        pool="rollout",
        worker_kwargs={"engine": {"kind": "torch", "model": str(folder), "options": {"kv_cache": "static"}}},
    )
    policy = ServedPolicy(cluster, str(folder))
    yield policy
    policy.close()
    cluster.shutdown()
    rm.shutdown()


def _records(served) -> dict:
    out: dict = {}
    for per_worker in served.cluster.stream_records().result():
        out.update(per_worker)
    return out


def _trajectory(served, session) -> dict:
    r = httpx.get(f"{served.endpoint.url}/sessions/{session.id}", params={"trajectory": "true"}, headers=served.headers)
    assert r.status_code == 200
    return r.json()["trajectory"]


def test_the_first_chunk_arrives_before_the_engine_decodes_the_last_token(served):
    session = served.open_session()
    stream = served.client(session).completions.create(
        model="policy", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True
    )
    chunks = iter(stream)
    first = next(chunks)
    rest = list(chunks)
    record = _records(served)[f"{session.id}:0:0"]
    [reply] = session.calls[0].choices
    assert len(reply.token_ids) == LONG  # the reply ran its whole budget (the model never ended it)
    # the worker handed the reply's tokens out step by step, the last ones before the step that ended it
    assert record["first_step"] < record["last_step"] < record["end_step"]
    assert record["first_at"] < record["last_at"] < record["end_at"]
    assert record["tokens"] == LONG
    assert first.choices[0].text
    texts = [c.choices[0].text for c in [first, *rest] if c.choices]
    assert len([t for t in texts if t]) > LONG // 2  # the text came in many pieces, not in one at the end


def test_streamed_text_and_trajectory_equal_the_unstreamed_calls(served):
    """The same seeded sampled call, streamed and not, in two sessions: the same text, and the recorded
    calls and trajectories hold the same tokens, log-probs and versions — the engine's."""
    plain_session, stream_session = served.open_session(), served.open_session()
    kwargs = {"model": "policy", "prompt": PROMPT, "max_tokens": 96, "temperature": 1.0, "seed": 11}
    plain = served.client(plain_session).completions.create(**kwargs)
    chunks = list(served.client(stream_session).completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == plain.choices[0].text and len(streamed) > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    [a], [b] = plain_session.calls[0].choices, stream_session.calls[0].choices
    assert b.token_ids == a.token_ids and b.logprobs == a.logprobs and b.versions == a.versions
    tok = served.endpoint.service.tokenizer
    assert streamed == tok.decode(b.token_ids, skip_special_tokens=True)  # the text is the recorded tokens'
    ta, tb = _trajectory(served, plain_session), _trajectory(served, stream_session)
    for field in ("token_ids", "loss_mask", "logprobs", "versions"):
        assert tb[field] == ta[field], field
    prompt = stream_session.calls[0].prompt.token_ids
    assert tb["token_ids"] == prompt + b.token_ids and tb["logprobs"][len(prompt) :] == b.logprobs


def test_a_stream_continues_across_a_weight_update_with_exact_versions(served):
    """A weight update lands while a reply streams (it preempts the request, which continues under the new
    version from the tokens it has): the stream goes on, the text sent stays sent, and every recorded
    token carries the version that produced it."""
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(served.model_path).state_dict()
    version = served.proxy.version + 1
    session = served.open_session()
    stream = served.client(session).completions.create(
        model="policy", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True
    )
    chunks = iter(stream)
    texts = [next(chunks).choices[0].text]
    served.run(served.proxy.model_update(weights, version))  # the same weights: the greedy reply goes on alike
    texts += [c.choices[0].text for c in chunks if c.choices]
    [reply] = session.calls[0].choices
    tok = served.endpoint.service.tokenizer
    assert "".join(texts) == tok.decode(reply.token_ids, skip_special_tokens=True)
    assert len(reply.token_ids) == LONG
    switch = reply.versions.index(version)  # the update came mid-reply: older tokens, then the new version's
    assert switch > 0 and set(reply.versions[:switch]) == {version - 1} and set(reply.versions[switch:]) == {version}
    trajectory = _trajectory(served, session)
    assert trajectory["versions"][-LONG:] == reply.versions and trajectory["token_ids"][-LONG:] == reply.token_ids


def test_chat_stream_with_a_stop_sequence_sends_only_the_reply_before_it(served):
    """A stop sequence the model writes mid-reply: the text before it streams, nothing of it or after."""
    messages = [{"role": "user", "content": "hi"}]
    client = served.client()
    full = client.chat.completions.create(model="policy", messages=messages, max_tokens=64, temperature=0)
    text = full.choices[0].message.content
    assert len(text) > 12
    stop = text[8:11]  # three characters the greedy reply writes
    chunks = list(
        client.chat.completions.create(
            model="policy", messages=messages, max_tokens=64, temperature=0, stop=[stop], stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[: text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_anthropic_stream_events_arrive_as_the_reply_is_decoded(served):
    anthropic = pytest.importorskip("anthropic")
    session = served.open_session()
    client = anthropic.Anthropic(
        base_url=served.endpoint.session_url(session)[: -len("/v1")], api_key=served.endpoint.token
    )
    deltas, kinds = [], []
    events = client.messages.create(  # greedy: the reply is the long one the stop-sequence test reads too
        model="policy",
        max_tokens=LONG,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"temperature": 0},
    )
    for event in events:
        kinds.append(event.type)
        if event.type == "content_block_delta":
            deltas.append(event.delta.text)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    record = _records(served)[f"{session.id}:0:0"]
    [reply] = session.calls[0].choices
    tok = served.endpoint.service.tokenizer
    assert "".join(deltas) == tok.decode(reply.token_ids, skip_special_tokens=True)  # the recorded reply's text
    assert len(deltas) > 1
    if len(reply.token_ids) > 2:  # the reply ran over several steps: the worker handed its tokens out in them
        assert record["first_step"] < record["end_step"] and record["tokens"] == len(reply.token_ids)
