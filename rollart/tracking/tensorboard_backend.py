"""TensorBoard event files in ``run_dir/tensorboard`` (extra ``tensorboard``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollart.tracking.base import flatten_metrics


class TensorBoardTracker:
    def __init__(self, run_dir: Path, *, run_name: str = "", config: dict | None = None, resume: bool = False):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in flatten_metrics(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
