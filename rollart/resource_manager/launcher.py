"""Launcher: join ``RAY_ADDRESS`` or start a fresh local Ray on 127.0.0.1 that declares the machine's GPUs
and, where asked, logical hardware.

With no ``RAY_ADDRESS`` and no initialised Ray, rollart starts a new Ray explicitly
(``ray.init(address="local")``) bound to 127.0.0.1. It declares:

- the GPUs Ray's own accelerator detection finds (:func:`detect_gpus`: the NVML device count, capped by
  ``CUDA_VISIBLE_DEVICES``, and the model Ray reads from the device name, e.g. ``H100``), as Ray's ``GPU``
  resource and its ``accelerator_type:<TYPE>`` marker: a pool of that type, or of ``hardware: GPU`` (any
  GPU type), runs on them;
- logical hardware, the resource ``accelerator_type:<TYPE>`` with one unit per device and the marker
  ``rollart_logical:<TYPE>`` (so a GPU node's logical types are never taken for its GPUs): on a
  machine without GPUs every hardware type the config asks for, so every placement and routing path runs
  on a CPU-only machine; on a machine with GPUs only the types named in
  ``local_resources`` (``cluster.local_resources``), so a pool naming hardware the machine lacks gets the
  ResourceManager's "not in the Ray cluster" error. Workers of logical devices run on the CPU.

``address="local"`` matters: a plain
``ray.init()`` joins whatever cluster the ``ray_current_cluster`` file of Ray's temp dir names, even a
stopped one, and then refuses ``num_cpus``.

With ``RAY_ADDRESS`` set, rollart joins that cluster (README, "Running on a cluster"): the nodes
declare their hardware themselves. Ray's token authentication is used when a token is at hand
(``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) and ``RAY_AUTH_MODE`` is unset.
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is set only for the local Ray (set, even to 0, it makes
``ray start --address`` refuse to join, and processes started from a driver inherit it).
A Ray the user already initialised is used as it is. Before a local Ray starts with token authentication,
a missing ``~/.ray/auth_token`` is written readable by its owner only, and an existing one of this user
that others can read is made so (Ray would write it readable by every user of the machine).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ray

from rollart.resource_manager.allocator import limit_malloc_arenas
from rollart.resource_manager.specs import CPU

log = logging.getLogger(__name__)

ACCEL_PREFIX = "accelerator_type:"
LOGICAL_PREFIX = "rollart_logical:"
"""A node resource ``rollart_logical:<TYPE>`` marks ``accelerator_type:<TYPE>`` there as logical devices."""
ANY_GPU = "GPU"
"""The hardware name of a pool that takes GPUs of any type (Ray's ``GPU`` resource)."""


@dataclass(frozen=True)
class DetectedGpus:
    """The GPUs of this machine as Ray's accelerator detection sees them."""

    count: int = 0
    accelerator_type: str | None = None  # Ray's name of the model, e.g. "H100"; None when unknown

    def types(self) -> tuple[str, ...]:
        """The hardware names pools use for these GPUs: ``GPU`` (any type) and the detected type."""
        if not self.count:
            return ()
        return (ANY_GPU, self.accelerator_type) if self.accelerator_type else (ANY_GPU,)

    def describe(self) -> str:
        if not self.count:
            return "no GPU"
        return f"{self.count} x {self.accelerator_type or 'GPU of unknown type'}"


def detect_gpus() -> DetectedGpus:
    """This machine's GPUs, detected as ``ray start`` / ``ray.init`` would: Ray's accelerator manager for
    its ``GPU`` resource (NVML for NVIDIA) gives the count, capped by ``CUDA_VISIBLE_DEVICES``, and the
    type it derives from the device name (``NVIDIA H100 80GB HBM3`` → ``H100``)."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource(ANY_GPU)
        count = int(manager.get_current_node_num_accelerators())
        visible = manager.get_current_process_visible_accelerator_ids()
        if visible is not None:
            count = min(count, len(visible))
        kind = manager.get_current_node_accelerator_type() if count else None
    except Exception as err:  # no driver library, or a Ray without this module: no GPU declared
        log.debug("GPU detection failed: %s", err)
        return DetectedGpus()
    return DetectedGpus(count, kind or None)


@dataclass(frozen=True)
class RayStart:
    """How this process came to its Ray: it started a local one (``local``) or joined ``RAY_ADDRESS``
    (``joined``), between ``began`` and ``ready`` (Unix times)."""

    how: Literal["local", "joined"]
    began: float
    ready: float


_ray_start: RayStart | None = None
_worker_output: Callable[[dict[str, Any]], None] | None = None  # prints the workers' lines (set_worker_output)
_workers_see_no_gpu = False  # the local Ray this process started hides CUDA from every worker


def workers_see_no_gpu() -> bool:
    """Whether every worker of the Ray this process started sees no CUDA device (a local Ray on a machine
    without GPUs: set for the whole node), so a worker needs no runtime env to hide them."""
    return _workers_see_no_gpu and ray.is_initialized()


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` while the block runs (what the processes started in it inherit).
    Only these keys are put back afterwards: ``ray.init`` adds keys of its own to the environment (the
    cluster's ``RAY_AUTH_MODE``, which drivers and subprocesses started later need to connect), and those
    must stay (``unittest.mock.patch.dict`` would restore the whole environment and drop them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def set_worker_output(handler: Callable[[dict[str, Any]], None] | None) -> None:
    """From the next Ray :func:`ensure_ray` starts or joins on, ``handler(data)`` prints the lines Ray
    forwards from the workers (``data``: Ray's batch, with ``lines``, ``pid``, ``actor_name``, ``is_err``)
    instead of Ray's own printer (which prefixes, colours and deduplicates them); None: Ray's printer."""
    global _worker_output
    _worker_output = handler


def _route_worker_output() -> None:
    """Replace Ray's printer of the workers' lines by :data:`_worker_output` (Ray's handler keeps its name,
    so ``ray.shutdown`` removes ours as it would its own)."""
    if _worker_output is None:
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError as err:  # a Ray without it: its own printer stays
        log.debug("worker output stays Ray's: %s", err)
        return
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", _worker_output)


TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


class _TokenNoticeAtDebug(logging.Filter):
    """Ray's warning that the local Ray it starts enabled token authentication says nothing a user of
    rollart's local Ray (on 127.0.0.1) must act on: it is logged at DEBUG instead (``rollart -v``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.getMessage()).startswith(TOKEN_NOTICE):
            return True
        if not getattr(record, "rollart_at_debug", False):  # once, whatever the number of Ray's handlers
            record.rollart_at_debug = True
            log.debug("ray: %s", record.getMessage())
        return False


@contextmanager
def _token_notice_at_debug() -> Iterator[None]:
    """While the local Ray starts: :class:`_TokenNoticeAtDebug` on the handlers of Ray's logger (set up
    when ``ray`` was imported)."""
    handlers = list(logging.getLogger("ray").handlers)
    quiet = _TokenNoticeAtDebug()
    for h in handlers:
        h.addFilter(quiet)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


def take_ray_start() -> RayStart | None:
    """How and when :func:`ensure_ray` last brought this process to Ray, told once: the first caller
    after that start (its ResourceManager) gets it, later ones None (Ray was up before them)."""
    global _ray_start
    start, _ray_start = _ray_start, None
    return start


def node_hardware() -> list[dict[str, object]]:
    """Per alive node of the connected Ray: its IP, GPUs, GPU types and logical device types."""
    out: list[dict[str, object]] = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        types = sorted(k[len(ACCEL_PREFIX) :] for k in res if k.startswith(ACCEL_PREFIX))
        logical = [t for t in types if f"{LOGICAL_PREFIX}{t}" in res or not res.get("GPU")]
        out.append(
            {
                "node_ip": node.get("NodeManagerAddress"),
                "gpus": res.get("GPU", 0.0),
                "gpu_types": [t for t in types if t not in logical],
                "logical": {t: res[accelerator_resource(t)] for t in logical},
            }
        )
    return out


def accelerator_resource(hardware: str) -> str:
    """Ray's resource name of a hardware type: ``accelerator_type:<TYPE>``."""
    return f"{ACCEL_PREFIX}{hardware}"


def new_job_id() -> str:
    return f"rollart-{uuid.uuid4().hex[:10]}"


def ensure_ray(
    local_resources: Mapping[str, float] | None = None,
    job_id: str | None = None,
    *,
    asked: Mapping[str, float] | None = None,
    gpus: DetectedGpus | None = None,
) -> str:
    """Make sure Ray is up; return the job id (the Ray namespace).

    ``local_resources`` (``{"H800": 4, "H20": 4, "CPU": 16}``) is what a locally started Ray declares
    besides the GPUs it detects; when it is None, ``asked`` (what the pools ask for) is declared as
    logical hardware on a machine without GPUs, and only its CPUs on a machine with GPUs. ``gpus``: this
    machine's GPUs when the caller detected them already (:func:`detect_gpus` otherwise).
    """
    if ray.is_initialized():
        return ray.get_runtime_context().namespace or job_id or new_job_id()
    global _ray_start
    began = time.time()
    limit_malloc_arenas()  # the driver's memory stays flat over long runs with faults (resource_manager.allocator)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    job_id = job_id or new_job_id()
    address = os.environ.get("RAY_ADDRESS")
    if address:
        _token_auth_for_joining()
        log.info(
            "joining the Ray cluster at %s as job %s (auth %s)",
            address,
            job_id,
            os.environ.get("RAY_AUTH_MODE", "unset"),
        )
        ray.init(address=address, namespace=job_id, log_to_driver=True)
        _route_worker_output()
        _ray_start = RayStart("joined", began, time.time())
        return job_id
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    _bind_to_loopback()
    plan = plan_local_ray(local_resources, asked, gpus=gpus)
    num_cpus, gpus, custom, logical = plan.num_cpus, plan.gpus, plan.custom, plan.logical
    log.info(
        "starting a local Ray on 127.0.0.1 as job %s: CPU=%d, GPUs detected: %s, logical devices: %s",
        job_id,
        num_cpus,
        gpus.describe(),
        logical or "none",
    )
    absent = plan.absent
    if absent:
        log.info(
            "not declared (this machine has no such GPU; cluster.local_resources declares logical ones): %s", absent
        )
    worker_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    global _workers_see_no_gpu
    _workers_see_no_gpu = gpus.count == 0
    if _workers_see_no_gpu:
        # No GPU declared: every worker of this Ray runs without CUDA devices. Set for the node's processes
        # (the raylet passes its environment to the workers it starts), so actors need no runtime env of
        # their own and take the idle worker the raylet starts ahead while the driver is still starting.
        node_env, job_env, prestart = {**worker_env, "CUDA_VISIBLE_DEVICES": ""}, None, True
    else:
        # Actors without GPUs hide them with a runtime env of their own, which never takes an idle worker
        # started ahead; each such worker importing Ray would only compete for the CPUs with the actors.
        node_env, job_env, prestart = {}, {"env_vars": worker_env}, False
    _private_token_file()
    with _environ(node_env), _token_notice_at_debug():  # what Ray's processes inherit; the driver's own is put back
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=gpus.count,
            resources=custom,
            namespace=job_id,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
            runtime_env=job_env,
            _system_config={"enable_worker_prestart": prestart, "prestart_worker_first_driver": False},
        )
    _route_worker_output()
    _ray_start = RayStart("local", began, time.time())
    return job_id


@dataclass(frozen=True)
class LocalRayPlan:
    """What a local Ray started by :func:`ensure_ray` declares: ``num_cpus`` CPUs, the detected ``gpus``,
    the ``custom`` resources (markers and logical devices) and, of these, the ``logical`` devices by type;
    ``absent``: the hardware types asked for that it does not declare."""

    num_cpus: int
    gpus: DetectedGpus
    custom: dict[str, float]
    logical: dict[str, float]
    absent: list[str]

    def node_resources(self) -> dict[str, float]:
        """The node's resources as ``ray.nodes()`` will report them (``CPU``, ``GPU`` and the custom ones)."""
        out = {CPU: float(self.num_cpus), **self.custom}
        if self.gpus.count:
            out["GPU"] = float(self.gpus.count)
        return out


def plan_local_ray(
    local_resources: Mapping[str, float] | None = None,
    asked: Mapping[str, float] | None = None,
    *,
    gpus: DetectedGpus | None = None,
) -> LocalRayPlan:
    """What :func:`ensure_ray` declares when it starts a local Ray for ``local_resources`` (else ``asked``,
    what the pools ask for) on this machine (its ``gpus``, detected when not given): known before Ray
    starts, so the pools can be checked first."""
    resources = dict(local_resources if local_resources is not None else asked or {})
    cpus = resources.pop(CPU, None)
    num_cpus = int(max(cpus or 0, os.cpu_count() or 1, 2))
    gpus = detect_gpus() if gpus is None else gpus
    custom, logical = local_ray_resources(resources, gpus, declare_logical=local_resources is not None)
    absent = sorted(hw for hw, n in resources.items() if n > 0 and hw not in logical and hw not in gpus.types())
    return LocalRayPlan(num_cpus, gpus, custom, logical, absent)


def starts_local_ray() -> bool:
    """Whether :func:`ensure_ray` would start a local Ray here (no Ray in this process, no ``RAY_ADDRESS``)."""
    return not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")


def local_ray_resources(
    wanted: Mapping[str, float], gpus: DetectedGpus, declare_logical: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """The custom resources of a local Ray (and the logical devices among them, by type) for the hardware
    ``wanted`` on a machine with ``gpus``: the detected type's marker; every other type as logical
    devices when there is no GPU or ``declare_logical`` (the user named it in ``local_resources``).
    ``GPU`` and the detected type are the GPUs themselves, never logical on a machine that has them."""
    custom: dict[str, float] = {}
    if gpus.count and gpus.accelerator_type:
        custom[accelerator_resource(gpus.accelerator_type)] = 1.0  # Ray's marker: one per node
    logical: dict[str, float] = {}
    for hw, n in wanted.items():
        if n <= 0 or hw in gpus.types():
            continue
        if gpus.count and not declare_logical:
            continue  # a GPU machine declares its own hardware; the ResourceManager reports the rest
        logical[hw] = float(n)
        custom[accelerator_resource(hw)] = float(n)
        custom[f"{LOGICAL_PREFIX}{hw}"] = 1.0
    return custom, logical


def _bind_to_loopback() -> None:
    """Make ``ray.init(_node_ip_address="127.0.0.1")`` keep 127.0.0.1. Ray turns a loopback address into
    the machine's routable one (so other hosts could join) unless its single-machine switch is on, and
    it reads that switch (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``) once, when ``ray`` is imported: before
    this function runs. Without this, the "local" Ray (its GCS, raylet, object transfers, and every
    address rollart derives from the node IP, such as Mooncake segments) listened on the machine's
    network address. The processes Ray starts read the variable set above."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _private_token_file() -> None:
    """Before a local Ray starts with token authentication (Ray's default when ``RAY_AUTH_MODE`` is unset):
    Ray writes a missing ``~/.ray/auth_token`` with the process's umask, readable by every user of the
    machine (0644), and with it anyone on the machine could join the cluster and run code. rollart
    writes the token itself first, readable by its owner only (0600, in a 0700 folder), and takes the
    other users' read access away from an existing token file of its user."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token" or os.environ.get("RAY_AUTH_TOKEN"):
        return
    given = os.environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(given) if given else Path.home() / ".ray" / "auth_token"
    try:
        if not given:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            path.chmod(0o600)
            log.warning("%s was readable by other users of this machine; now only by its owner (0600)", path)
        return
    except OSError as err:  # a read-only home: Ray reports what it needs
        log.info("cannot write a Ray token at %s (%s); Ray makes its own", path, err)
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what Ray itself would write: 256 random bits in hex


def _token_auth_for_joining() -> None:
    """Use Ray's token authentication to join a cluster when a token is at hand and the mode is unset
    (nodes started with ``RAY_AUTH_MODE=token`` refuse drivers without it)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
        os.environ["RAY_AUTH_MODE"] = "token"
