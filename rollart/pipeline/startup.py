"""The start-up timeline of a run, from the command to its first trained step, in phases: written to
``RUN_DIR/startup.json`` once the first step is done (``rollart bench startup`` reads it).

The marks (Unix times) come from where each thing happens: the command's start (``rollart run``: its
first import, :mod:`rollart.cli.clock`; else the process start, from the OS), Ray's start
(the launcher, :func:`~rollart.resource_manager.launcher.take_ray_start`), the pools' reservation (the
ResourceManager), each worker's start (its Cluster: asked for, process began, ``__init__`` began and
returned; :class:`~rollart.cluster.worker.WorkerStart`) and the pipeline's own steps. A phase lasts from
the previous mark to its own, so the phases add up to the time to the first step:

- ``imports_and_config``: rollart's imports, the config and its checks, the model cache;
- ``ray_start``: starting the local Ray's processes (or joining ``RAY_ADDRESS``);
- ``pools``: until the job's pools are reserved (placement groups);
- ``worker_start``: until the last worker's ``__init__`` began (Ray starts each worker's process, which
  imports the worker's modules: torch, transformers);
- ``model_load``: until every worker answered (each ``__init__`` builds its engine or trainer and loads
  the model) and the trainers' data-parallel groups formed;
- ``pipeline_setup``: tokenizer, envs, reward services, scheduler, weight channel;
- ``first_rollout``: until the first batch of trajectories is complete;
- ``first_train_step``: the first batch's training step and weight sync.

A mark earlier than the one before it (work that overlapped) makes its phase 0 s. Worker marks come from
the workers' clocks: on several hosts, clock skew moves time between ``worker_start`` and
``model_load``.
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart.cluster.worker import process_start_time

if TYPE_CHECKING:
    from rollart.config import PipelineConfig

log = logging.getLogger(__name__)

PHASES: tuple[str, ...] = (
    "imports_and_config",
    "ray_start",
    "pools",
    "worker_start",
    "model_load",
    "pipeline_setup",
    "first_rollout",
    "first_train_step",
)
MARKS: tuple[str, ...] = (
    "process_started",
    "ray_start_began",
    "ray_ready",
    "pools_reserved",
    "workers_booted",
    "clusters_ready",
    "run_began",
    "first_batch",
    "first_step",
)
"""Phase ``PHASES[i]`` lasts from ``MARKS[i]`` to ``MARKS[i + 1]``."""
FILE = "startup.json"


def phases_of(marks: Mapping[str, float]) -> dict[str, float]:
    """Each phase's seconds from ``marks`` (:data:`MARKS`, any origin): from the latest mark so far to its
    own mark, never negative; together they span ``process_started`` to the latest mark."""
    out: dict[str, float] = {}
    prev = marks[MARKS[0]]
    for phase, mark in zip(PHASES, MARKS[1:], strict=True):
        now = max(prev, marks.get(mark, prev))  # a mark never set (no such step): 0 s
        out[phase] = now - prev
        prev = now
    return out


_command_started: float | None = None


def set_command_started(at: float | None) -> None:
    """Count the timelines of this process from ``at`` (Unix time: when the ``rollart`` command started,
    :mod:`rollart.cli.clock`), not from the process's start; None: from the process's start again."""
    global _command_started
    _command_started = at


class StartupTimeline:
    """The start-up marks of one pipeline (see the module doc); :meth:`write` once its first step is done.
    Its clock starts when the ``rollart`` command started (:func:`set_command_started`), else when the
    process did."""

    def __init__(self) -> None:
        start = _command_started or process_start_time() or time.time()
        self.marks: dict[str, float] = {"process_started": start}
        self.workers: dict[str, list[dict[str, float]]] = {}
        self.path: Path | None = None

    def mark(self, name: str, at: float | None = None) -> bool:
        """Set mark ``name`` (to now, or ``at``) unless it is set; whether it was set now."""
        if name in self.marks:
            return False
        self.marks[name] = time.time() if at is None else at
        return True

    def resources_ready(self, rm: Any) -> None:
        """Ray's start and the pools' reservation, from the job's ResourceManager."""
        start = rm.ray_start  # None: Ray was up before this job asked (the user's ray.init, an earlier job)
        self.mark("ray_start_began", start.began if start is not None else rm.ray_ready_at)
        self.mark("ray_ready", start.ready if start is not None else rm.ray_ready_at)
        self.mark("pools_reserved", rm.reserved_at or time.time())

    def clusters_ready(self, clusters: Iterable[Any]) -> None:
        """Every worker of ``clusters`` answered: their start times, by cluster and rank."""
        for cluster in clusters:
            self.workers[cluster.name] = [w.as_dict() for w in cluster.start_times()]
        began = [w["init_began"] for ws in self.workers.values() for w in ws if w["init_began"]]
        self.mark("workers_booted", max(began, default=time.time()))
        self.mark("clusters_ready")

    def to_dict(self) -> dict[str, Any]:
        """``startup.json``: the marks and the worker times in seconds since the process started (the
        Unix time of that start is ``process_started``), the phases and their sum."""
        t0 = self.marks["process_started"]
        phases = phases_of(self.marks)
        return {
            "process_started": t0,
            "marks_s": {m: round(self.marks[m] - t0, 4) if m in self.marks else None for m in MARKS},
            "phases_s": {p: round(s, 4) for p, s in phases.items()},
            "time_to_first_step_s": round(sum(phases.values()), 4),
            "workers": {
                name: [{k: _since(k, v, t0) for k, v in w.items()} for w in ranks]
                for name, ranks in self.workers.items()
            },
        }

    def write(self, out_dir: Path) -> Path:
        """Write ``out_dir/startup.json`` and log the phases in one line."""
        data = self.to_dict()
        self.path = out_dir / FILE
        self.path.write_text(json.dumps(data, indent=2) + "\n")
        parts = ", ".join(f"{p.replace('_', ' ')} {s:.1f} s" for p, s in data["phases_s"].items())
        log.info("start-up: first step done %.1f s after the command (%s)", data["time_to_first_step_s"], parts)
        return self.path


def run_job_id(config: PipelineConfig, resume: bool) -> str | None:
    """The job id a run asks for: ``cluster.job_id``, else on ``--resume`` the one in ``RUN_DIR/job_id``
    (the next attempt of the same job), else None (a new one)."""
    job_file = config.out_dir.resolve() / "job_id"
    return config.cluster.job_id or (job_file.read_text().strip() if resume and job_file.exists() else None)


def start_ray_while_importing(config: PipelineConfig, resume: bool, *modules: str, gpus: Any = None) -> None:
    """Start (or join) the run's Ray while ``modules`` (the pipeline's, with torch and transformers, and
    the tokenizer's, which the pipeline uses once its workers are up) are imported in a thread beside it:
    starting Ray is mostly waiting for its processes, and the imports fill that wait. The pipeline's ResourceManager then finds Ray up, for the job id it asks for
    (:func:`run_job_id`), with the resources its pools ask for. An import error is raised here. ``gpus``:
    the machine's GPUs when the caller detected them already (``rollart run`` did, to check the pools)."""
    from rollart.resource_manager.launcher import ensure_ray
    from rollart.resource_manager.manager import resources_asked
    from rollart.resource_manager.specs import parse_pools

    failed: list[BaseException] = []

    def load() -> None:
        try:
            for module in modules:
                importlib.import_module(module)
        except BaseException as err:  # raised in the caller's thread below
            failed.append(err)

    loader = threading.Thread(target=load, name="rollart-import", daemon=True)
    loader.start()
    try:
        asked = resources_asked(parse_pools(config.pools))
        ensure_ray(config.cluster.local_resources, run_job_id(config, resume), asked=asked, gpus=gpus)
    finally:
        loader.join()
    if failed:
        raise failed[0]


def _since(key: str, value: float, t0: float) -> float | None:
    """A worker's time as seconds since ``t0`` (None: unknown); its CPU seconds (``*_cpu_s``) as they are."""
    if key.endswith("_s"):
        return round(value, 4)
    return round(value - t0, 4) if value else None


def read(run_dir: Path) -> dict[str, Any]:
    """A run's ``startup.json`` (written once its first step was done)."""
    path = run_dir / FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no start-up record (the run wrote none: did its first step finish?)")
    data: dict[str, Any] = json.loads(path.read_text())
    return data
