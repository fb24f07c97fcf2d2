"""Requests, outputs and trajectories exchanged by EnvManagers, the LLMProxy and inference workers."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rollart.engines.base import SamplingParams
from rollart.rollout.cost import TrajectoryCost

FinishReason = Literal["stop", "length", "abort"]


class GenerateRequest(BaseModel):
    """One generation: a prompt in token ids and how to sample its continuation."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = Field(default_factory=SamplingParams)


class GenerateOutput(BaseModel):
    """What came back for a request. ``token_versions[i]`` is the policy version that produced token i
    (a suspended request resumed under new weights mixes versions); ``hardware``/``rank`` say where."""

    request_id: str
    output_token_ids: list[int] = Field(default_factory=list)
    output_logprobs: list[float] = Field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = Field(default_factory=list)  # sampling.top_logprobs > 0
    token_versions: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    hardware: str = ""
    rank: int = -1
    preempted: bool = False  # aborted by a suspend or weight update, not by its owner: to be continued

    def extend(self, more: GenerateOutput) -> GenerateOutput:
        """This output followed by the continuation ``more`` (after a suspend/resume)."""
        return GenerateOutput(
            request_id=self.request_id,
            output_token_ids=self.output_token_ids + more.output_token_ids,
            output_logprobs=self.output_logprobs + more.output_logprobs,
            output_top_logprobs=self.output_top_logprobs + more.output_top_logprobs,
            token_versions=self.token_versions + more.token_versions,
            finish_reason=more.finish_reason,
            hardware=more.hardware,
            rank=more.rank,
            preempted=more.preempted,
        )


class GenerateDelta(BaseModel):
    """Tokens a streamed request got before it finished (``InferenceWorker.generate_stream``,
    ``LLMProxy.generate_stream``): the reply's output positions ``start``, ``start + 1``, ... with their
    behaviour log-probs, top log-probs (when asked) and the policy version that produced them. The final
    :class:`GenerateOutput` of the stream holds every token again: the deltas are its prefix."""

    request_id: str
    start: int
    token_ids: list[int]
    logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = Field(default_factory=list)
    version: int = 0
    hardware: str = ""
    rank: int = -1


TrajectoryStatus = Literal["ok", "failed", "aborted", "reward_failed"]


class GroupId(NamedTuple):
    """One round of one env group: group ``env_group`` playing its ``round``-th seed. ``str()`` gives
    ``"g:r"``, the form stored in ``Trajectory.group_id`` and shown in logs and metrics."""

    env_group: int
    round: int

    def __str__(self) -> str:
        return f"{self.env_group}:{self.round}"


class RewardInputs(BaseModel):
    """What a reward service scores a trajectory on, as the env manager saw it (``Trajectory.scored_on``):
    the env's first observation before any chat template, the ground truth its reset reported, and its own
    account of the last answer (a step's ``response``, e.g. a dataset env's). Unset fields are read from
    the tokens (the first prompt, the last turn) by the reward step."""

    prompt: str | None = None
    ground_truth: Any = None
    response: str | None = None


class Trajectory(BaseModel):
    """One episode as the trainer sees it (RollArt paper §5.3, SAO §3).

    ``token_ids`` is the whole interaction (prompt, actions, observations) with ``loss_mask`` 1 on
    action tokens and 0 elsewhere; ``logprobs`` and ``versions`` hold the behaviour log-probability and
    the policy version of each action token (0.0 and -1 elsewhere). ``prompt_length`` is the length of
    the first prompt; ``turns`` the ``(start, end)`` spans of each action in ``token_ids``.
    """

    traj_id: str
    group_id: str
    tag: str
    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    versions: list[int] = Field(default_factory=list)
    prompt_length: int = 0
    turns: list[tuple[int, int]] = Field(default_factory=list)
    reward: float | None = None
    token_rewards: list[float] | None = None  # optional dense credit per token (0 off the actions)
    env_return: float = 0.0
    start_version: int = 0
    status: TrajectoryStatus = "ok"
    error: str | None = None
    hardware: list[str] = Field(default_factory=list)
    info: dict[str, Any] = Field(default_factory=dict)  # what the env reported (reset info, steps' info)
    scored_on: RewardInputs = Field(default_factory=RewardInputs)  # a reward service's inputs
    cost: TrajectoryCost = Field(default_factory=TrajectoryCost)  # the cost ledger (rollart.rollout.cost)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def min_version(self) -> int:
        """The oldest policy version that produced any action token (``start_version`` if none)."""
        vs = [v for v in self.versions if v >= 0]
        return min(vs) if vs else self.start_version


class TraceSink(Protocol):
    """Where the rollout sends trajectory events (``rollart.tracking.traces.TraceWriter``): ``wants`` says
    whether a trajectory is traced (sampled, and the file under its cap), ``emit`` records one event."""

    def wants(self, traj_id: str) -> bool: ...

    def emit(self, traj_id: str, event: str, /, t: float | None = None, **fields: Any) -> None: ...
