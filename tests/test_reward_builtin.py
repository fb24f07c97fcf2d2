"""Built-in reward functions and the sandbox, on hand-checked cases."""


import pytest
from fastapi import FastAPI

from reward_fixtures import ThreadServer
from rollart.reward.builtin import code_tests, llm_judge, math_answer
from rollart.reward.sandbox import run_python


@pytest.mark.parametrize("response, truth, score", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("2 + 2 = 4", "4", 1.0),
    ("I think 41, no wait, 42", 42, 1.0),
    ("\\boxed{x+1}", "x+1", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("no number here", "4", 0.0),
    ("1,000 apples", "1000", 1.0),
])
def test_math_answer(response, truth, score):
    assert math_answer({"response": response, "ground_truth": truth}) == score


def test_sandbox_kills_an_infinite_loop_and_a_memory_hog_and_blocks_the_network():
    loop = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert loop.timed_out and not loop.ok
    hog = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", timeout_s=5, memory_mb=128)
    assert not hog.ok and "allocated" not in hog.stdout and "MemoryError" in hog.stderr
    net = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))", timeout_s=5)
    assert not net.ok and "PermissionError" in net.stderr
    ok = run_python("print(sum(int(x) for x in input().split()))", "2 3", timeout_s=5)
    assert ok.ok and ok.stdout.strip() == "5"


def test_code_tests_scores_the_fraction_of_passing_tests():
    gt = {"tests": [{"input": "2 3", "output": "5"}, {"input": "10 -1", "output": "9"}, {"input": "1 1", "output": "3"}]}
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
    monkeypatch.delenv("ROLLART_JUDGE_URL")
    with pytest.raises(ValueError, match="ROLLART_JUDGE_URL"):
        llm_judge({"prompt": "", "response": "", "ground_truth": ""})
