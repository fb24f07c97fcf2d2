"""An MLflow run (extra ``mlflow``): the tracking URI is ``$MLFLOW_TRACKING_URI`` when set, else the
file store ``run_dir/mlruns``; the experiment is the pipeline's name.

MLflow 3 keeps its file store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE`` is
set: for the default ``run_dir/mlruns`` rollart sets it (only when unset). A database URI
(``sqlite:///mlflow.db``, needs the full ``mlflow`` package) or a server works through
``MLFLOW_TRACKING_URI``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollart.tracking.base import flatten_metrics


def _sanitise(key: str) -> str:
    """MLflow metric names allow letters, digits, ``_ - . / `` and spaces; others become ``_``."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


class MlflowTracker:
    def __init__(self, run_dir: Path, *, run_name: str = "", config: dict | None = None, resume: bool = False):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (Path(run_dir).resolve() / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        name = run_name or "rollart"
        exp = self.client.get_experiment_by_name(name)
        experiment_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_sanitise(k), v, now, step) for k, v in flatten_metrics(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow's per-request limit
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
