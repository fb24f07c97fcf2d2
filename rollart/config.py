"""Pipeline configuration: the YAML a user writes, validated before anything starts.

Errors name the field and the fix, e.g. ``rollout.batch_groups: ...``. Resource pools are the same
dicts ``ResourceManager`` takes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rollart.cluster.config import FaultConfig
from rollart.config_model import ConfigModel, load_yaml, type_problem
from rollart.data.config import DataTask, EvalConfig
from rollart.engines.base import SamplingParams
from rollart.plugins import checked as _plain
from rollart.resource_manager.specs import ResourceSpecError, colocation_target, parse_pools
from rollart.rollout.config import ElasticConfig, EngineConfig, EnvManagerConfig, RolloutConfig, RoutingConfig
from rollart.serving.config import ServingConfig
from rollart.training.config import CriticConfig, RunningMeanConfig, TrainConfig

TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]  # rollart.tracking's backends


class ConfigError(ValueError):
    """A pipeline config that cannot run; the message names the field of every problem (``problems``:
    one ``"field.path: what is wrong and the fix"`` line each)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def _import_plugin(module: str) -> str:
    from rollart.plugins import import_module

    _plain(import_module, module, "plugins")
    return module


class ClusterConfig(ConfigModel):
    """``cluster:``: where Ray comes from (a local Ray, or the cluster ``RAY_ADDRESS`` names) and the job."""

    local_resources: dict[str, float] | None = None
    """What a locally started Ray declares, e.g. `{H800: 4, H20: 4, CPU: 16}`; default: the hardware the pools
    ask for. Ignored when joining a cluster (`RAY_ADDRESS`).
    """
    metadata_store: str | None = None
    """The SQLite metadata store of jobs, pools and workers; default `$ROLLART_METADATA_DB`, else
    `~/.rollart/metadata.sqlite`.
    """
    job_id: str | None = None
    """The job's id (its Ray namespace and its tenant at a reward service); default: kept in `RUN_DIR/job_id`,
    new for a new run. `rollart submit --name` sets it.
    """


class EnvEntry(ConfigModel):
    """One task of the mix: an env from the ``envs`` registry or a user's ``MODULE:CLASS`` (a
    ``TextEnv`` subclass), how many env groups play it; ``kwargs`` are checked against its
    constructor here, before anything starts. Or an agent harness (``agent: MODULE:FUNCTION``, see
    :mod:`rollart.serving.agent`) played through the policy endpoint, its tasks from ``tasks``
    (``MODULE:FUNCTION`` of ``(seed, **kwargs)``, or a ``.jsonl`` file)."""

    name: str | None = None
    """The env: a registry name (`reverse`, `addition`, `countdown`, `frozen_lake`, `sokoban`, `code_sandbox`) or
    your `TextEnv` subclass as `MODULE:CLASS`; null for an `agent` entry.
    """
    agent: str | None = None
    """An agent harness instead of an env: `MODULE:FUNCTION`, `async def agent(client: openai.AsyncOpenAI, task:
    dict) -> float | None`, played through the policy endpoint (`serving:`; see the agents page).
    """
    tasks: str | None = None
    """`agent` entries: the episode's task from its seed, `MODULE:FUNCTION` called as `(seed, **kwargs)`, or a
    `.jsonl` file (row `seed % rows`); null: `{"seed": seed}`.
    """
    timeout_s: float = Field(default=600.0, gt=0)
    """`agent` entries: seconds one episode may take, every call included (then it fails and is played again)."""
    tag: str | None = None
    """The task's routing tag and metrics key; default: the env's own tag."""
    groups: int = Field(default=1, ge=1)
    """Env groups playing this task (they count toward `rollout.num_env_groups`)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the env's constructor (checked against its signature)."""
    max_steps: int | None = None
    """Turns per episode; default: the env's own."""
    max_new_tokens: int | None = None
    """Tokens per turn at most; default: the env's own (or `tasks.TAG.sampling.max_new_tokens`, not both)."""
    backend: Literal["local", "ray", "kubernetes"] = "local"
    """Where the env runs: `local` (in the driver), `ray` (env servers as Ray actors on a CPU pool) or
    `kubernetes` (env servers as pods).
    """
    servers: int = Field(default=1, ge=1)
    """Remote backends: warm env servers of this task."""
    pool: str = "env"
    """Backend `ray`: the CPU pool the env servers run in (one CPU each)."""
    call_timeout_s: float = Field(default=60.0, gt=0)
    """Remote backends: the server's timeout of one reset or step, in seconds."""
    kubernetes: dict[str, Any] | None = None
    """Backend `kubernetes`: the pod spec (`image`, `port`, `resources`, `node_selector`, `labels`,
    `ready_timeout_s`, `max_start_attempts`, `connection`).
    """

    @model_validator(mode="after")
    def _backend(self) -> EnvEntry:
        if (self.name is None) == (self.agent is None):
            raise ValueError("give name (an env) or agent (MODULE:FUNCTION of an agent harness), one of them")
        if self.agent is not None:
            from rollart.serving.agent import load_agent, load_tasks

            if self.backend != "local":
                raise ValueError("backend: an agent runs in the driver and reaches the policy by URL; drop backend")
            _plain(load_agent, self.agent)
            _plain(load_tasks, self.tasks, self.kwargs)
        elif self.tasks is not None:
            raise ValueError("tasks: only an agent entry has tasks; drop it or set agent")
        if self.kubernetes is not None and self.backend != "kubernetes":
            raise ValueError(f"kubernetes: a pod spec is set but backend is {self.backend!r}; set backend: kubernetes")
        if self.backend == "kubernetes":
            from rollart.envservice.config import kubernetes_problem

            problem = kubernetes_problem()
            if problem is not None:
                raise ValueError(problem)
        return self

    @field_validator("name")
    @classmethod
    def _env_exists(cls, name: str | None) -> str | None:
        from rollart.envs import env_class

        if name is not None:
            _plain(env_class, name, "name")
        return name

    @field_validator("kwargs")
    @classmethod
    def _kwargs_fit(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if info.data.get("name") is None:  # the env itself failed (reported there), or an agent's tasks kwargs
            return kwargs
        from rollart.envs import env_class, env_kwargs_problems

        env_cls = env_class(info.data["name"])
        problems = env_kwargs_problems(env_cls, kwargs)
        if problems:
            raise ValueError(f"env {info.data['name']} ({env_cls.__qualname__}): " + "; ".join(problems))
        return kwargs


class RewardConfig(ConfigModel):
    """Score trajectories with a reward service instead of the env's own reward."""

    url: str
    """The reward service's endpoint, e.g. `http://127.0.0.1:8100/rewards/reverse`."""
    timeout_s: float = 30.0
    """Timeout of one request, in seconds."""
    retries: int = 3
    """Retries of a failing request (with backoff and jitter; `Retry-After` honoured)."""
    token_env: str | None = None
    """The environment variable holding the bearer token; null: no token."""
    on_failure: Literal["drop", "requeue"] = "requeue"
    """A trajectory whose reward still fails: `requeue` plays its round again, `drop` drops it alone. Never
    scored 0.
    """
    tenant: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
    """The `X-Rollart-Tenant` this job is metered, cached and throttled as; default `cluster.job_id`, else
    `name`. On a service with a token per tenant it must be the tenant of the token.
    """


class TaskSampling(ConfigModel):
    """Generation settings of one task, over the pipeline's ``sampling:`` (unset fields keep it);
    ``max_new_tokens`` replaces the env's own budget, like ``envs[i].max_new_tokens``."""

    temperature: float | None = Field(default=None, ge=0)
    """Sampling temperature of this task; null: `sampling.temperature`."""
    top_p: float | None = Field(default=None, gt=0, le=1)
    """Nucleus sampling of this task; null: `sampling.top_p`."""
    top_k: int | None = None
    """Top-k of this task; null: `sampling.top_k`."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Tokens per turn of this task at most (replaces the env's own budget); null: the env's or
    `sampling.max_new_tokens`.
    """

    def over(self, base: SamplingParams) -> SamplingParams:
        """``base`` with this task's settings."""
        return base.model_copy(update=self.model_dump(exclude_none=True))


class TaskConfig(ConfigModel):
    """One task tag of a multi-task job (``tasks: {TAG: {...}}``): its share of every training batch
    (``ratio``; every tag gets one or none does), its reward service (else the pipeline's ``reward:``,
    else the env's own reward) and its generation settings."""

    ratio: float | None = Field(default=None, gt=0)
    """The task's share of every training batch (`batch_groups * ratio / sum(ratios)` groups); every tag gets one
    or none does.
    """
    reward: RewardConfig | None = None
    """The task's reward service; null: the pipeline's `reward:`, else the env's own reward."""
    sampling: TaskSampling = Field(default_factory=TaskSampling)
    """The task's generation settings, over the pipeline's `sampling:`."""


class WeightsConfig(ConfigModel):
    """How new weights reach the inference workers.

    ``ray``: the trainer puts the snapshot in the Ray object store, rollout pauses while every worker
    loads it. ``mooncake``: the trainer writes it to a Mooncake store in the background; workers fetch
    it while they keep generating and swap between two engine steps. ``dist``: a torch.distributed
    broadcast in buckets (gloo on CPU, NCCL on GPUs) from trainer rank 0 to every worker. ``inprocess``
    (colocated mode, and only there): each rank's engine loads its trainer's weights in its own process.
    ``none`` (benchmarks only): no weights move, the policy version still advances — the baseline a weight
    channel's overhead is measured against."""

    channel: Literal["ray", "mooncake", "dist", "inprocess", "none"] = "ray"
    """How new weights reach the inference workers: `ray` (object store), `mooncake` (a Mooncake store, in the
    background), `dist` (torch.distributed broadcast), `inprocess` (colocated mode, where it is the default and
    the only one: the engine loads its trainer's weights inside its process), `none` (benchmarks only: no
    transfer).
    """
    pause_rollout: bool = False
    """Channel `ray`: true: suspend every worker for the swap (all switch at one moment; the requests in
    flight are handed back and sent again); false: each worker swaps between two of its engine steps, its
    requests in flight continue there under the new weights (each token records its version).
    """
    background_load: bool | Literal["auto"] = False
    """Channel `ray`: train the next batch while the workers load the snapshot (the newest version wins); `auto`:
    on when `rollout.alpha >= 1`.
    """
    mooncake_master: str | None = None
    """Channel `mooncake`: `host:port` of a running master; null: rollart starts one on the driver's node IP for
    the job.
    """
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Channel `mooncake`: the transfer protocol, `tcp` or `rdma` (needs `rdma_devices`)."""
    rdma_devices: list[str] = Field(default_factory=list)
    """Protocol `rdma`: the RDMA device names of every host, e.g. `[mlx5_0, mlx5_1]` (`ibv_devices` lists them)."""
    host_shared: bool = True
    """Channel `mooncake`: each host fetches a version once, into shared memory its workers map."""
    relay: bool = False
    """Channel `mooncake` with `host_shared`: the rollout hosts relay each version in a binary tree, so the
    trainer's host sends it once (a host whose parent fails reads from the trainer).
    """
    segment_mb: int = Field(default=256, ge=1)
    """Channel `mooncake`: the size of each process's Mooncake segment, in MB."""
    chunk_mb: int = Field(default=16, ge=1)
    """Channel `mooncake`: the size of one stored chunk of a snapshot, in MB."""
    bucket_mb: int = Field(default=32, ge=1)
    """The weights leave the trainer a bucket of at most this many MB at a time (gathered from the shards of a
    sharded trainer, copied to the CPU, sent; a larger tensor in row pieces of at most this size); channel
    `dist` also broadcasts in buckets of this size.
    """
    keep: int = Field(default=2, ge=1)
    """Channel `mooncake`: versions kept in the store (older ones are removed once no reader holds them)."""
    async_publish: bool = True
    """Channel `mooncake`: the trainer writes each version in the background and trains on."""
    timeout_s: float = Field(default=120.0, gt=0)
    """How long a worker waits for a version before the load fails, in seconds."""

    @model_validator(mode="after")
    def _check(self) -> WeightsConfig:
        if self.protocol == "rdma" and not self.rdma_devices:
            raise ValueError(
                "weights.rdma_devices: protocol rdma needs the RDMA device names of every host, "
                "e.g. rdma_devices: [mlx5_0, mlx5_1] (list them with `ibv_devices`), or use protocol: tcp"
            )
        if self.protocol == "rdma" and self.channel != "mooncake":
            raise ValueError(f"weights.protocol: rdma applies to channel mooncake only (channel is {self.channel!r})")
        return self


class ExportConfig(ConfigModel):
    """What a finished run exports: ``hf: true`` writes ``RUN_DIR/hf``, a Hugging Face folder of the
    final policy (``rollart export RUN_DIR --hf OUT`` does the same from the latest checkpoint)."""

    hf: bool = True
    """Write `RUN_DIR/hf`, a Hugging Face folder of the final policy, when the run finishes."""


OTEL_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
"""What ``traces.otlp_endpoint`` imports (the ``otel`` extra)."""


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked
        return False


class StopAtConfig(ConfigModel):
    """End the run early, once the reward reached a target: the run then ends as after its last step
    (its export, a final checkpoint when `checkpoint_every` is on) and its summary says so."""

    reward_mean: float | None = None
    """Stop after the first step at which the mean of the last `window` steps' `reward_mean` is at least this
    (and `window` steps have run); null: never, the run takes its `steps`."""
    window: int = Field(default=20, ge=1)
    """Steps in that trailing mean."""


class TracesConfig(ConfigModel):
    """Trajectory traces: every traced trajectory's events with their times, in ``RUN_DIR/traces.jsonl``
    (its schema: the Trajectory traces page); ``rollart trace RUN_DIR`` reads them."""

    enabled: bool = False
    """Write `RUN_DIR/traces.jsonl` (events kept as they happen, encoded and appended once per step while
    the trainer computes). Off by default: on the quickstart tracing every trajectory added 1.2% to the mean
    step time (`rollart bench traces`) and about 12 ms of driver CPU per step of 256 trajectories.
    """
    sample: float = Field(default=1.0, ge=0, le=1)
    """The fraction of trajectories traced, chosen per trajectory id from the run's `seed` (the same ids
    are chosen in every run with that seed); 0 traces none.
    """
    max_mb: float = Field(default=256.0, gt=0)
    """The most the file may hold (MiB); past it tracing stops for the run, with one log line (the ledger's
    counts stay exact).
    """
    otlp_endpoint: str | None = None
    """Also send the traced trajectories to an OpenTelemetry collector as spans, over OTLP/HTTP: its URL,
    e.g. `http://127.0.0.1:4318` (spans go to `/v1/traces` under it). Needs the `otel` extra
    (`pip install 'rollart[otel]'`). Spans are sent from a background thread; a collector that is down is
    logged once and never fails or slows the run (`traces.jsonl` stays the record).
    """
    otlp_headers: dict[str, str] = Field(default_factory=dict)
    """HTTP headers sent with every export (e.g. a collector's API key)."""
    otlp_service_name: str | None = None
    """The spans' `service.name`; null: the run's `name`."""
    otlp_timeout_s: float = Field(default=10.0, gt=0)
    """How long one export may take, its retries included (seconds)."""

    @model_validator(mode="after")
    def _check_otlp(self) -> TracesConfig:
        if self.otlp_endpoint is None:
            return self
        if not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"traces.otlp_endpoint: {self.otlp_endpoint!r} is not an http(s) URL; give the collector's "
                "OTLP/HTTP address, e.g. http://127.0.0.1:4318"
            )
        if not self.enabled:
            raise ValueError("traces.otlp_endpoint exports the traced trajectories: set traces.enabled: true too")
        missing = [m for m in OTEL_MODULES if not _importable(m)]
        if missing:
            raise ValueError(
                f"traces.otlp_endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter ({', '.join(missing)} "
                "not found); install them with pip install 'rollart[otel]' or remove traces.otlp_endpoint"
            )
        return self


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
    train_pool: str = "train"
    """The pool the trainer (and its reference and critic) runs on."""
    rollout_pool: str = "rollout"
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
        ``plugins`` / ``plugin_paths``): the config's folder (``load_config`` passes it) and the cwd."""
        from rollart.plugins import add_search_path

        # from here on (and after), modules next to the config import in this process
        folders = add_search_path([f for f in ((info.context or {}).get("config_dir"), ".") if f])
        if isinstance(data, dict) and isinstance(data.get("train", {}), dict):
            plugins = data.get("plugins") or []
            data = {**data, "train": {"plugins": plugins if isinstance(plugins, list) else [], **data.get("train", {})}}
            data["train"].setdefault("plugin_paths", folders)
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
    """``(field, tag)`` of every env and data task: an env entry's ``tag``, else the tag of the env it
    builds (built once here and closed), a data task's ``tag`` or file stem."""
    from rollart.envs import EnvSpec, make_env

    out: list[tuple[str, str]] = []
    for i, entry in enumerate(cfg.envs):
        tag = entry.tag
        if tag is None and entry.agent is not None:
            tag = "agent"
        if tag is None:
            spec = EnvSpec(name=entry.name, max_steps=entry.max_steps, kwargs=entry.kwargs)
            try:
                env = make_env(spec)
            except Exception as err:
                raise ValueError(
                    f"envs[{i}]: could not build env {entry.name!r} to read its tag for tasks: "
                    f"({type(err).__name__}: {err}); set envs[{i}].tag"
                ) from None
            tag = str(env.tag)
            env.close()
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


def model_problems(raw: Mapping[str, Any]) -> list[str]:
    """``model``, ``train.model``, ``critic.model`` and ``engine.model`` (for the engines that load a
    Hugging Face model): a folder with a ``config.json`` or a model the offline Hugging Face cache holds."""
    from rollart.models.locate import model_problem
    from rollart.rollout.engine_config import ENGINE_KINDS

    def section(name: str) -> Mapping[str, Any]:
        value = raw.get(name)
        return value if isinstance(value, Mapping) else {}

    engine = section("engine")
    loads_hf = engine.get("kind", "torch") in set(ENGINE_KINDS) - {"simulated"}
    given = [
        ("model", raw.get("model")),
        ("train.model", section("train").get("model")),
        ("critic.model", section("critic").get("model")),
        ("engine.model", engine.get("model") if loads_hf else None),
    ]
    out = []
    for where, value in given:
        if isinstance(value, str):
            problem = model_problem(value)
            if problem is not None:
                out.append(f"{where}: {problem}")
    return out


def colocated_pools(raw: Mapping[str, Any]) -> bool:
    """Whether the config's rollout pool is ``{colocate_with: <its train pool>}`` (colocated mode)."""
    pools = raw.get("pools")
    rollout = raw.get("rollout_pool", PipelineConfig.model_fields["rollout_pool"].default)
    train = raw.get("train_pool", PipelineConfig.model_fields["train_pool"].default)
    if not isinstance(pools, Mapping) or not isinstance(rollout, str) or rollout not in pools:
        return False
    try:
        return colocation_target(rollout, pools[rollout]) == train
    except ResourceSpecError:  # parse_pools reports it
        return False


def _pool_units(pool: Any) -> int | None:
    """Devices (or CPUs) of a pool spec; None when it is not one the count can be read from."""
    groups = pool if isinstance(pool, list) else [pool]
    units = [g.get("devices", g.get("cpus")) if isinstance(g, Mapping) else None for g in groups]
    return sum(units) if all(isinstance(u, int) for u in units) else None  # type: ignore[arg-type]


def colocation_problems(raw: Mapping[str, Any]) -> list[str]:
    """Colocated mode (``pools.<rollout>: {colocate_with: <train>}``) against the rest of the config: which
    pool may colocate, the supported ``rollout.alpha`` (0), the weight channel (``inprocess``), engines with
    a sleep mode, the torch strategy, vLLM on one device, and no inference restart policy of its own."""
    pools = raw.get("pools")
    if not isinstance(pools, Mapping):
        return []
    train = raw.get("train_pool", PipelineConfig.model_fields["train_pool"].default)
    rollout_pool = raw.get("rollout_pool", PipelineConfig.model_fields["rollout_pool"].default)
    out = []
    for name, spec in pools.items():
        try:
            target = colocation_target(str(name), spec)
        except ResourceSpecError:
            continue  # parse_pools reports it
        if target is None:
            continue
        if name != rollout_pool:
            out.append(
                f"pools.{name}.colocate_with: only the rollout pool (rollout_pool: {rollout_pool!r}) can share "
                f"devices, with the train pool ({train!r}); give {name!r} devices of its own"
            )
        elif target != train and target in pools:
            out.append(
                f"pools.{name}.colocate_with: the rollout colocates with the trainer; name the train pool {train!r} "
                "(train_pool), or give the rollout devices of its own"
            )

    def section(key: str) -> Mapping[str, Any]:
        value = raw.get(key)
        return value if isinstance(value, Mapping) else {}

    channel = section("weights").get("channel")
    if not colocated_pools(raw):
        if channel == "inprocess":
            out.append(
                "weights.channel: inprocess moves the weights inside a colocated rank; it needs "
                f"pools.{rollout_pool}: {{colocate_with: {train}}}, or use channel ray, dist or mooncake"
            )
        return out
    mode = f"colocated mode (pools.{rollout_pool}: {{colocate_with: {train}}})"
    alpha = section("rollout").get("alpha", 0)
    if isinstance(alpha, int) and not isinstance(alpha, bool) and alpha != 0:
        out.append(
            f"rollout.alpha: {alpha} is not supported in {mode}, which supports alpha 0 only: the trainer and the "
            "engine take turns on the same devices, so the rollout cannot run ahead while the trainer steps (what "
            "alpha >= 1 is for); set rollout.alpha: 0, or give the rollout devices of its own to train asynchronously"
        )
    if channel not in (None, "inprocess"):
        out.append(
            f"weights.channel: {channel!r} does not apply in {mode}: each engine takes its trainer's weights inside "
            "its own process (channel inprocess); drop weights.channel"
        )
    out += _colocated_engine_problems(
        section("engine"), section("train").get("strategy", "torch"), pools.get(train), mode
    )
    if "inference" in section("fault"):
        out.append(
            f"fault.inference: in {mode} the engines live in the trainer's ranks and a dead one is a dead trainer "
            "rank (fault.train restarts it); drop fault.inference"
        )
    return out


def _colocated_engine_problems(engine: Mapping[str, Any], strategy: Any, train_pool: Any, mode: str) -> list[str]:
    """The engine and the strategy a colocated rank can hold."""
    from rollart.rollout.engine_config import ENGINE_KINDS, SLEEPING_KINDS

    out = []
    kind = engine.get("kind", "torch")
    if kind in ENGINE_KINDS and kind not in SLEEPING_KINDS:
        out.append(
            f"engine.kind: {kind!r} has no sleep mode, which {mode} needs; use torch or vllm (or your MODULE:CLASS "
            "engine that implements sleep and wake_up), or give the rollout devices of its own"
        )
    elif isinstance(kind, str) and ":" in kind:
        from rollart.engines.base import InferenceEngine
        from rollart.plugins import import_object

        try:
            cls = import_object(kind, "engine.kind")
        except Exception:  # the engine's own check reports an engine that does not import
            cls = None
        if isinstance(cls, type) and issubclass(cls, InferenceEngine) and cls.sleep is InferenceEngine.sleep:
            out.append(
                f"engine.kind: {kind} does not implement sleep and wake_up (rollart.engines.base.InferenceEngine), "
                f"which {mode} needs; implement them, or give the rollout devices of its own"
            )
    if strategy != "torch":
        out.append(
            f"train.strategy: {strategy!r} is not supported in {mode}; use torch, or give the rollout devices of "
            "its own"
        )
    units = _pool_units(train_pool)
    if kind == "vllm" and units is not None and units > 1:
        out.append(
            f"engine.kind: vllm in {mode} needs a one-device train pool ({units} here): each rank's in-process vLLM "
            "would set up a torch.distributed group of its own beside the trainer's; use the torch engine, or "
            "devices: 1"
        )
    return out


def _attention_heads(model: Any) -> tuple[int, int] | None:
    """(attention heads, KV heads) of a config's model (a folder, a cached model name, a ``{shape: ...}`` or
    None for the built-in tiny model); None when they cannot be read without loading anything."""
    import inspect

    if model is None:
        from rollart.models.tiny import build_tiny

        params = inspect.signature(build_tiny).parameters
        return params["num_heads"].default, params["num_kv_heads"].default
    if isinstance(model, Mapping):
        from rollart.models.shapes import SHAPES

        arch = SHAPES.get(str(model.get("shape")))
        return (arch.heads, arch.kv_heads) if arch is not None else None
    cfg = _model_config(model)
    if cfg is None:
        return None
    heads = cfg.get("num_attention_heads")
    return (heads, cfg.get("num_key_value_heads", heads)) if isinstance(heads, int) else None


def _model_config(model: Any) -> dict[str, Any] | None:
    """A config's model folder's (or cached model's) ``config.json``, or None when there is none to read."""
    import json

    if not isinstance(model, str):
        return None
    from rollart.models.locate import cached_model

    path = Path(model) / "config.json"
    found = str(path) if path.is_file() else cached_model(model)
    if found is None:
        return None
    try:
        data = json.loads(Path(found).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def packing_problems(raw: Mapping[str, Any]) -> list[str]:
    """``train.packing: true`` against the model's ``config.json`` (when there is one to read)."""
    train = raw.get("train")
    if not isinstance(train, Mapping) or train.get("packing") is not True:
        return []
    from rollart.training.config import packing_config_problem

    model = train.get("model") or raw.get("model")
    config = _model_config(model)
    reason = packing_config_problem(config) if config is not None else None
    if reason is None:
        return []
    return [f"train.packing: true: the model {model} cannot train packed ({reason}); set train.packing: false"]


def sharding_problems(raw: Mapping[str, Any]) -> list[str]:
    """``train.sharding`` / ``train.tensor_parallel`` against the train pool and the model: the tensor-parallel
    degree divides the pool's ranks and the model's attention and KV heads; colocated mode trains unsharded."""
    train = raw.get("train")
    if not isinstance(train, Mapping):
        return []
    tp, sharding = train.get("tensor_parallel", 1), train.get("sharding", "ddp")
    out = []
    if sharding == "fsdp" and colocated_pools(raw):
        out.append(
            "train.sharding: fsdp is not supported in colocated mode (each rank's engine would need the whole "
            "model the rank holds a shard of); use train.sharding: ddp, or give the rollout devices of its own"
        )
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 1:
        return out
    pools = raw.get("pools")
    pool_name = raw.get("train_pool", PipelineConfig.model_fields["train_pool"].default)
    units = _pool_units(pools.get(pool_name)) if isinstance(pools, Mapping) else None
    if units is not None and units % tp:
        out.append(
            f"train.tensor_parallel: {tp} does not divide the {units} ranks of pools.{pool_name}; give the train pool "
            f"a multiple of {tp} devices or change train.tensor_parallel"
        )
    heads = _attention_heads(train.get("model") or raw.get("model"))
    if heads is not None and (heads[0] % tp or heads[1] % tp):
        out.append(
            f"train.tensor_parallel: {tp} must divide the model's {heads[0]} attention heads and {heads[1]} KV "
            f"heads; use a divisor of {math.gcd(heads[0], heads[1])}"
        )
    return out


def cross_field_problems(raw: Mapping[str, Any]) -> list[str]:
    """The checks that relate several sections (pool names, the critic of ``advantage: gae``, the task
    groups against ``rollout.num_env_groups``), on a config mapping — also one whose fields have errors
    of their own, so that :func:`validate_config` reports these with them, not after they are fixed.
    Values of the wrong type are skipped (their own field reports them)."""
    out = model_problems(raw) + colocation_problems(raw) + sharding_problems(raw) + packing_problems(raw)
    pools = raw.get("pools")
    if isinstance(pools, dict):
        for field_name in ("train_pool", "rollout_pool"):
            pool = raw.get(field_name, PipelineConfig.model_fields[field_name].default)
            if isinstance(pool, str) and pool not in pools:
                out.append(f"{field_name}: {pool!r} is not one of pools {sorted(pools)}; name one of them")
        out += elastic_problems(raw, pools)
    advantage, critic = raw.get("advantage", "grpo"), raw.get("critic")
    if advantage == "gae" and critic is None:
        out.append(
            "advantage: gae needs a critic: add `critic: {epochs: 2}` or `critic: {preset: sao}` (see CriticConfig)"
        )
    if critic is not None and isinstance(advantage, str) and advantage != "gae":
        out.append(f"critic: is set but advantage={advantage!r} never uses it; set advantage: gae or remove critic:")
    envs, data = raw.get("envs") or [], raw.get("data") or []
    data = [data] if isinstance(data, dict) else data
    if isinstance(envs, list) and isinstance(data, list) and not envs and not data:
        out.append("envs: no task to train on; add envs: [{name: reverse}] or data: {train: FILE.jsonl}")
    from rollart.envservice.config import env_service_problems

    out += env_service_problems(raw)
    rollout: Mapping[str, Any] = raw["rollout"] if isinstance(raw.get("rollout"), dict) else {}
    wanted = rollout.get("num_env_groups", RolloutConfig.model_fields["num_env_groups"].default)
    tasks = [*envs, *data] if isinstance(envs, list) and isinstance(data, list) else None
    groups = [t.get("groups", 1) if isinstance(t, dict) else None for t in tasks or []]
    if tasks and isinstance(wanted, int) and all(isinstance(g, int) for g in groups):
        total = sum(g for g in groups if g is not None)
        if total != wanted:
            which = "envs[*].groups + data[*].groups" if data else "envs[*].groups"
            out.append(f"{which} add up to {total} but rollout.num_env_groups is {wanted}; make them equal")
    task_cfgs = raw.get("tasks")
    batch = rollout.get("batch_groups", RolloutConfig.model_fields["batch_groups"].default)
    if isinstance(task_cfgs, dict) and isinstance(batch, int) and batch >= 1:
        from rollart.rollout.quotas import ratio_problems

        given = {str(t): c.get("ratio") for t, c in task_cfgs.items() if isinstance(c, dict)}
        ratios: dict[str, float] = {
            t: float(r) for t, r in given.items() if isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0
        }
        if ratios and len(ratios) == sum(r is not None for r in given.values()):  # a bad ratio reports itself
            out += ratio_problems(ratios, batch)
    return out


def elastic_problems(raw: Mapping[str, Any], pools: Mapping[str, Any]) -> list[str]:
    """Only the rollout pool may be elastic (``max_devices``), and its weights must reach workers that
    join later (``weights.channel`` ray or mooncake; a ``dist`` broadcast has a fixed group, ``inprocess``
    weights stay inside the train ranks)."""
    rollout_pool = raw.get("rollout_pool", PipelineConfig.model_fields["rollout_pool"].default)
    out = []
    elastic = raw.get("elastic")
    if isinstance(elastic, Mapping) and elastic.get("autoscale") not in (None, False):
        groups = pools.get(rollout_pool)
        items = groups if isinstance(groups, list) else [groups]
        if not any(isinstance(g, Mapping) and g.get("max_devices") is not None for g in items):
            out.append(
                f"elastic.autoscale: the rollout pool (pools.{rollout_pool}) is not elastic, so there is nothing to "
                f"size; give pools.{rollout_pool} max_devices, or drop elastic.autoscale"
            )
    for name, groups in pools.items():
        items = groups if isinstance(groups, list) else [groups]
        for i, g in enumerate(items):
            if not isinstance(g, Mapping) or g.get("max_devices") is None:
                continue
            where = f"pools.{name}[{i}].max_devices" if isinstance(groups, list) else f"pools.{name}.max_devices"
            if name != rollout_pool:
                out.append(
                    f"{where}: only the rollout pool (rollout_pool: {rollout_pool}) can be elastic; "
                    f"drop max_devices from pools.{name}"
                )
                continue
            weights = raw.get("weights")
            channel = weights.get("channel", "ray") if isinstance(weights, Mapping) else "ray"
            if channel in ("dist", "inprocess"):
                how = "broadcasts to a fixed group" if channel == "dist" else "stays inside each train rank (colocated)"
                out.append(
                    f"{where}: an elastic pool needs weights that workers joining later can load; weights.channel "
                    f"{channel} {how}: use ray or mooncake"
                )
    return out


def _check_tracking(names: Sequence[str]) -> None:
    """Every tracker's library is importable (each is a pip extra of the same name)."""
    import importlib.util

    for name in names:
        if name != "jsonl" and importlib.util.find_spec(name) is None:
            raise ValueError(
                f"tracking: {name} needs the {name} package; install it with pip install 'rollart[{name}]' "
                f"or remove {name} from tracking"
            )


def shipped_configs() -> dict[str, Path]:
    """The configs that ship with rollart (``rollart.pipelines``), by name: ``{"quickstart": .../quickstart.yaml}``."""
    from importlib.resources import files

    folder = files("rollart.pipelines")
    return {Path(e.name).stem: Path(str(e)) for e in folder.iterdir() if e.name.endswith(".yaml")}


def resolve_config_path(path: str | Path) -> Path:
    """``path`` when that file exists, else the shipped config of that name (``quickstart`` or
    ``quickstart.yaml``), so ``rollart run quickstart`` works from any directory."""
    p = Path(path)
    if p.exists():
        return p
    name = Path(path).name.removesuffix(".yaml").removesuffix(".yml")
    shipped = shipped_configs()
    if name in shipped and (len(p.parts) == 1 or p.parent.name == "pipelines"):
        return shipped[name]
    raise ConfigError(f"config file {p} does not exist (shipped configs, usable by name: {', '.join(sorted(shipped))})")


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as ``load_config`` overrides (each value read as YAML); a malformed item
    exits with the fix."""
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--set {item!r}: use key=value, e.g. --set steps=5")
        key, value = item.split("=", 1)
        try:
            out[key] = load_yaml(value)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at column {mark.column + 1}" if mark is not None else ""
            raise SystemExit(
                f"--set {item!r}: the value is not valid YAML{where} ({getattr(err, 'problem', err)}); "
                "quote it, e.g. --set 'name=\"a: b\"'"
            ) from None
    return out


def yaml_error_line(err: yaml.YAMLError, source: str | Path) -> str:
    """A YAML error as one line: ``FILE:LINE:COLUMN: what`` (line and column counted from 1)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(source)
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and start is not mark:
        context = f"{context} (from line {start.line + 1}, column {start.column + 1})"
    problem = getattr(err, "problem", None)
    what = ", ".join(str(p) for p in (context, problem) if p) or str(err).splitlines()[0]
    return f"{where}: YAML syntax error: {what}"


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping of a YAML config file; a ConfigError naming the file, line and column on a syntax error."""
    try:
        raw = load_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(yaml_error_line(err, path)) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config is a mapping of keys (name:, pools:, ...), not a {type(raw).__name__}")
    return raw


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read and validate a YAML config; ``overrides`` are dotted keys (``{"steps": 3}``)."""
    p = resolve_config_path(path)
    raw = read_yaml(p)
    for dotted, value in (overrides or {}).items():
        set_dotted(raw, dotted, value)
    return validate_config(raw, source=p)


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Put ``value`` at the dotted key ``dotted`` (``"train.lr"``) of a raw config mapping, making the
    mappings on the way."""
    node = raw
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def _where(loc: tuple[Any, ...]) -> str:
    """A pydantic location as a config path: ``("envs", 0, "name")`` → ``envs[0].name``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _section_fields(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the config section that holds ``loc``'s last key ([] when unknown)."""
    import typing

    model: Any = PipelineConfig
    keyed = False  # the previous field was a dict of sections: this part is one of its keys
    for part in loc[:-1]:
        if isinstance(part, int) or keyed:
            keyed = False
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        keyed = typing.get_origin(field.annotation) is dict
        todo, model = [field.annotation], None
        while todo:  # the first pydantic model inside Optional[...] / list[...] / dict[..., ...]
            t = todo.pop(0)
            if isinstance(t, type) and issubclass(t, BaseModel):
                model = t
                break
            todo.extend(typing.get_args(t))
        if model is None:
            return []
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _problem(error: Any) -> str:
    loc = tuple(error["loc"])
    where = _where(loc)
    msg = str(error["msg"]).removeprefix("Value error, ")
    msg = msg.removeprefix(f"{where}: ")
    if not loc or msg.startswith((f"{where}.", f"{where}=")):
        return msg  # a section's own check, which names its fields (``rollout.batch_groups=9 exceeds ...``)
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        import difflib

        close = difflib.get_close_matches(str(loc[-1]), _section_fields(loc), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        msg = f"unknown key; {hint}remove it or fix its spelling"
    elif kind == "missing":
        msg = "required; add it"
    elif type_problem(error) is not None:
        msg = str(type_problem(error))
    elif kind != "value_error" and "input" in error and not isinstance(error["input"], (dict, list)):
        msg = f"{msg} (got {error['input']!r})"
    return f"{where}: {msg}"


def validate_config(raw: dict[str, Any], source: str | Path | None = None) -> PipelineConfig:
    """``PipelineConfig`` from a YAML mapping, or one :class:`ConfigError` listing every problem with
    its field path: the fields' own checks, env names and constructor kwargs, loss / aggregation /
    advantage names and parameters, the pipeline class, the plug-in modules' imports. Nothing is
    started. ``source`` (the YAML file) adds its folder to where plug-in modules are looked up."""
    context = {"config_dir": str(Path(source).resolve().parent)} if source is not None else {}
    try:
        cfg = PipelineConfig.model_validate(raw, context=context)
    except ValidationError as err:
        errors = err.errors()
        problems = [line for e in errors for line in _problem(e).split("\n")]
        if any(e["loc"] for e in errors):  # field errors: the cross-field checks did not run; run them here
            problems += cross_field_problems(raw) if isinstance(raw, dict) else []
        problems = list(dict.fromkeys(problems))
    else:
        if cfg.data or cfg.eval is not None:
            cfg = _check_data(cfg, Path(source) if source is not None else Path("config.yaml"))
        return cfg
    head = f"{source}: " if source is not None else ""
    if len(problems) == 1:
        raise ConfigError(f"{head}{problems[0]}", problems)
    lines = "\n".join(f"  - {x}" for x in problems)
    raise ConfigError(f"{head}{len(problems)} problems in the config:\n{lines}", problems)


def _check_data(cfg: PipelineConfig, path: Path) -> PipelineConfig:
    """Data paths resolved against the config's folder (made importable, for verifiers next to it), every
    dataset, column and verifier loaded once: a missing one is a ConfigError now, not in a running job."""
    from rollart.data.prompts import check_config, resolve_paths
    from rollart.data.sources import DataError

    data, eval_cfg = resolve_paths(cfg.data, cfg.eval, path.parent)
    try:
        check_config(data, eval_cfg)
    except DataError as err:
        raise ConfigError(f"{path}: {err}", [str(err)]) from None
    return cfg.model_copy(update={"data": data, "eval": eval_cfg})
