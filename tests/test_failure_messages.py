"""Failures a user can act on: how ``rollart run`` ends when the episodes keep failing (one line naming
the cause, exit 1, not an internal traceback; ``-v`` adds the traceback), and what a chat call on a model
without a chat template is told. (An agent's own exceptions: tests/test_serving_agent.py.)"""

from __future__ import annotations

import argparse
import asyncio
import logging

import pytest
from transformers import AutoTokenizer

import rollart.cli.run as run_cli
from rollart.rollout.sample_buffer import RolloutError

CAUSE = "50 rounds in a row failed (rollout.max_consecutive_failed_rounds); most frequent failure: agent: KeyError: 'answer' at /work/agent.py:12 (296 times)"


class _FailingPipeline:
    rm = None

    def __init__(self) -> None:
        self.shut = False

    def run(self) -> list:
        raise RolloutError(CAUSE)

    def shutdown(self) -> None:
        self.shut = True


def _train(monkeypatch, tmp_path, caplog, verbose: bool) -> tuple[int, _FailingPipeline]:
    pipe = _FailingPipeline()
    monkeypatch.setattr(run_cli, "build_pipeline", lambda cfg, **kw: pipe)
    caplog.clear()
    caplog.set_level(logging.DEBUG if verbose else logging.INFO, logger="rollart.cli.run")
    args = argparse.Namespace(resume=False, json=False)
    return run_cli._train(args, object(), tmp_path), pipe


def test_a_run_whose_episodes_keep_failing_ends_with_one_line(monkeypatch, tmp_path, caplog):
    code, pipe = _train(monkeypatch, tmp_path, caplog, verbose=False)
    assert code == 1 and pipe.shut
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == [f"the run stopped: {CAUSE}"]
    assert not errors[0].exc_info  # no traceback
    code, _ = _train(monkeypatch, tmp_path, caplog, verbose=True)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert code == 1 and errors[0].exc_info  # -v: the traceback too


def test_chat_on_a_model_without_a_chat_template_names_the_fix(caplog):
    from rollart.models import default_tiny_path
    from rollart.serving.config import ServingConfig
    from rollart.serving.endpoint import build_service
    from rollart.serving.protocol import ChatCompletionRequest
    from rollart.serving.service import APIError

    caplog.set_level(logging.WARNING, logger="rollart.serving.endpoint")
    tokenizer = AutoTokenizer.from_pretrained(str(default_tiny_path()))  # the built-in model: no template
    service = build_service(object(), tokenizer, ServingConfig(), model="tiny")  # type: ignore[arg-type]
    assert "tiny_model: {chat: true}" in caplog.text  # said at start-up
    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(APIError) as info:
        asyncio.run(service.chat(body, None))
    assert info.value.status == 400 and "serving.chat_template" in str(info.value)
    assert "tiny_model: {chat: true}" in str(info.value)
    chat_tokenizer = AutoTokenizer.from_pretrained(str(default_tiny_path(chat=True)))
    assert chat_tokenizer.chat_template  # the fix it names


def test_an_agent_calling_chat_on_a_model_without_a_template_is_refused_before_anything_starts(tmp_path):
    from rollart.config import ConfigError, validate_config
    from rollart.models import default_tiny_path

    (tmp_path / "chat_agent.py").write_text(
        "async def solve(client, task):\n"
        "    r = await client.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'hi'}])\n"
        "    return 1.0\n"
    )
    (tmp_path / "text_agent.py").write_text(
        "async def solve(client, task):\n    await client.completions.create(model='m', prompt='hi')\n    return 1.0\n"
    )
    base = {
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
        "rollout": {"num_env_groups": 1, "group_size": 2, "batch_groups": 1},
    }

    def check(agent: str, **over):
        return validate_config({**base, "envs": [{"agent": agent}], **over}, source=tmp_path / "c.yaml")

    with pytest.raises(ConfigError) as err:
        check("chat_agent:solve")
    assert "the agent 'chat_agent:solve' calls chat.completions but the built-in tiny model has no chat template" in (
        str(err.value)
    )
    assert "tiny_model: {chat: true}" in str(err.value) and "serving.chat_template" in str(err.value)
    check("chat_agent:solve", tiny_model={"chat": True})  # the fixes it names pass
    check("chat_agent:solve", serving={"chat_template": "{{ messages[0]['content'] }}"})
    check("text_agent:solve")  # completions need no template
    with pytest.raises(ConfigError, match=r"but the model .* has no chat template"):
        check("chat_agent:solve", model=str(default_tiny_path()))  # a folder whose tokenizer has none
    check("chat_agent:solve", model=str(default_tiny_path(chat=True)))
