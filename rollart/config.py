"""Pipeline configuration: the YAML a user writes, validated before anything starts.

Errors name the field and the fix, e.g. ``rollout.batch_groups: ...``. Resource pools are the same
dicts ``ResourceManager`` takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollart.cluster.fault import FaultConfig
from rollart.engines.base import SamplingParams
from rollart.resource_manager.specs import parse_pools
from rollart.rollout.engine_config import EngineConfig
from rollart.rollout.env_manager import EnvManagerConfig
from rollart.rollout.scheduler import RolloutConfig
from rollart.training.config import RunningMeanConfig, TrainConfig
from rollart.training.critic import CriticConfig


class ConfigError(ValueError):
    """A pipeline config that cannot run; the message names the field."""


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    local_resources: dict[str, float] | None = None  # what a locally started Ray declares
    metadata_store: str | None = None
    job_id: str | None = None


class EnvEntry(BaseModel):
    """One task of the mix: an env from the ``envs`` registry, how many env groups play it."""

    model_config = ConfigDict(extra="forbid")

    name: str
    tag: str | None = None
    groups: int = Field(default=1, ge=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    max_steps: int | None = None
    max_new_tokens: int | None = None


class RewardConfig(BaseModel):
    """Score trajectories with a reward service instead of the env's own reward."""

    model_config = ConfigDict(extra="forbid")

    url: str
    timeout_s: float = 30.0
    retries: int = 3
    token_env: str | None = None
    on_failure: Literal["drop", "requeue"] = "requeue"  # replay the round, or drop the trajectory alone


class WeightsConfig(BaseModel):
    """How new weights reach the inference workers.

    ``ray``: the trainer puts the snapshot in the Ray object store, rollout pauses while every worker
    loads it. ``mooncake``: the trainer writes it to a Mooncake store in the background; workers fetch
    it while they keep generating and swap between two engine steps. ``dist``: a torch.distributed
    broadcast in buckets (gloo on CPU, NCCL on GPUs) from trainer rank 0 to every worker. ``none``
    (benchmarks only): no weights move, the policy version still advances — the baseline a weight
    channel's overhead is measured against."""

    model_config = ConfigDict(extra="forbid")

    channel: Literal["ray", "mooncake", "dist", "none"] = "ray"
    pause_rollout: bool = True  # ray channel: suspend every worker for the swap (False: each swaps between its steps)
    mooncake_master: str | None = None  # host:port of a running master; None: rollart starts one on the head node's IP
    protocol: Literal["tcp", "rdma"] = "tcp"  # mooncake transfer engine
    rdma_devices: list[str] = Field(default_factory=list)  # protocol rdma: device names, e.g. [mlx5_0, mlx5_1]
    host_shared: bool = True  # mooncake: one fetch per host, shared by that host's workers through its object store
    segment_mb: int = Field(default=256, ge=1)
    chunk_mb: int = Field(default=16, ge=1)
    bucket_mb: int = Field(default=32, ge=1)
    keep: int = Field(default=2, ge=1)
    async_publish: bool = True
    timeout_s: float = Field(default=120.0, gt=0)

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


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "rollart"
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    pools: dict[str, Any]
    train_pool: str = "train"
    rollout_pool: str = "rollout"
    tags: dict[str, list[str]] = Field(default_factory=lambda: {"*": list[str]()})
    model: str | None = None
    tiny_model: dict[str, Any] = Field(default_factory=dict)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env_manager: EnvManagerConfig = Field(default_factory=EnvManagerConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    envs: list[EnvEntry]
    reward: RewardConfig | None = None
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)  # restart policy per role (rollart.cluster.fault)
    advantage: Literal["grpo", "grpo_token", "reinforce", "running_mean", "gae"] = "grpo"
    critic: CriticConfig | None = None  # advantage: gae — a value model trained K times per actor step
    running_mean: RunningMeanConfig = Field(default_factory=RunningMeanConfig)  # advantage: running_mean
    steps: int = Field(default=20, ge=1)
    checkpoint_every: int = Field(default=0, ge=0)
    output_dir: str = "runs/{name}"
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        parse_pools(self.pools)
        for field_name in ("train_pool", "rollout_pool"):
            pool = getattr(self, field_name)
            if pool not in self.pools:
                raise ValueError(f"{field_name}={pool!r} is not one of pools {sorted(self.pools)}")
        if self.advantage == "gae" and self.critic is None:
            raise ValueError(
                "advantage=gae needs a critic: add `critic: {epochs: 2}` or `critic: {preset: sao}` (see CriticConfig)"
            )
        if self.critic is not None and self.advantage != "gae":
            raise ValueError(
                f"critic: is set but advantage={self.advantage!r} never uses it; set advantage: gae or remove critic:"
            )
        total = sum(e.groups for e in self.envs)
        if total != self.rollout.num_env_groups:
            raise ValueError(
                f"envs[*].groups add up to {total} but rollout.num_env_groups is {self.rollout.num_env_groups}; "
                "make them equal"
            )
        return self

    @property
    def out_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))


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


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read and validate a YAML config; ``overrides`` are dotted keys (``{"steps": 3}``)."""
    p = resolve_config_path(path)
    raw = yaml.safe_load(p.read_text()) or {}
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise ConfigError(f"{p}: {where}: {first['msg'].removeprefix('Value error, ')}") from None
