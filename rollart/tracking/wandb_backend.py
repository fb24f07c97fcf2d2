"""A Weights & Biases run, offline by default, in ``run_dir/wandb`` (extra ``wandb``).

Offline runs are uploaded later with ``wandb sync RUN_DIR/wandb/offline-run-*``; ``WANDB_MODE`` set in
the environment (``online``, ``disabled``) wins over the offline default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollart.tracking.base import flatten_metrics


class WandbTracker:
    def __init__(self, run_dir: Path, *, run_name: str = "", config: dict | None = None, resume: bool = False):
        import wandb

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT", "rollart"),
            name=run_name or None,
            config=config or {},
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(flatten_metrics(metrics), step=step)

    def close(self) -> None:
        """Finish the run, then wait for the process's W&B service to shut down: ``run.finish()`` can
        return before the service has written the run file's last records (seen under load)."""
        import wandb

        self.run.finish()
        wandb.teardown()
