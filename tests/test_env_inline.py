"""Which env calls run on the rollout's event loop: the methods an env names as quick
(``TextEnv.inline_methods``); every other call runs in a worker thread, bounded by its timeout."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, ClassVar

import pytest
from rollout_fixtures import CharCodec

from rollart.data.config import DataTask
from rollart.data.prompts import load_prompts
from rollart.data.sampler import EpochSampler
from rollart.envs.base import TextEnv
from rollart.envs.code_sandbox import CodeSandboxEnv
from rollart.envs.dataset import DatasetEnv
from rollart.envs.faults import LatencyEnv
from rollart.envs.reverse import ReverseTask
from rollart.rollout import chat
from rollart.rollout.config import EnvManagerConfig
from rollart.rollout.env_manager import EnvManager, inline_methods
from rollart.rollout.types import GenerateOutput, GenerateRequest

pytestmark = pytest.mark.timeout(120)


class EchoProxy:
    """Answers every request with two tokens at once (no engine: the env calls are what is looked at)."""

    async def generate(self, request: GenerateRequest, tag: str, *, trace=None, cost=None) -> GenerateOutput:
        return GenerateOutput(
            request_id=request.request_id,
            output_token_ids=[3, 4],
            output_logprobs=[-0.1, -0.1],
            token_versions=[0, 0],
            finish_reason="stop",
        )

    async def abort(self, request_ids: list[str]) -> None:
        return None


class ThreadProbe(TextEnv):
    """Records the thread each of its calls ran on."""

    tag: ClassVar[str] = "probe"
    max_steps = 2

    def __init__(self) -> None:
        self.threads: list[tuple[str, int]] = []

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.threads.append(("reset", threading.get_ident()))
        return "abc", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.threads.append(("step", threading.get_ident()))
        return "d", 1.0, len(self.threads) >= 3, False, {}


class QuickProbe(ThreadProbe):
    inline_methods = frozenset({"reset", "step"})


async def _play(env: Any, **config: Any) -> Any:
    return await EnvManager(env, EchoProxy(), CharCodec(), config=EnvManagerConfig(**config)).run(seed=1)


async def test_a_quick_envs_calls_run_on_the_event_loop_and_the_others_in_a_thread():
    loop_thread = threading.get_ident()
    quick, other = QuickProbe(), ThreadProbe()
    assert (await _play(quick)).status == "ok" and (await _play(other)).status == "ok"
    assert [name for name, _ in quick.threads] == ["reset", "step", "step"]
    assert {t for _, t in quick.threads} == {loop_thread}
    assert len(other.threads) == 3 and loop_thread not in {t for _, t in other.threads}


def test_the_built_in_envs_say_which_of_their_calls_are_quick():
    assert inline_methods(ReverseTask()) == {"reset", "step"}
    # it runs the model's code in a sandbox: never on the event loop
    assert inline_methods(CodeSandboxEnv.__new__(CodeSandboxEnv)) == frozenset()
    assert inline_methods(ThreadProbe()) == frozenset()  # a user's env: threads unless it says otherwise


class GateClock:
    """A clock whose sleep waits until the test opens the gate (or the time passes)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.gate.wait(seconds)


async def test_a_wrapper_never_passes_on_its_inner_envs_quick_calls_and_its_timeout_still_holds():
    clock = GateClock()
    slow = LatencyEnv(ReverseTask(), step_latency=lambda: 60.0, clock=clock)
    assert slow.tag == ReverseTask().tag and inline_methods(slow) == frozenset()  # forwards attributes, not this one
    try:
        traj = await asyncio.wait_for(_play(slow, step_timeout_s=0.2, step_retries=0), timeout=30)
    finally:
        clock.gate.set()  # the sleeping worker thread ends
    assert traj.status == "failed" and "step" in traj.error and traj.reward is None


def _dataset_env(tmp_path: Any, **task: Any) -> DatasetEnv:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    prompts = load_prompts(DataTask(train=str(rows), **task), "data[0]")
    return DatasetEnv(prompts, EpochSampler(len(prompts), seed=0))


@pytest.mark.parametrize(
    ("task", "quick"),
    [
        ({}, {"reset", "step"}),  # exact_match
        ({"verifier": "number"}, {"reset", "step"}),
        ({"verifier": "rollart.data.verifiers:number"}, {"reset"}),  # named like a user's: not known quick
        ({"verifier": "rollart.data.verifiers:number", "inline_verifier": True}, {"reset", "step"}),
        ({"verifier": "number", "inline_verifier": False}, {"reset"}),
    ],
)
def test_a_dataset_task_scores_on_the_event_loop_only_with_a_verifier_known_to_be_quick(tmp_path, task, quick):
    assert inline_methods(_dataset_env(tmp_path, **task)) == quick


async def test_a_dataset_tasks_user_verifier_runs_in_a_thread(tmp_path):
    env = _dataset_env(tmp_path, verifier="rollart.data.verifiers:number")
    seen: list[int] = []
    score = env.prompts.score
    env.prompts.score = lambda completion, row: seen.append(threading.get_ident()) or score(completion, row)  # type: ignore[method-assign]
    traj = await _play(env)
    assert traj.status == "ok" and len(seen) == 1 and seen[0] != threading.get_ident()


def test_a_groups_shared_prompt_is_rendered_once_and_its_ids_are_the_callers_own(monkeypatch):
    rendered: list[list[dict[str, str]]] = []

    class Tokenizer:
        all_special_ids: ClassVar[list[int]] = []

        def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> str:
            rendered.append(messages)
            text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
            return text + ("<assistant>" if kw.get("add_generation_prompt") else "")

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, ids: list[int]) -> str:
            return "".join(map(chr, ids))

    fmt = chat.ChatFormat(Tokenizer(), "template")
    before = len(rendered)
    first = fmt.prompt_ids("abc", "sys")
    again = fmt.prompt_ids("abc", "sys")
    assert again == first and len(rendered) == before + 1  # the second member of the group: no render
    again.append(0)  # a caller extends its own list (the trajectory's tokens)
    assert fmt.prompt_ids("abc", "sys") == first
    assert fmt.prompt_ids("abc", None) != first and len(rendered) == before + 2  # the system prompt is in the key
    monkeypatch.setattr(chat, "PROMPT_CACHE", 2)
    for text in ("x", "y", "z"):
        fmt.prompt_ids(text)
    assert len(fmt._prompts) == 2 and ("z", None) in fmt._prompts  # bounded: the oldest go first
