"""Experiment tracking: one :class:`Tracker` interface, several backends.

``tracking: [jsonl, tensorboard, wandb, mlflow]`` in a pipeline config picks them (default ``[jsonl]``).

- ``jsonl``: ``RUN_DIR/metrics.jsonl``, one JSON object per step, nested as the pipeline records it.
- ``tensorboard`` (extra ``tensorboard``): event files in ``RUN_DIR/tensorboard``.
- ``wandb`` (extra ``wandb``): an offline Weights & Biases run in ``RUN_DIR/wandb``
  (``wandb sync`` uploads it later; ``WANDB_MODE=online`` in the environment logs online instead).
- ``mlflow`` (extra ``mlflow``): an MLflow run in the file store ``RUN_DIR/mlruns`` (or
  ``$MLFLOW_TRACKING_URI``), experiment = the pipeline's name.

The JSONL backend keeps the record as it is; the others get it flattened into scalar keys joined by
``/`` (``reward_by_tag/reverse-3``, ``train/entropy``, ``credit_by_position/reverse-3/0``), so the
metrics of every task stay separate series.
"""

from rollart.tracking.base import (
    TRACKERS,
    MultiTracker,
    Tracker,
    TrackerName,
    flatten_metrics,
    make_tracker,
)
from rollart.tracking.jsonl import JsonlTracker

__all__ = ["TRACKERS", "JsonlTracker", "MultiTracker", "Tracker", "TrackerName", "flatten_metrics", "make_tracker"]
