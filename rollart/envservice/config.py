"""Config checks of remote envs (``envs: [{backend: ray | kubernetes, ...}]``), run when a pipeline config
loads: no env server, client or Ray is imported here."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

KUBERNETES_MODULE = "rollart.envservice.kubernetes"


def kubernetes_problem() -> str | None:
    """Why ``backend: kubernetes`` cannot run here, or None."""
    try:
        mod = importlib.import_module(KUBERNETES_MODULE)
    except ImportError as err:
        if getattr(err, "name", None) == KUBERNETES_MODULE:
            return f"backend: kubernetes is not available in this build ({KUBERNETES_MODULE} is missing); use backend: ray or local"
        return f"backend: kubernetes needs {err.name or err}: pip install 'rollart[k8s]'"
    if not callable(getattr(mod, "create_pool", None)):
        return f"backend: kubernetes is not available: {KUBERNETES_MODULE} has no create_pool(task)"
    return None


def env_service_problems(raw: Mapping[str, Any]) -> list[str]:
    """Cross-section checks of remote envs on a config mapping: the ``ray`` backend's ``pool`` is a CPU
    pool of ``pools`` with a CPU for every server."""
    out: list[str] = []
    pools, envs = raw.get("pools"), raw.get("envs")
    if not isinstance(pools, Mapping) or not isinstance(envs, list):
        return out
    need: dict[str, int] = {}
    for i, e in enumerate(envs):
        if not isinstance(e, Mapping) or e.get("backend", "local") != "ray":
            continue
        pool = e.get("pool", "env")
        servers = e.get("servers", 1)
        if not isinstance(pool, str) or not isinstance(servers, int):
            continue
        if pool not in pools:
            out.append(
                f"envs[{i}].pool: backend ray places env servers on pool {pool!r}, which is not one of pools "
                f"{sorted(pools)}; add pools.{pool}: {{hardware: CPU, cpus: {servers}}} or name another pool"
            )
            continue
        need[pool] = need.get(pool, 0) + servers
    for pool, n in need.items():
        groups = pools[pool] if isinstance(pools[pool], list) else [pools[pool]]
        if not all(isinstance(g, Mapping) for g in groups):
            continue
        if any(g.get("hardware") != "CPU" for g in groups):
            out.append(f"pools.{pool}: env servers need a CPU pool ({{hardware: CPU, cpus: N}}), got {pools[pool]!r}")
            continue
        cpus = sum(int(g.get("cpus") or 0) for g in groups)
        if n > cpus:
            out.append(
                f"envs[*].servers: the ray-backend tasks on pool {pool!r} ask for {n} env servers (one CPU each) but "
                f"pools.{pool}.cpus is {cpus}; raise cpus or lower servers"
            )
    return out
