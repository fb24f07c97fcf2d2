"""Where a pipeline's checkpoints live (``RUN_DIR/checkpoint/step-N``) and how one is written: the
critic's state first, then the trainer's (with the pipeline's own state as its ``extra``), then
``latest`` points at it and all but the newest ``checkpoint_keep`` folders are deleted. The pipeline's own
state in a checkpoint (:func:`pipeline_extra`, :func:`restore_pipeline_extra`) is its parts' state dicts: the
scheduler's, the data samplers' and the running-mean baseline's."""

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


def pipeline_extra(step: int, scheduler: Any, data_tasks: Any, baseline: Any) -> dict[str, Any]:
    """The pipeline's side of a checkpoint after ``step``: the scheduler's state (the consumed rounds: per
    group a watermark and a small set), the data samplers and the running-mean baseline."""
    extra: dict[str, Any] = {"step": step, "scheduler": scheduler.state_dict()}
    if data_tasks.samplers:
        extra["data"] = data_tasks.state_dict()
    if baseline is not None:
        extra["running_mean"] = baseline.state_dict()
    return extra


def restore_pipeline_extra(
    extra: dict[str, Any],
    *,
    scheduler: Any,
    data_tasks: Any,
    baseline: Any,
    critic: Any,
    critic_path: Path,
    source: Path,
) -> int:
    """Load :func:`pipeline_extra`'s ``extra`` (from the checkpoint ``source``) into the scheduler (next
    rounds, consumed rounds), the data samplers, the running-mean baseline and the critic (which must come
    from the same save); returns the step the run goes on from."""
    scheduler.load_state_dict(extra["scheduler"])
    if "consumed" in extra and "settled" not in extra["scheduler"]:  # older checkpoints: a list of ids
        scheduler.settled.load_state_dict(extra["consumed"])
    if data_tasks.samplers:
        data_tasks.load_state_dict(extra.get("data", {}))
    if baseline is not None:
        if "running_mean" not in extra:
            raise ValueError(
                f"--resume: {source} holds no running-mean baseline (it was written "
                "with another advantage); resume with the advantage it was trained with"
            )
        baseline.load_state_dict(extra["running_mean"])
    if critic is not None:
        if not critic_path.exists():
            raise FileNotFoundError(
                f"--resume with advantage: gae: no critic checkpoint at {critic_path}; the run was not trained "
                "with a critic"
            )
        critic_state = critic.load_checkpoint(str(critic_path))[0]
        if critic_state["step"] != int(extra["step"]):
            raise ValueError(
                f"--resume: the critic checkpoint is from step {critic_state['step']}, the actor's "
                f"from step {extra['step']}; they must come from the same save"
            )
    return int(extra["step"]) + 1
