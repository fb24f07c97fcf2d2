"""``rollart serve policy``: the endpoint alone over a model folder (in two server processes), used with the
``openai`` client."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from security_fixtures import descendants

pytestmark = pytest.mark.timeout(600)


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise AssertionError("rollart serve policy printed no URL in time")
    return proc.stdout.readline().strip()


def test_serve_policy_serves_a_model_folder(tmp_path):
    from rollart.models.tiny import build_tiny

    model = build_tiny(tmp_path / "model", hidden_size=32, num_layers=1, intermediate_size=64, chat=True)
    env = {**os.environ, "POLICY_TOKEN": "a-token-of-the-test-0123", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollart.cli",
            "serve",
            "policy",
            str(model),
            "--port",
            "0",
            "--token-env",
            "POLICY_TOKEN",
            "--model-name",
            "tiny",
            "--processes",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        url = _first_line(proc, 420)
        assert url.startswith("http://127.0.0.1:")
        assert "bearer token: $POLICY_TOKEN" in proc.stdout.readline()
        urls = proc.stdout.readline().strip().removeprefix("2 processes: ").split(", ")
        assert len(urls) == 2 and urls[0] == url and urls[1] != url  # two server processes, a port each
        # the token left the environment before Ray started: neither the server nor its raylet, GCS and
        # inference workers hold it (what /proc/<pid>/environ shows)
        ray_processes = descendants(proc.pid)
        assert ray_processes, "no process below rollart serve policy: where is its Ray?"
        for pid in [proc.pid, *ray_processes]:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                assert b"a-token-of-the-test-0123" not in environ, (pid, Path(f"/proc/{pid}/cmdline").read_bytes())
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="a-token-of-the-test-0123", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "abc"}], max_tokens=6, seed=3, logprobs=True
        )
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
        again = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "abc"}], max_tokens=6, seed=3
        )
        assert again.choices[0].message.content == r.choices[0].message.content  # a seeded request repeats
        headers = {"Authorization": "Bearer a-token-of-the-test-0123"}
        opened = httpx.post(f"{url}/sessions", headers=headers).json()
        session = openai.OpenAI(base_url=opened["base_url"], api_key="a-token-of-the-test-0123", max_retries=0)
        session.completions.create(model="tiny", prompt="12+34=", max_tokens=4)
        shown = httpx.get(f"{url}/sessions/{opened['id']}", params={"trajectory": "true"}, headers=headers).json()
        assert shown["calls"] == 1 and sum(shown["trajectory"]["loss_mask"]) >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        second = openai.OpenAI(base_url=f"{urls[1]}/v1", api_key="a-token-of-the-test-0123", max_retries=0)
        assert second.completions.create(model="tiny", prompt="12+34=", max_tokens=4).usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, proc.stderr.read()[-3000:]


def test_serve_policy_refuses_what_it_cannot_serve(tmp_path):
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    res = subprocess.run(
        [sys.executable, "-m", "rollart.cli", "serve", "policy", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 2 and "export it first" in res.stderr
