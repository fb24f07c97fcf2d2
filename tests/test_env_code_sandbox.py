"""The code_sandbox env: a fix earns reward 1, a wrong edit less, the tests run without network and
within limits, and only solution.py is writable."""

from __future__ import annotations

import shutil
import socket

import pytest

from rollart.envs import make_env
from rollart.envs.code_sandbox import TASKS, CodeSandboxEnv
from rollart.reward import sandbox


def write(text: str) -> str:
    return f'<write file="solution.py">{text}</write><run/>'


def test_fix_gets_full_reward_wrong_edit_less() -> None:
    env = make_env("code_sandbox")
    assert isinstance(env, CodeSandboxEnv)
    seen = set()
    for seed in (0, 1, 5):
        obs, info = env.reset(seed)
        seen.add(info["task"])
        assert "solution.py" in obs and "test_solution.py" in obs
        _, r_buggy, done, _, step_info = env.step("<run/>")
        assert done is False and 0 <= r_buggy < 1 and step_info["passed"] < step_info["total"]
        _, r_wrong, done, _, _ = env.step(write("def broken(:\n"))
        assert r_wrong == 0.0 and done is False
        obs, r_fixed, done, truncated, _ = env.step(write(info["fixed"]))
        assert (r_fixed, done, truncated) == (1.0, True, False), obs
    assert seen == {t.name for t in TASKS}


def test_actions_format_and_readonly_tests() -> None:
    env = CodeSandboxEnv(max_steps=3)
    env.reset(0)
    obs, r, done, truncated, _ = env.step("I think the bug is in line 2")
    assert obs.startswith("invalid action") and r < 0 and not done and not truncated
    obs, r, _, _, _ = env.step('<write file="test_solution.py">def test_x():\n    pass\n</write><run/>')
    assert "only solution.py" in obs and r < 0
    obs, r, done, truncated, _ = env.step("<run/>")
    assert r < 1 and not done and truncated  # the third step reaches max_steps


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="network isolation needs bubblewrap")
def test_tests_run_without_network_and_within_limits() -> None:
    assert sandbox.isolation() == "bwrap"
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    env = CodeSandboxEnv(timeout_s=3, memory_mb=128)
    _, info = env.reset(1)
    task = next(t for t in TASKS if t.name == info["task"])
    net = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n" + task.fixed
    obs, r, done, _, _ = env.step(write(net))
    assert r == 0.0 and not done and "cannot import" in obs and "Connection" in obs
    server.close()  # listening (the kernel would complete a handshake): refused means unreachable
    obs, r, done, _, _ = env.step(write("while True:\n    pass\n"))
    assert r == 0.0 and "timed out" in obs
    obs, r, done, _, _ = env.step(write("x = bytearray(1 << 30)\n" + task.fixed))
    assert r == 0.0 and "MemoryError" in obs
