"""``metrics.jsonl``: one JSON object per step, the record as the pipeline built it (nested)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class JsonlTracker:
    """Appends to ``run_dir/metrics.jsonl``; a fresh (not resumed) run starts the file anew."""

    def __init__(self, run_dir: Path, *, run_name: str = "", config: dict | None = None, resume: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        record = dict(metrics) if "step" in metrics else {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass
