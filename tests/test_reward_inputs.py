"""What a reward service scores is a typed record the env manager fills (``Trajectory.scored_on``): the
env's first prompt and ground truth from its reset, its own account of the last answer when it gives one,
else the text of the last turn's tokens."""

from __future__ import annotations

from typing import Any

from test_chat_template import ScriptedProxy, _bpe_tokenizer, _chars

from rollart.pipeline.rewards import service_reward
from rollart.rollout.env_manager import EnvManager, HFCodec
from rollart.rollout.types import RewardInputs


class QuizEnv:
    """Two turns; the reset names the ground truth, the last step reports the answer it took (or not)."""

    tag = "quiz"
    instructions = ""
    max_steps = 4
    max_new_tokens = 8

    def __init__(self, report: bool):
        self.report, self.t = report, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.t = 0
        return "2+2=", {"ground_truth": "4"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.t += 1
        info = {"response": action.strip()} if self.report and self.t == 2 else {}
        return "again", 0.0, self.t >= 2, False, info


class Service:
    url = "http://127.0.0.1:9/rewards/quiz"

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def score(self, item: dict[str, Any]) -> float:
        self.seen.append(item)
        return 1.0


async def test_the_reward_service_gets_the_recorded_prompt_truth_and_answer() -> None:
    tok = _bpe_tokenizer()
    codec = HFCodec(tok)
    for report, response in ((True, "4"), (False, "5")):
        service = Service()
        proxy = ScriptedProxy([(_chars(tok, "3"), "stop"), (_chars(tok, "5" if not report else "4"), "stop")])
        manager = EnvManager(QuizEnv(report), proxy, codec, reward_fn=service_reward(service, codec))  # type: ignore[arg-type]
        traj = await manager.run(seed=0)
        assert traj.status == "ok" and traj.reward == 1.0
        assert traj.scored_on == RewardInputs(prompt="2+2=", ground_truth="4", response="4" if report else None)
        # an env that reports no answer: the last turn's text is what is scored
        assert service.seen == [{"prompt": "2+2=", "response": response, "ground_truth": "4", "tag": "quiz"}]
