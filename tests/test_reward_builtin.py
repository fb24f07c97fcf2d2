"""Built-in reward functions and the sandbox, on hand-checked cases."""

import os
import socket

import pytest
from fastapi import FastAPI
from reward_fixtures import ThreadServer

from rollart.reward import sandbox
from rollart.reward.builtin import code_tests, llm_judge, math_answer
from rollart.reward.errors import RewardInputError
from rollart.reward.sandbox import run_python


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("2 + 2 = 4", "4", 1.0),
        ("I think 41, no wait, 42", 42, 1.0),
        ("\\boxed{x+1}", "x+1", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("no number here", "4", 0.0),
        ("1,000 apples", "1000", 1.0),
    ],
)
def test_math_answer(response, truth, score):
    assert math_answer({"response": response, "ground_truth": truth}) == score


BWRAP = sandbox.isolation() == "bwrap"
needs_bwrap = pytest.mark.skipif(not BWRAP, reason="bubblewrap is not usable here (apt-get install bubblewrap)")


def _processes_of_uid(uid: int) -> list[int]:
    """Processes running as ``uid`` (a sandbox's own uid)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids:
            pids.append(int(pid))
    return pids


def test_sandbox_kills_an_infinite_loop_and_a_memory_hog_and_keeps_results_correct():
    loop = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert loop.out_of_time and not loop.ok  # its CPU time used: SIGXCPU, or killed at the wall clock
    hog = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", timeout_s=5, memory_mb=128)
    assert not hog.ok and "allocated" not in hog.stdout and "MemoryError" in hog.stderr
    ok = run_python("import heapq, json\nprint(sum(int(x) for x in input().split()))", "2 3", timeout_s=5)
    assert ok.ok and ok.stdout.strip() == "5", ok.stderr
    flood = run_python("while True:\n    print('x' * 1000)", timeout_s=2, max_output_bytes=10_000)
    assert not flood.ok and len(flood.stdout) == 10_000 and flood.output_truncated  # a pipe, closed at the cap


@needs_bwrap
def test_sandbox_kills_a_fork_bomb_and_every_process_it_started():
    bomb = "import os\nprint(os.getuid(), flush=True)\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    out = run_python(bomb, timeout_s=2)
    assert out.timed_out and not out.ok
    uid = int(out.stdout.splitlines()[0])
    assert uid != 0 and uid != os.getuid()  # the code ran as a uid of its own
    assert _processes_of_uid(uid) == []


@needs_bwrap
def test_sandbox_has_no_network_even_to_localhost():
    with socket.socket() as listener:  # a host port that is open: reachable from any unsandboxed process
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        net = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('reached')", timeout_s=5
        )
    assert not net.ok and "reached" not in net.stdout and "ConnectionRefusedError" in net.stderr
    assert net.isolation == "bwrap"


@needs_bwrap
def test_sandbox_cannot_write_outside_its_directory_nor_see_host_files(tmp_path):
    target = tmp_path / "written-by-sandbox"
    code = (
        f"import os\nopen('here.txt', 'w').write('ok')\nprint(os.path.exists({str(tmp_path)!r}))\n"
        f"open({str(target)!r}, 'w').write('pwned')"
    )
    out = run_python(code, timeout_s=5)
    assert not out.ok and out.stdout.strip() == "False" and not target.exists()
    assert ("FileNotFoundError" in out.stderr) or ("PermissionError" in out.stderr)
    home = run_python("import os\nprint(os.path.exists(os.path.expanduser('~root')), os.listdir('/'))", timeout_s=5)
    assert home.ok and "'work'" not in home.stdout and "'etc'" not in home.stdout


def test_code_tests_scores_the_fraction_of_passing_tests():
    gt = {
        "tests": [{"input": "2 3", "output": "5"}, {"input": "10 -1", "output": "9"}, {"input": "1 1", "output": "3"}]
    }
    out = code_tests({"response": "```python\na, b = map(int, input().split())\nprint(a + b)\n```", "ground_truth": gt})
    assert out["score"] == pytest.approx(2 / 3) and out["tests"] == ["ok", "ok", "wrong"]


def test_llm_judge_against_an_openai_compatible_endpoint(monkeypatch):
    fake = FastAPI()
    seen = {}

    @fake.post("/v1/chat/completions")
    async def chat(body: dict):
        seen["body"] = body
        return {"choices": [{"message": {"role": "assistant", "content": "Reasoning... Score: 7"}}]}

    with ThreadServer(fake) as srv:
        monkeypatch.setenv("ROLLART_JUDGE_URL", srv.url())
        out = llm_judge({"prompt": "2+2?", "response": "4", "ground_truth": "4"})
        assert out["score"] == pytest.approx(0.7)
        assert "Response: 4" in seen["body"]["messages"][0]["content"]
        with pytest.raises(RewardInputError, match="judge_url"):  # a request cannot pick the judge
            llm_judge({"prompt": "", "response": "", "ground_truth": "", "metadata": {"judge_url": srv.url()}})
    monkeypatch.delenv("ROLLART_JUDGE_URL")
    with pytest.raises(ValueError, match="ROLLART_JUDGE_URL"):
        llm_judge({"prompt": "", "response": "", "ground_truth": ""})
