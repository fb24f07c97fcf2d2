"""The sections of a pipeline config that belong to no component package: the cluster, env entries,
reward services, tasks, weights, export, stop condition and traces."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rollart.config_model import ConfigModel
from rollart.engines.base import SamplingParams
from rollart.plugins import checked as _plain
from rollart.weights.kinds import channel_name_problem

TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]  # rollart.tracking's backends


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
    """The task's routing tag and metrics key; default: the tag the env class declares (its `tag`, or
    `tag_for(kwargs)`), read without building an env.
    """
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

    channel: str = "ray"
    """How new weights reach the inference workers: `ray` (object store), `mooncake` (a Mooncake store, in the
    background), `dist` (torch.distributed broadcast), `inprocess` (colocated mode, where it is the default and
    the only one: the engine loads its trainer's weights inside its process), `none` (benchmarks only: no
    transfer), or one a plug-in registers with `@register_weight_channel`.
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

    @field_validator("channel")
    @classmethod
    def _known_channel(cls, name: str) -> str:
        problem = channel_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        return name

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
