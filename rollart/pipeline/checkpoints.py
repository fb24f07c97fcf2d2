"""Where a pipeline's checkpoints live (``RUN_DIR/checkpoint/step-N``) and how one is written: the
critic's state first, then the trainer's (with the pipeline's own state as its ``extra``), then
``latest`` points at it and all but the newest ``checkpoint_keep`` folders are deleted."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Checkpoints:
    """The checkpoints under ``out_dir / "checkpoint"``, keeping the newest ``keep``."""

    def __init__(self, out_dir: Path, keep: int):
        self.root = out_dir / "checkpoint"
        self.keep = keep

    @property
    def path(self) -> Path:
        """The checkpoint ``--resume`` starts from: the newest ``checkpoint/step-N`` folder (an earlier
        release's ``checkpoint/last.pt`` file is read too)."""
        from rollart.training.checkpoint_io import LEGACY_FILE, latest_checkpoint

        return latest_checkpoint(self.root) or self.root / LEGACY_FILE

    def latest(self) -> Path | None:
        """The newest checkpoint, None before the first."""
        from rollart.training.checkpoint_io import latest_checkpoint

        return latest_checkpoint(self.root)

    @staticmethod
    def critic_path(ckpt: Path) -> Path:
        """The critic's file of the checkpoint ``ckpt`` (a folder, or an earlier release's file)."""
        return ckpt / "critic.pt" if ckpt.is_dir() else ckpt.with_name("critic.pt")

    async def save(self, step: int, extra: dict[str, Any], train: Any, critic: Any = None) -> None:
        """``checkpoint/step-N`` (N = steps done) of the trainer Cluster ``train`` (and ``critic``)."""
        from rollart.training.checkpoint_io import commit_checkpoint, step_dir

        folder = step_dir(self.root.resolve(), step + 1)
        if critic is not None:
            await critic.save_checkpoint(str(folder / "critic.pt"), step, blocking=False)
        await train.save_checkpoint(str(folder), extra, blocking=False)
        commit_checkpoint(self.root, folder, self.keep)
