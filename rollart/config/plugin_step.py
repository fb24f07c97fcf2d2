"""The config's plug-ins load in one explicit, reported step, before the config is validated: each module
of ``plugins:`` is imported from the config's folder, the working directory or the installed packages,
and one log line says where it came from and what it registered (envs, losses, loss aggregations,
advantages, weight channels, training strategies). A module that does not import is reported once, by
the ``plugins`` field's check, with the rest of the config's problems."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("rollart.config")


def registered() -> dict[str, set[str]]:
    """The names each registry holds now."""
    from rollart.algorithms.advantages import _ADVANTAGES
    from rollart.algorithms.aggregation import _AGGS
    from rollart.algorithms.losses import _LOSSES
    from rollart.envs.base import _REGISTRY
    from rollart.training.kinds import STRATEGIES
    from rollart.weights.kinds import WEIGHT_CHANNELS

    return {
        "env": set(_REGISTRY),
        "loss": set(_LOSSES),
        "loss aggregation": set(_AGGS),
        "advantage": set(_ADVANTAGES),
        "weight channel": set(WEIGHT_CHANNELS),
        "training strategy": set(STRATEGIES),
    }


def load_plugins(modules: Any, config_dir: str | Path | None) -> dict[str, dict[str, list[str]]]:
    """Import ``modules`` (the raw ``plugins:`` list) and log each one; returns, per module imported now,
    what it registered (``{kind: [names]}``). A module already imported is not imported again; one that
    fails is left for the ``plugins`` field to report."""
    from rollart.plugins import FAILED_IMPORTS, PluginError, add_search_path, import_module

    if not isinstance(modules, Sequence) or isinstance(modules, str):
        return {}
    search = [f for f in (config_dir, ".") if f]
    add_search_path(search)
    out: dict[str, dict[str, list[str]]] = {}
    for module in modules:
        if not isinstance(module, str) or module in sys.modules:
            continue
        FAILED_IMPORTS.pop(module, None)  # tried again (the file may have been fixed since)
        before = registered()
        try:
            imported = import_module(module, "plugins", search)
        except PluginError:
            continue  # the plugins field reports it, with the config's other problems
        after = registered()
        added = {kind: sorted(after[kind] - before[kind]) for kind in after if after[kind] - before[kind]}
        out[module] = added
        what = "; ".join(f"{kind} {', '.join(names)}" for kind, names in added.items()) or "nothing by name"
        log.info("plugins: %s (%s) registered %s", module, getattr(imported, "__file__", "?"), what)
    return out
