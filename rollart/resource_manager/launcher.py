"""Launcher: join ``RAY_ADDRESS`` or start a fresh local Ray on 127.0.0.1 that declares logical hardware.

With no ``RAY_ADDRESS`` and no initialised Ray, rollart starts a new Ray explicitly
(``ray.init(address="local")``) bound to 127.0.0.1 and declares every hardware type of the config as
the logical resource ``accelerator_type:<TYPE>`` (one unit per device), so every placement and routing
path runs on a CPU-only machine (DESIGN.md, "Dependencies"). ``address="local"`` matters: a plain
``ray.init()`` joins whatever cluster the ``ray_current_cluster`` file of Ray's temp dir names, even a
stopped one, and then refuses ``num_cpus``.

With ``RAY_ADDRESS`` set, rollart joins that cluster (README, "Running on a cluster"): the nodes
declare their hardware themselves. Ray's token authentication is used when a token is at hand
(``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) and ``RAY_AUTH_MODE`` is unset.
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is set only for the local Ray (set, even to 0, it makes
``ray start --address`` refuse to join, and processes started from a driver inherit it).
A Ray the user already initialised is used as it is.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping

import ray

from rollart.resource_manager.allocator import limit_malloc_arenas
from rollart.resource_manager.specs import CPU

log = logging.getLogger(__name__)

ACCEL_PREFIX = "accelerator_type:"


def accelerator_resource(hardware: str) -> str:
    """Ray's resource name of a hardware type: ``accelerator_type:<TYPE>``."""
    return f"{ACCEL_PREFIX}{hardware}"


def new_job_id() -> str:
    return f"rollart-{uuid.uuid4().hex[:10]}"


def ensure_ray(local_resources: Mapping[str, float] | None = None, job_id: str | None = None) -> str:
    """Make sure Ray is up; return the job id (the Ray namespace).

    ``local_resources`` (``{"H800": 4, "H20": 4, "CPU": 16}``) is what a locally started Ray declares.
    """
    if ray.is_initialized():
        return ray.get_runtime_context().namespace or job_id or new_job_id()
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
        return job_id
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    _bind_to_loopback()
    resources = dict(local_resources or {})
    cpus = resources.pop(CPU, None)
    num_cpus = int(max(cpus or 0, os.cpu_count() or 1, 2))
    custom = {accelerator_resource(hw): float(n) for hw, n in resources.items() if n > 0}
    log.info("starting a local Ray on 127.0.0.1 (CPU=%s, %s) as job %s", num_cpus, custom, job_id)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=0,
        resources=custom,
        namespace=job_id,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        runtime_env={
            "env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
        },
    )
    return job_id


def _bind_to_loopback() -> None:
    """Make ``ray.init(_node_ip_address="127.0.0.1")`` keep 127.0.0.1. Ray turns a loopback address into
    the machine's routable one (so other hosts could join) unless its single-machine switch is on, and
    it reads that switch (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``) once, when ``ray`` is imported: before
    this function runs. Without this, the "local" Ray (its GCS, raylet, object transfers, and every
    address rollart derives from the node IP, such as Mooncake segments) listened on the machine's
    network address. The processes Ray starts read the variable set above."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _token_auth_for_joining() -> None:
    """Use Ray's token authentication to join a cluster when a token is at hand and the mode is unset
    (nodes started with ``RAY_AUTH_MODE=token`` refuse drivers without it)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
        os.environ["RAY_AUTH_MODE"] = "token"
