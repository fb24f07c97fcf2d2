"""The :class:`Tracker` protocol, metric flattening, and the factory that builds backends by name."""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

log = logging.getLogger(__name__)

TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
# backend name -> (module:class, the pip extra that installs its library, the library's import name)
TRACKERS: dict[str, tuple[str, str | None, str | None]] = {
    "jsonl": ("rollart.tracking.jsonl:JsonlTracker", None, None),
    "tensorboard": ("rollart.tracking.tensorboard_backend:TensorBoardTracker", "tensorboard", "tensorboard"),
    "wandb": ("rollart.tracking.wandb_backend:WandbTracker", "wandb", "wandb"),
    "mlflow": ("rollart.tracking.mlflow_backend:MlflowTracker", "mlflow", "mlflow"),
}
# keys of a pipeline record that are not metrics (lists of ids)
SKIP_KEYS = frozenset({"step", "groups"})


@runtime_checkable
class Tracker(Protocol):
    """Where a run's metrics go: ``log`` once per step, ``close`` at the end (also after a failure)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, float]:
    """Nested dicts and lists of numbers as flat scalar keys: ``{"reward_by_tag": {"a": 1}}`` →
    ``{"reward_by_tag/a": 1.0}``; a list gives one key per index. Booleans become 0/1; strings,
    ``None`` and non-finite numbers are left out (the trackers plot numbers)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not prefix and key in SKIP_KEYS:
            continue
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, name, sep))
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            out.update(flatten_metrics({str(i): v for i, v in enumerate(value)}, name, sep))
        elif isinstance(value, (bool, int, float)):
            x = float(value)
            if math.isfinite(x):
                out[name] = x
    return out


class MultiTracker:
    """Logs to every tracker; ``close`` closes each, even when one of them fails."""

    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers = list(trackers)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step)

    def close(self) -> None:
        errors: list[BaseException] = []
        for t in self.trackers:
            try:
                t.close()
            except Exception as err:  # close the others first, then report
                errors.append(err)
        if errors:
            raise errors[0]


def make_tracker(
    names: Sequence[str],
    run_dir: str | Path,
    *,
    run_name: str = "rollart",
    config: Mapping[str, Any] | None = None,
    resume: bool = False,
) -> MultiTracker:
    """The trackers ``names`` writing under ``run_dir``. A backend whose library is missing is an
    ``ImportError`` naming the extra to install; an unknown name a ``ValueError``."""
    trackers: list[Tracker] = []
    for name in dict.fromkeys(names):  # each once, in order
        if name not in TRACKERS:
            raise ValueError(f"tracking: unknown tracker {name!r}; use any of {', '.join(TRACKERS)}")
        target, extra, module = TRACKERS[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise ImportError(
                f"tracking: {name} needs the {module} package; install it with pip install 'rollart[{extra}]' "
                f"or remove {name} from tracking:"
            )
        mod_name, cls_name = target.split(":")
        cls = getattr(importlib.import_module(mod_name), cls_name)
        trackers.append(cls(Path(run_dir), run_name=run_name, config=dict(config or {}), resume=resume))
        log.info("tracking: %s", name)
    return MultiTracker(trackers)
