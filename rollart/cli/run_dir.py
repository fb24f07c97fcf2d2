"""The output folder of ``rollart run``: whether a run may start in it, and holding it while it runs.

A new run never mixes with another run's outputs. A folder is free when it does not exist, is empty, or
holds only what a run writes before its end (:data:`PARTIAL_RUN`: its log, job id, metrics, ledger, an
empty checkpoint folder) and no checkpoint: the outputs of a run that stopped or failed before its first
checkpoint, which nothing can continue. Such a folder is cleared and reused. A folder with a checkpoint,
a finished run (``summary.json``, ``hf/``, ``metrics.png``) or files rollart does not write needs
``--resume`` (continue it; it needs a checkpoint) or ``--overwrite`` (replace it). While a run runs it
holds a lock on ``RUN_DIR/.rollart.lock``, so a second ``rollart run`` into the same folder is refused
instead of clearing or replacing it underneath.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import IO

from rollart.cli.output import RUN_LOG

LOCK = ".rollart.lock"
SUMMARY = "summary.json"
"""Written when a run finished: its summary (``rollart run --json`` prints the same)."""
PARTIAL_RUN = frozenset(
    {
        LOCK,
        RUN_LOG,
        "job_id",
        "metrics.jsonl",
        "startup.json",
        "ledger.json",
        "traces.jsonl",
        "elastic.jsonl",
        "checkpoint",
        "tensorboard",
        "wandb",
        "mlruns",
    }
)
"""What a run writes before it ends: a folder with nothing else and no checkpoint holds nothing to keep."""


def has_checkpoint(out_dir: Path) -> bool:
    """Whether ``out_dir/checkpoint`` holds a complete checkpoint (``--resume`` starts from it)."""
    root = out_dir / "checkpoint"
    if not root.is_dir() or not any(root.iterdir()):
        return False
    from rollart.training.checkpoint_io import latest_checkpoint  # imports torch: only for a folder with files

    return latest_checkpoint(root) is not None


def stale_partial_run(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds only the outputs of a run that ended before its first checkpoint."""
    if not out_dir.is_dir():
        return False
    names = {p.name for p in out_dir.iterdir()}
    return bool(names) and names <= PARTIAL_RUN and not has_checkpoint(out_dir)


def lock_holder(out_dir: Path) -> int | None:
    """The pid of the run that holds ``out_dir`` now (its lock), else None."""
    path = out_dir / LOCK
    if not path.exists():
        return None
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def hold(out_dir: Path) -> IO[str] | None:
    """Take the folder's lock for this process (released when it exits); the open lock file, to keep."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        return None
    f = open(out_dir / LOCK, "a+")  # noqa: SIM115 - kept open while the run runs
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def run_dir_problem(out_dir: Path, *, resume: bool, overwrite: bool, command: str) -> str | None:
    """Why a run cannot start in ``out_dir`` with these flags (None: it can); see the module doc."""
    if resume and overwrite:
        return "--resume and --overwrite exclude each other: continue the run in the folder, or replace it"
    holder = lock_holder(out_dir)
    if holder is not None:
        who = f" (pid {holder})" if holder > 0 else ""
        return (
            f"the output folder {out_dir} is in use by a run that is still going{who}; wait for it or stop it, "
            "or give this run its own folder (--set output_dir=runs/NEW)"
        )
    used = out_dir.is_dir() and any(out_dir.iterdir())
    if resume:
        if not used:
            return f"--resume: {out_dir} holds no run to continue; run without --resume"
        if has_checkpoint(out_dir):
            return None
        if stale_partial_run(out_dir):
            return (
                f"--resume: {out_dir} holds no checkpoint: its run stopped before the first one "
                f"(checkpoint_every), so there is nothing to continue; start it again with `{command}` "
                "(a folder without a checkpoint is reused)"
            )
        return (
            f"--resume: {out_dir} holds no checkpoint to continue from; start again with `{command} --overwrite` "
            "(it deletes the folder first), or give this run its own folder (--set output_dir=runs/NEW)"
        )
    if used and not overwrite and not stale_partial_run(out_dir):
        return (
            f"the output folder {out_dir} holds an earlier run; continue it with `{command} --resume`, "
            f"replace it with `{command} --overwrite`, or give this run its own folder "
            "(--set output_dir=runs/NEW)"
        )
    return None


def clear(out_dir: Path) -> None:
    """Empty ``out_dir`` (a replaced run, or a partial one being reused); the folder and its lock stay."""
    for entry in out_dir.iterdir():
        if entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
