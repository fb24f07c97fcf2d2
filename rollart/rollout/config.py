"""The rollout sections of a pipeline config (pydantic only): ``rollout:`` (:class:`RolloutConfig`),
``env_manager:`` (:class:`EnvManagerConfig`), ``routing:`` (:class:`RoutingConfig`), ``engine:``
(:class:`EngineConfig`) and ``elastic:`` (:class:`ElasticConfig`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rollart.config_model import ConfigModel
from rollart.engines.hardware import ModelShape
from rollart.engines.torch_options import torch_option_problems
from rollart.rollout.chat import check_template_setting


class RolloutConfig(ConfigModel):
    """``rollout:``: env groups, the training batch and the asynchronous bound."""

    num_env_groups: int = 8
    """Env groups playing at once (each plays one prompt `group_size` times); the tasks' `groups` add up to it."""
    group_size: int = 8
    """Trajectories per group (samples of one prompt)."""
    group_keep: int | None = None
    """Trajectories a group needs to complete (the rest are aborted: redundant rollouts); null: `group_size`."""
    batch_groups: int = 8
    """Groups per training batch (at most `num_env_groups`; more env groups than this are redundancy)."""
    alpha: int = 0
    """The asynchronous bound: a group begun under policy version v is trained on only while the current version
    is at most v + alpha; 0 is synchronous.
    """
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (no learning signal) and play more (dynamic filtering)."""
    max_round_failures: int = 3
    """A seed whose rounds fail this often is given up (and counted)."""
    requeue_reward_failures: bool = True
    """A failed reward replays its round; false: the trajectory alone is dropped (set from `reward.on_failure`)."""
    seed_offset: int = 0
    """Added to every env reset seed."""
    max_consecutive_failed_rounds: int = Field(default=50, ge=1)
    """Failed rounds in a row after which the rollout stops with the last error."""

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        keep = self.group_keep if self.group_keep is not None else self.group_size
        if not 1 <= keep <= self.group_size:
            raise ValueError(f"rollout.group_keep={keep} must be between 1 and group_size={self.group_size}")
        if self.batch_groups > self.num_env_groups:
            raise ValueError(
                f"rollout.batch_groups={self.batch_groups} exceeds num_env_groups={self.num_env_groups}; "
                "raise num_env_groups (more groups than the batch needs is redundancy) or lower batch_groups"
            )
        if self.alpha < 0:
            raise ValueError("rollout.alpha must be >= 0 (0 is synchronous training)")
        return self

    @property
    def keep(self) -> int:
        return self.group_keep if self.group_keep is not None else self.group_size


class EnvManagerConfig(ConfigModel):
    """Fault handling of one EnvManager."""

    reset_retries: int = 3
    """Retries of a failing env reset (with backoff)."""
    reset_backoff_s: float = 0.05
    """Backoff before the first reset retry, in seconds (doubles per retry)."""
    reset_timeout_s: float = 60.0
    """Timeout of one env reset, in seconds."""
    step_retries: int = 1
    """Retries of a failing env step before the trajectory ends as failed."""
    step_timeout_s: float = 60.0
    """Timeout of one env step, in seconds."""
    max_steps: int | None = None
    """Turns per episode; null: the env's own `max_steps`."""
    chat_template: str = "auto"
    """How prompts are written: `auto` (the tokenizer's chat template when it has one), `none` (the env's raw
    text), a Jinja file path or an inline Jinja template.
    """
    observation_role: Literal["user", "tool"] = "user"
    """The chat role of every observation after the first: `user` or `tool`."""
    max_prompt_length: int | None = Field(default=None, ge=1)
    """Bound on the first prompt, in tokens after rendering; null: no bound."""
    truncation: Literal["left", "error"] = "left"
    """A longer first prompt: keep its last `max_prompt_length` tokens (`left`), or fail the trajectory
    (`error`).
    """

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str) -> str:
        return check_template_setting(value)


class RoutingConfig(ConfigModel):
    """``routing:`` in a pipeline config. ``auto: true`` turns automatic affinity on."""

    auto: bool = False
    """Reorder each task tag's hardware preference (`tags:`) by its measured prompt and answer lengths against
    each hardware type's roofline; off: the static preference.
    """
    min_requests: int = Field(default=16, ge=1)
    """Finished requests of a tag before its preference is reordered."""
    batch: int = Field(default=32, ge=1)
    """The running sequences a decode step is assumed to share (for the rooflines)."""
    params: float = Field(default=ModelShape().params, gt=0)
    """Parameters of the served model, for the rooflines (default: Qwen3-8B)."""
    kv_bytes_per_token: float = Field(default=ModelShape().kv_bytes_per_token, gt=0)
    """KV-cache bytes per token of the served model, for the rooflines (default: Qwen3-8B in BF16)."""


def advised_rollout_devices(path: str) -> int:
    """The rollout devices ``rollart advise`` advised in its ``advise.json`` at ``path``."""
    import json
    from pathlib import Path

    try:
        advice = json.loads(Path(path).read_text())["advice"]
        devices = advice["rollout_devices"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{path} is not an advise.json of `rollart advise` ({type(err).__name__}: {err}); run "
            "`rollart advise CONFIG --out DIR` and give DIR/advise.json, or drop elastic.autoscale.advise"
        ) from None
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"{path}: advice.rollout_devices is {devices!r}, not a whole number of devices")
    return devices


class AutoscaleConfig(ConfigModel):
    """``elastic.autoscale:``: the autopilot, which sets the elastic rollout pool's size from the job's own
    steps (:mod:`rollart.rollout.autopilot`): it grows the pool while the trainer waits for rollout, shrinks it
    while generation is held back by the asynchronous bound, and gives devices back to a queued job."""

    grow_above: float = Field(default=0.2, gt=0, lt=1)
    """Grow when the trainer waited for rollout more than this share of every step of a window."""
    shrink_below: float = Field(default=0.05, ge=0, lt=1)
    """Shrink (one worker) when the wait was below this share of every step of a window and generation was held
    back by the asynchronous bound at each of them; below `grow_above` (the gap keeps the size from oscillating).
    """
    window: int = Field(default=3, ge=1)
    """Steps of evidence a change needs."""
    cooldown_steps: int = Field(default=2, ge=0)
    """Steps not measured after a change (workers join or drain meanwhile)."""
    yield_to_queued: bool = True
    """Give the pool back down to its smallest size while a job of the same or a higher priority queues for its
    devices, and grow back once the queue is empty."""
    advise: str | None = None
    """An `advise.json` that `rollart advise` wrote for this job: the pool starts at its advised rollout devices
    (within the pool's range) instead of the size the job started with; null: the starting size."""

    @field_validator("advise")
    @classmethod
    def _advice_readable(cls, value: str | None) -> str | None:
        if value is not None:
            advised_rollout_devices(value)  # a missing or foreign file is refused before anything starts
        return value

    @model_validator(mode="after")
    def _gap(self) -> AutoscaleConfig:
        if self.shrink_below >= self.grow_above:
            raise ValueError(
                f"elastic.autoscale.shrink_below ({self.shrink_below}) must be below grow_above ({self.grow_above}): "
                "the gap keeps the pool from oscillating"
            )
        return self


class ElasticConfig(ConfigModel):
    """``elastic:``: how an elastic rollout pool (a group with `max_devices`) follows the cluster while the
    job runs (:mod:`rollart.rollout.elastic`)."""

    poll_s: float = Field(default=1.0, gt=0)
    """How often the Ray cluster's nodes, free devices and drain marks are read, in seconds."""
    place_timeout_s: float = Field(default=10.0, gt=0)
    """How long a new worker's devices may take to be placed before the try is given up (the devices were taken
    meanwhile), in seconds.
    """
    join_timeout_s: float = Field(default=300.0, gt=0)
    """How long a new worker may take to start and load the served weights, in seconds."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """How long a leaving worker may finish its requests in flight; those still running then continue on other
    workers (their tokens so far kept), in seconds.
    """
    max_joining: int = Field(default=4, ge=1)
    """Workers started at the same time."""
    autoscale: AutoscaleConfig | None = None
    """The autopilot: the job sizes its elastic rollout pool from its own steps (`true` or its settings); null:
    the pool grows to `max_devices` whenever devices are free and shrinks only on `rollart scale`.
    """

    @field_validator("autoscale", mode="before")
    @classmethod
    def _autoscale_flag(cls, value: Any) -> Any:
        if value is True:
            return {}
        if value is False:
            return None
        return value


class EngineConfig(ConfigModel):
    """``kind`` is one of ``torch`` (default), ``vllm``, ``sglang``, ``simulated`` or ``module:Class``;
    ``model`` a Hugging Face folder (default: the built-in tiny model); ``options`` go to the engine;
    ``batch_requests`` sends each worker the requests of one event-loop turn as one call.
    The simulated engine's ``options.profile: auto`` takes the latency profile of the worker's own
    hardware (``rollart.engines.hardware``: H800, H20), so each rollout pool runs at its device's speed."""

    kind: str = "torch"
    """The inference engine: `torch`, `vllm`, `sglang`, `simulated`, or your own as `MODULE:CLASS`."""
    model: str | None = None
    """A Hugging Face model folder for the engine; default: the pipeline's `model` (else the built-in tiny
    model).
    """
    options: dict[str, Any] = Field(default_factory=dict)
    """Engine options, passed to the engine (torch: `max_batch_size`, `prefix_cache_tokens`, `max_prefill_tokens`,
    `kv_cache`, `cuda_graphs`, ... (the torch engine's options in the rollout docs, checked when the config is
    validated); vllm: `EngineArgs` fields; simulated: `profile`, ...).
    """
    batch_requests: bool = True
    """Send each inference worker the requests of one event-loop turn as one streaming call (batched ADD); false:
    one Ray call per request.
    """
    sleep_level: Literal[1, 2] = 2
    """Colocated mode (`pools.<rollout>: {colocate_with: <train>}`): what the engine gives back while the trainer
    steps: `1` its KV cache (vLLM's level 1 also moves its weights to host memory), `2` its KV cache and its
    weights (it takes the trainer's at wake-up). Ignored with separate pools.
    """
    plugin_paths: list[str] = Field(default_factory=list)
    """Filled by the config loader (not written by hand): the folders a `MODULE:CLASS` engine is looked up in on
    the inference workers (the config's folder, the working directory).
    """

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        from rollart.engines.kinds import engine_name_problem

        problem = engine_name_problem(kind)
        if problem is not None:
            raise ValueError(problem)
        return kind

    @model_validator(mode="after")
    def _torch_options(self) -> EngineConfig:
        if self.kind == "torch":
            problems = torch_option_problems(self.options)
            if problems:
                raise ValueError("\n".join(problems))  # validate_config lists them one by one
        return self
