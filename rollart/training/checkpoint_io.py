"""Checkpoint files: written with ``torch.save``, read back without unpickling arbitrary objects.

A checkpoint holds tensors, dicts, lists, tuples, strings, numbers, bools and ``None`` only (model,
optimiser and LR-scheduler state dicts, the policy version, the pipeline's ``extra``), so it loads with
``torch.load(weights_only=True)``: a file that carries any other pickled object (a class instance, a
function reference, ``os.system``) is refused instead of executed.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch


class UnsafeCheckpointError(ValueError):
    """The checkpoint holds pickled objects other than tensors and plain containers."""


def save_checkpoint_file(state: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Write ``state`` atomically (a crash mid-write never leaves a torn file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, target)
    return str(target)


def load_checkpoint_file(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``; refuse one that needs arbitrary unpickling."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{path}: refused to load, it holds objects other than tensors and plain containers "
            f"(torch.load weights_only=True): {str(err).splitlines()[0]}"
        ) from None
    if not isinstance(state, dict):
        raise UnsafeCheckpointError(f"{path}: a checkpoint is a dict, got {type(state).__name__}")
    return state
