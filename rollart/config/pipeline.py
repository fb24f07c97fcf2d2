"""The pipeline config: the YAML file ``rollart run`` takes, composed of the sections of the packages that
own them, and the checks of its tasks against the envs and data it names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rollart.cluster.config import FaultConfig
from rollart.config.checks import _check_tracking, cross_field_problems
from rollart.config.colocation import DEFAULT_ROLLOUT_POOL, DEFAULT_TRAIN_POOL, colocated_pools
from rollart.config.sections import (
    ClusterConfig,
    EnvEntry,
    ExportConfig,
    RewardConfig,
    StopAtConfig,
    TaskConfig,
    TracesConfig,
    TrackerName,
    WeightsConfig,
)
from rollart.config_model import ConfigModel
from rollart.data.config import DataTask, EvalConfig
from rollart.engines.base import SamplingParams
from rollart.plugins import checked as _plain
from rollart.resource_manager.specs import parse_pools
from rollart.rollout.config import ElasticConfig, EngineConfig, EnvManagerConfig, RolloutConfig, RoutingConfig
from rollart.serving.config import ServingConfig
from rollart.training.config import CriticConfig, RunningMeanConfig, TrainConfig


def _import_plugin(module: str) -> str:
    """A module of ``plugins:``: loaded by the plug-in step (:func:`~rollart.config.plugin_step.load_plugins`,
    which ``validate_config`` runs first); here a failed one is reported, and one not loaded yet (a config
    built in code, ``PipelineConfig.model_validate``) is imported."""
    import sys

    from rollart.plugins import FAILED_IMPORTS, import_module

    if module in FAILED_IMPORTS:
        raise ValueError(FAILED_IMPORTS[module])
    if module not in sys.modules:
        _plain(import_module, module, "plugins")
    return module


class PipelineConfig(ConfigModel):
    """A pipeline config: the YAML file ``rollart run`` takes."""

    # declared first: fields are validated in order, so the names a plug-in module registers are known
    # to the fields below
    plugins: list[Annotated[str, AfterValidator(_import_plugin)]] = Field(default_factory=list)
    """Your modules, imported first (from the config's folder, the working directory or the installed packages):
    the names they register (`@register_env`, `@register_loss`, `@register_loss_agg`, `@register_advantage`)
    are usable below.
    """
    pipeline: str | None = None
    """The pipeline class as `MODULE:CLASS` (a subclass of `AgenticPipeline`, or any class with its entry
    points); null: `AgenticPipeline`.
    """
    name: str = "rollart"
    """The run's name: the default `output_dir` is `runs/{name}`, and it names the job when `cluster.job_id` is
    unset.
    """
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Where Ray comes from and the job's identity."""
    pools: dict[str, Any]
    """Resource pools by name: `{hardware: H800, devices: 2}`, a list of such groups, or `{hardware: CPU, cpus:
    8}`; the same dicts `ResourceManager` takes. `{colocate_with: <train pool>}` as the rollout pool: colocated
    mode, the trainer and the engine take turns on the train pool's devices (docs: GPUs, "Colocated mode").
    """
    train_pool: str = DEFAULT_TRAIN_POOL
    """The pool the trainer (and its reference and critic) runs on."""
    rollout_pool: str = DEFAULT_ROLLOUT_POOL
    """The pool the inference workers run on (in colocated mode: the train pool's workers, which hold an engine)."""
    tags: dict[str, list[str]] = Field(default_factory=lambda: {"*": list[str]()})
    """Each task tag's hardware preference, in order (the inference workers' `@hw_mapping`); `*` is every other
    tag.
    """
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    """Automatic hardware affinity: reorder `tags:` by each task's measured shape."""
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    """How an elastic rollout pool (a group of `pools.ROLLOUT` with `max_devices`) grows and shrinks while the
    job runs.
    """
    model: str | None = None
    """The policy to train: a local Hugging Face folder (with a `config.json`), a model name the offline
    Hugging Face cache holds, or `{shape: qwen2.5-0.5b}` (a published architecture with random weights,
    `rollart.models.shapes`; validated into its folder); null: the built-in tiny model.
    """
    tiny_model: dict[str, Any] = Field(default_factory=dict)
    """Size of the built-in tiny model (`hidden_size`, `num_layers`, `num_heads`, `num_kv_heads`,
    `intermediate_size`) when `model` is null.
    """
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The inference engine."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """How the actor is trained."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Groups, batch and the asynchronous bound of the rollout."""
    env_manager: EnvManagerConfig = Field(default_factory=EnvManagerConfig)
    """Env fault handling and prompt rendering (chat template, truncation)."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Generation settings of every request (per task: `tasks.TAG.sampling`)."""
    envs: list[EnvEntry] = Field(default_factory=list)
    """The env tasks of the job (one entry per task)."""
    data: list[DataTask] = Field(default_factory=list)
    """Tasks from prompt datasets (one, or a list)."""
    eval: EvalConfig | None = None
    """Held-out evaluation every `eval.every` steps; null: none."""
    reward: RewardConfig | None = None
    """Score trajectories with a reward service instead of the env's own reward; null: the env's reward."""
    tasks: dict[str, TaskConfig] = Field(default_factory=dict)
    """Per task tag: its share of every batch, its reward service and its generation settings."""
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    """How new weights reach the inference workers."""
    serving: ServingConfig = Field(default_factory=ServingConfig)
    """The OpenAI-compatible policy endpoint that `agent` envs play through (and `rollart serve policy` serves)."""
    fault: FaultConfig = Field(default_factory=FaultConfig)
    """Restart policy per role."""
    advantage: str = "grpo"
    """The advantage estimator: `grpo`, `grpo_token`, `reinforce`, `running_mean`, `gae` (needs `critic:`), a
    name registered with `@register_advantage`, or `MODULE:FUNC`.
    """
    advantage_params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a registered or `MODULE:FUNC` estimator (checked against its signature)."""
    critic: CriticConfig | None = None
    """A value model trained K times per actor step (for `advantage: gae`); null: none."""
    running_mean: RunningMeanConfig = Field(default_factory=RunningMeanConfig)
    """The baseline of `advantage: running_mean`."""
    steps: int = Field(default=20, ge=1)
    """Training steps of the run (the most it takes; see `stop_at`)."""
    stop_at: StopAtConfig = Field(default_factory=StopAtConfig)
    """End the run before `steps` once the reward reached a target (`stop_at.reward_mean`); off by default."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every this many steps (`RUN_DIR/checkpoint/step-N`); 0: none."""
    checkpoint_keep: int = Field(default=1, ge=1)
    """Checkpoint folders kept (the newest K; older ones are deleted)."""
    record_batches: bool = False
    """Record every training batch losslessly in `RUN_DIR/batches/` (one file per step, written off the step
    loop) so `rollart replay RUN_DIR --to STEP` can train the same data again; about 20 bytes per token of the
    batch and 150 per row (the quickstart: 75 KB per step). Off by default.
    """
    history_keep: int = Field(default=1000, ge=1)
    """Step records the driver keeps in memory (what `run()` returns); `metrics.jsonl` and the plot have every
    step.
    """
    export: ExportConfig = Field(default_factory=ExportConfig)
    """What a finished run exports."""
    output_dir: str = "runs/{name}"
    """The run folder (`RUN_DIR`): metrics, checkpoints, the export; `{name}` is replaced by `name`. Relative to
    the working directory; a submitted job's is resolved on the cluster (see Sharing a cluster).
    """
    seed: int = 0
    """The run's seed: the prompt order of data tasks and the env seeds."""
    tracking: list[TrackerName] = Field(default_factory=lambda: list[TrackerName](["jsonl"]))
    """Experiment trackers: `jsonl` (always written), `tensorboard`, `wandb` (offline), `mlflow` (file store);
    each but jsonl is an extra of the same name.
    """
    traces: TracesConfig = Field(default_factory=TracesConfig)
    """Trajectory traces: `RUN_DIR/traces.jsonl`, read by `rollart trace RUN_DIR`."""

    @model_validator(mode="before")
    @classmethod
    def _plugins_to_train(cls, data: Any, info: ValidationInfo) -> Any:
        """The training workers import the same plug-in modules from the same folders (``TrainConfig``'s
        ``plugins`` / ``plugin_paths``): the config's folder (``load_config`` passes it) and the cwd. The
        inference workers look up a ``MODULE:CLASS`` engine there too (``EngineConfig.plugin_paths``)."""
        from rollart.plugins import add_search_path

        # from here on (and after), modules next to the config import in this process
        folders = add_search_path([f for f in ((info.context or {}).get("config_dir"), ".") if f])
        if isinstance(data, dict) and isinstance(data.get("train", {}), dict):
            plugins = data.get("plugins") or []
            data = {**data, "train": {"plugins": plugins if isinstance(plugins, list) else [], **data.get("train", {})}}
            data["train"].setdefault("plugin_paths", folders)
        if isinstance(data, dict) and isinstance(data.get("engine", {}), dict):  # a MODULE:CLASS engine, likewise
            data = {**data, "engine": {"plugin_paths": folders, **data.get("engine", {})}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _colocated_weights_inprocess(cls, data: Any) -> Any:
        """Colocated mode moves the weights in-process: ``weights.channel`` defaults to ``inprocess`` there."""
        if isinstance(data, dict) and colocated_pools(data) and isinstance(data.get("weights", {}), dict):
            data = {**data, "weights": {"channel": "inprocess", **data.get("weights", {})}}
        return data

    @field_validator("model", mode="before")
    @classmethod
    def _model_shape(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        from rollart.models.shapes import SHAPES, ShapeConfig, shape_folder, unknown_shape

        known = ", ".join(sorted(SHAPES))
        if "shape" not in value:
            raise ValueError(f"model.shape: required (model: {{shape: NAME}}); the known shapes are {known}")
        if value["shape"] not in SHAPES:
            raise ValueError(f"model.shape: {unknown_shape(str(value['shape']))}")
        extra = sorted(set(value) - set(ShapeConfig.model_fields))
        if extra:
            raise ValueError(
                f"model.{extra[0]}: unknown key; model: {{...}} takes {', '.join(ShapeConfig.model_fields)}"
            )
        try:
            spec = ShapeConfig.model_validate(dict(value))
        except ValidationError as err:
            first = err.errors()[0]
            raise ValueError(f"model.{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None
        return str(shape_folder(spec))

    @field_validator("pipeline")
    @classmethod
    def _pipeline_class(cls, spec: str | None) -> str | None:
        if spec is not None:
            from rollart.plugins import check_pipeline_class, import_object

            _plain(check_pipeline_class, _plain(import_object, spec, "pipeline"), "pipeline")
        return spec

    @field_validator("advantage")
    @classmethod
    def _advantage_exists(cls, name: str) -> str:
        from rollart.algorithms.advantages import advantage_contract_problems

        _plain(advantage_contract_problems, name)
        return name

    @field_validator("advantage_params")
    @classmethod
    def _advantage_params_fit(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "advantage" in info.data:
            from rollart.algorithms.advantages import advantage_params_problems

            _plain(
                advantage_params_problems,
                info.data["advantage"],
                params,
                prefix=f"advantage {info.data['advantage']!r}: ",
            )
        return params

    def pipeline_class(self) -> type[Any] | None:
        """The class of ``pipeline:`` (checked against :class:`rollart.plugins.PipelineLike`); None when
        unset (``rollart run`` then builds ``AgenticPipeline``)."""
        if self.pipeline is None:
            return None
        from rollart.plugins import check_pipeline_class, import_object

        return check_pipeline_class(import_object(self.pipeline, "pipeline"))

    @field_validator("data", mode="before")
    @classmethod
    def _one_task(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        parse_pools(self.pools)
        _check_tracking(self.tracking)
        problems = cross_field_problems(
            {
                "pools": self.pools,
                "train_pool": self.train_pool,
                "rollout_pool": self.rollout_pool,
                "advantage": self.advantage,
                "critic": self.critic.model_dump() if self.critic is not None else None,
                "envs": [
                    {"groups": e.groups, "backend": e.backend, "pool": e.pool, "servers": e.servers} for e in self.envs
                ],
                "data": [{"groups": t.groups} for t in self.data],
                "rollout": {
                    "num_env_groups": self.rollout.num_env_groups,
                    "batch_groups": self.rollout.batch_groups,
                    "alpha": self.rollout.alpha,
                },
                "tasks": {t: {"ratio": c.ratio} for t, c in self.tasks.items()},
                "model": self.model,
                "train": {
                    "model": self.train.model,
                    "strategy": self.train.strategy,
                    "sharding": self.train.sharding,
                    "tensor_parallel": self.train.tensor_parallel,
                    "packing": self.train.packing,
                },
                "engine": {"kind": self.engine.kind, "model": self.engine.model},
                "weights": {"channel": self.weights.channel},
                "elastic": {"autoscale": self.elastic.autoscale is not None},
                "fault": {"inference": None} if "inference" in self.fault.model_fields_set else {},
            }
        )
        if self.tasks:
            problems += task_problems(self)
        if any(e.agent for e in self.envs):
            from rollart.serving.agent import chat_without_template

            agents = [e.agent for e in self.envs if e.agent]
            chat = chat_without_template(agents, self.model, self.tiny_model, self.serving.chat_template)
            problems += [chat] if chat else []
        if problems:
            raise ValueError("\n".join(problems))  # validate_config lists them one by one
        return self

    @property
    def out_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))

    @property
    def colocated(self) -> bool:
        """Colocated mode: the rollout pool shares the train pool's devices (``{colocate_with: <train>}``)."""
        return colocated_pools(self.model_dump(include={"pools", "train_pool", "rollout_pool"}))

    def task_quotas(self) -> dict[str, int] | None:
        """Groups per batch of every task tag (``tasks.*.ratio``); None when no ratio is set."""
        from rollart.rollout.quotas import ratio_quotas

        ratios = {t: c.ratio for t, c in self.tasks.items() if c.ratio is not None}
        return ratio_quotas(ratios, self.rollout.batch_groups) if ratios else None

    def task_sampling(self, tag: str) -> SamplingParams:
        """The generation settings of ``tag``: ``sampling:`` with ``tasks.TAG.sampling`` over it."""
        task = self.tasks.get(tag)
        return task.sampling.over(self.sampling) if task is not None else self.sampling

    def task_reward(self, tag: str) -> RewardConfig | None:
        """The reward service of ``tag``: ``tasks.TAG.reward``, else ``reward:`` (None: the env's reward)."""
        task = self.tasks.get(tag)
        return task.reward if task is not None and task.reward is not None else self.reward


def task_tags(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """``(field, tag)`` of every env and data task: an env entry's ``tag``, else the tag its env class
    declares (:func:`~rollart.envs.registry.declared_tag`: read from the class, no env is built), a data
    task's ``tag`` or file stem. Raises ``ValueError`` for an env that sets its tag only when it is built."""
    from rollart.envs import declared_tag, env_class

    out: list[tuple[str, str]] = []
    for i, entry in enumerate(cfg.envs):
        tag = entry.tag
        if tag is None and entry.agent is not None:
            tag = "agent"
        if tag is None:
            assert entry.name is not None  # an entry names an env or an agent (EnvEntry checks)
            try:
                tag = declared_tag(env_class(entry.name), entry.kwargs)
            except ValueError as err:
                raise ValueError(f"envs[{i}]: env {entry.name}: {err}; set envs[{i}].tag") from None
            if tag is None:
                raise ValueError(
                    f"envs[{i}]: env {entry.name} sets its tag when it is built; set envs[{i}].tag (or declare it "
                    "in the class: the class attribute tag, or the class method tag_for(kwargs))"
                )
        out.append((f"envs[{i}]", tag))
    out += [(f"data[{i}]", t.name) for i, t in enumerate(cfg.data)]
    return out


def task_problems(cfg: PipelineConfig) -> list[str]:
    """``tasks:`` against the job's task tags: every key a tag, ratios on every tag or none, one
    ``max_new_tokens`` per task, one way to handle failed rewards."""
    try:
        tags = task_tags(cfg)
    except ValueError as err:
        return [str(err)]
    known = sorted(dict.fromkeys(t for _, t in tags))
    out = [
        f"tasks.{key}: no env or data task has tag {key!r} (the tags are {known}); fix the key, or set "
        "the tag with envs[i].tag / data[i].tag"
        for key in cfg.tasks
        if key not in known
    ]
    with_ratio = [t for t in known if t in cfg.tasks and cfg.tasks[t].ratio is not None]
    missing = [t for t in known if t not in with_ratio]
    if with_ratio and missing:
        example = ", ".join(f"{t}: {{ratio: 1}}" for t in missing)
        out.append(
            f"tasks: ratio is set for {with_ratio} but not for {missing}; give every task tag a share of the "
            f"batch (e.g. tasks: {{{example}}}) or remove ratio everywhere"
        )
    entries: list[Any] = [*cfg.envs, *cfg.data]
    for (where, tag), entry in zip(tags, entries):
        task = cfg.tasks.get(tag)
        if task is not None and task.sampling.max_new_tokens is not None and entry.max_new_tokens is not None:
            out.append(f"{where}.max_new_tokens and tasks.{tag}.sampling.max_new_tokens are both set; keep one of them")
    policies = {t: r.on_failure for t in known if (r := cfg.task_reward(t)) is not None}
    if len(set(policies.values())) > 1:
        out.append(
            f"tasks.*.reward.on_failure: the tasks' reward services fail differently ({policies}); the rollout "
            "handles a failed reward one way per job: give every reward the same on_failure"
        )
    return out
