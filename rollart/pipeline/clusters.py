"""The job's Clusters: its pools (a ResourceManager), the inference and trainer Clusters (one colocated
Cluster in colocated mode), and the reference (``train.kl_coef``) and critic (``advantage: gae``) beside the
trainer ranks, all started together; a train pool on this machine's CPU is checked to fit its memory
first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart.cluster.cluster import Cluster, start_together
from rollart.config import PipelineConfig
from rollart.pipeline.startup import StartupTimeline, run_job_id
from rollart.resource_manager.manager import ResourceManager
from rollart.rollout.inference_worker import inference_worker_class
from rollart.training.kinds import STRATEGIES
from rollart.training.placement import start_data_parallel
from rollart.training.strategies import train_worker_class


@dataclass
class JobClusters:
    """What :func:`start_clusters` started."""

    rm: ResourceManager
    train: Cluster
    infer: Cluster  # the trainer's Cluster itself in colocated mode
    ref: Cluster | None
    critic: Cluster | None


def start_clusters(
    config: PipelineConfig, *, out_dir: Path, model_path: str, startup: StartupTimeline, resume: bool
) -> JobClusters:
    """Reserve the pools and start every Cluster of the job at the same time (each worker boots, imports
    and loads its model beside the others; one that fails stops all, and the pools are released)."""
    rm = ResourceManager(
        config.pools,
        job_id=run_job_id(config, resume),
        store=config.cluster.metadata_store,
        local_resources=config.cluster.local_resources,
    )
    (out_dir / "job_id").write_text(rm.job_id + "\n")  # a --resume is the next attempt of the same job
    check_train_memory(config, rm, model_path)
    startup.resources_ready(rm)
    pool_hw = [g.hardware for g in rm.specs[config.rollout_pool].groups]
    tags = {k: (v or pool_hw) for k, v in config.tags.items()}
    engine = config.engine.model_copy(update={"model": config.engine.model or model_path})
    train_cfg = config.train.model_copy(update={"model": config.train.model or model_path})
    made: dict[str, Cluster] = {}

    def train() -> Cluster:  # the reference and critic ranks colocate with it
        if config.colocated:  # one worker per train rank holds the trainer and the engine (time-shared)
            from rollart.training.colocated import colocated_worker_class

            cls: type = colocated_worker_class(train_cfg.strategy, tags)
            kwargs = {"config": train_cfg.model_dump(), "engine": engine.model_dump()}
            made["train"] = made["infer"] = Cluster(
                "actor", cls, rm, pool=config.train_pool, worker_kwargs=kwargs, wait=False
            )
            return made["train"]
        cls = train_worker_class(train_cfg.strategy)
        kwargs = {"config": train_cfg.model_dump()}
        made["train"] = Cluster("actor_train", cls, rm, pool=config.train_pool, worker_kwargs=kwargs, wait=False)
        return made["train"]

    def infer() -> Cluster:
        kwargs = {"engine": engine.model_dump()}
        cls = inference_worker_class(tags)
        made["infer"] = Cluster("actor_infer", cls, rm, pool=config.rollout_pool, worker_kwargs=kwargs, wait=False)
        return made["infer"]

    starts = [train] if config.colocated else [infer, train]
    if config.train.kl_coef > 0:
        starts.append(lambda: beside_trainer("reference", config, rm, made["train"], train_cfg, model_path))
    if config.advantage == "gae":
        starts.append(lambda: beside_trainer("critic", config, rm, made["train"], train_cfg, model_path))
    try:
        clusters = start_together(starts)
        ref = next((c for c in clusters if c.name == "reference"), None)
        critic = next((c for c in clusters if c.name == "critic"), None)
        try:
            start_data_parallel(made["train"])
            if critic is not None:
                start_data_parallel(critic)
            if ref is not None and config.train.sharding == "fsdp":
                start_data_parallel(ref)
        except BaseException:
            for c in reversed(clusters):
                c.shutdown()
            raise
    except BaseException:
        rm.shutdown()  # no pipeline exists to release the pools later
        raise
    return JobClusters(rm, made["train"], made["infer"], ref, critic)


def check_train_memory(config: PipelineConfig, rm: ResourceManager, model_path: str) -> None:
    """Before any actor starts: on a one-machine cluster whose train ranks run on its CPU, their weights,
    gradients and optimizer states must fit the machine's memory (a GPU rank checks its device itself)."""
    import psutil
    import ray

    from rollart.resource_manager.specs import ResourceSpecError
    from rollart.training.memory import fit_problem, model_param_counts

    cfg = config.train
    groups = rm.specs[config.train_pool].groups
    on_gpus = all(rm.capacity[g.hardware].mode == "gpu" for g in groups if g.hardware in rm.capacity)
    if on_gpus or sum(1 for n in ray.nodes() if n.get("Alive")) != 1:
        return
    try:
        total, split = model_param_counts(cfg.model or model_path)
    except (KeyError, OSError, ValueError):  # not a Qwen2/Llama-style config: nothing to estimate
        return
    ranks = sum(g.devices or g.cpus or 0 for g in groups)
    problem = fit_problem(
        total,
        split,
        sharding=cfg.sharding,
        ranks=ranks,
        tensor_parallel=cfg.tensor_parallel,
        offload=False,
        budget=0.9 * psutil.virtual_memory().total,
        where="this machine (90% of its memory)",
    )
    if problem is not None:
        rm.shutdown()
        raise ResourceSpecError(problem)


def beside_trainer(
    role: str, config: PipelineConfig, rm: ResourceManager, train: Cluster, train_cfg: Any, model_path: str
) -> Cluster:
    """The frozen initial policy (``reference``) or the value model (``critic``, with its own
    data-parallel group, formed by the caller): one rank colocated with each trainer rank, starting
    (``wait=False``) beside the trainer's."""

    def beside(cls: type, kwargs: dict[str, Any]) -> Cluster:
        return Cluster(role, cls, rm, pool=config.train_pool, colocate_with=train, worker_kwargs=kwargs, wait=False)

    if role == "reference" and train_cfg.sharding == "fsdp":
        # sharded like the trainer (its own process group, formed by the caller): a trainer that is never
        # stepped holds no optimizer state, only its shards of the initial weights
        return beside(train_worker_class(train_cfg.strategy), {"config": train_cfg.model_dump()})
    if role == "reference":
        from rollart.training.reference import ReferenceWorker

        kwargs = {
            "model": train_cfg.model,
            "max_tokens_per_microbatch": train_cfg.max_tokens_per_microbatch,
            "packing": train_cfg.packing if "packing" in STRATEGIES[train_cfg.strategy].features else False,
        }
        return beside(ReferenceWorker, kwargs)
    from rollart.training.critic import CriticWorker

    assert config.critic is not None
    critic_cfg = config.critic.model_copy(update={"model": config.critic.model or model_path})
    return beside(CriticWorker, {"config": critic_cfg.model_dump()})
