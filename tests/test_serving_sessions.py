"""Session bookkeeping and the tool-call parser, without a cluster: limits, chains, hostile text."""

from __future__ import annotations

import json

import pytest

from rollart.serving.sessions import CallRecord, ChoiceRecord, SessionClosed, SessionStore, TokenTrace
from rollart.serving.tools import hermes, tool_parser


def test_sessions_are_bounded_in_number_and_calls():
    store = SessionStore(max_sessions=2, ttl_s=60, max_calls=2)
    a = store.open("x")
    store.open("y")
    with pytest.raises(OverflowError, match="max_sessions"):
        store.open("z")
    a.new_call_index()
    a.new_call_index()
    with pytest.raises(SessionClosed, match="max_calls"):
        a.new_call_index()
    store.close(a.id, "done")
    with pytest.raises(SessionClosed, match="done"):
        a.new_call_index()
    assert store.get(a.id) is None and len(store) == 1
    assert len({store.open("w").id for _ in range(1)} | {a.id}) == 2  # ids are not reused


def test_idle_sessions_expire_but_not_while_a_call_runs():
    store = SessionStore(max_sessions=2, ttl_s=0.0)
    busy = store.open("b")
    busy.in_flight.add("r")  # a call of it is being generated
    idle = store.open("i")
    store.expire()
    assert store.get(busy.id) is busy and store.get(idle.id) is None and idle.ended == "expired"


def _call(index, key, prompt, reply, parent=None, started=0.0):
    trace = TokenTrace()
    trace.add_context(prompt)
    rec = CallRecord(index, "completion", key, trace, parent, started=started)
    rec.choices.append(ChoiceRecord(reply, [-0.5] * len(reply), [3] * len(reply), "stop", key="r"))
    return rec


def test_the_trajectory_is_the_chain_of_the_last_call():
    store = SessionStore()
    s = store.open("t")
    first = _call(0, "p", [1, 2], [7, 8])
    s.record(first)
    assert s.find_parent("completion", "prq") == (first, first.choices[0], 2)
    assert s.find_parent("completion", "pr") is None  # nothing new after the reply: not a continuation
    second = _call(1, "prq", [1, 2, 7, 8, 9], [5], parent=(0, 0), started=1.0)
    second.prompt.loss_mask[2:4] = [1, 1]
    second.prompt.turns = [(2, 4)]
    s.record(second)
    s.record(_call(2, "other", [4], [6], started=0.5))  # an earlier, separate chain
    traj = s.trajectory("t")
    assert traj.token_ids == [1, 2, 7, 8, 9, 5] and traj.turns == [(2, 4), (5, 6)]
    assert traj.info["chains"] == 2 and traj.info["calls_off_chain"] == 1 and traj.prompt_length == 2


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 5}</tool_call>',
        '<tool_call>{"name": "calc", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "calc"',
        "<tool_call>" + "[" * 5000 + "</tool_call>",
        "\x00\ufffd<tool_call></tool_call>",
    ],
)
def test_hermes_leaves_what_is_not_a_tool_call_as_text(text):
    content, calls = hermes(text)
    assert calls == [] and content == text


def test_hermes_reads_calls_and_keeps_the_rest():
    content, calls = hermes(
        'Let me. <tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    assert content == "Let me." and [c.name for c in calls] == ["calc", "b"]
    assert json.loads(calls[0].arguments) == {"x": 1} and calls[1].arguments == "{}"
    with pytest.raises(ValueError, match="tool_parser"):
        tool_parser("nonsense")


async def test_a_runs_seed_seeds_each_session_apart(tmp_path):
    """``sampling.seed`` is the run's: each session's calls get seeds of their own from it (members of a
    group playing the same task must not sample the same tokens); a request's own ``seed`` wins."""
    from rollart.engines.base import SamplingParams
    from rollart.models.tiny import build_tokenizer, default_corpus
    from rollart.rollout.types import GenerateOutput
    from rollart.serving.config import ServingConfig
    from rollart.serving.endpoint import build_service
    from rollart.serving.protocol import ChatCompletionRequest

    seen: list[int | None] = []

    class Recording:
        async def generate(self, request, tag, *, affinity=None):
            seen.append(request.sampling.seed)
            return GenerateOutput(
                request_id=request.request_id,
                output_token_ids=[40, 3],
                output_logprobs=[-1.0, -1.0],
                token_versions=[0, 0],
                finish_reason="stop",
            )

        async def abort(self, ids):
            return None

    tok = build_tokenizer(default_corpus(50), tmp_path, 320, chat=True)
    service = build_service(Recording(), tok, ServingConfig(), model="m", sampling=SamplingParams(seed=0))
    store = SessionStore()
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    for member in ("a", "b"):
        await service.chat(body, store.open("t", meta={"seed": f"0:{member}"}))
    await service.chat(body, None)
    await service.chat(body.model_copy(update={"seed": 7, "n": 2}), None)
    assert seen[0] != seen[1] and None not in seen[:2]
    assert seen[2] is None and seen[3:] == [7, 8]
