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


# ---------------------------------------------------------------------------------------------------- folders
# A trainer checkpoint is a folder (format 2):
#   model.safetensors  the trainer's module weights (tensors only; a tensor sharing storage with an
#                      earlier one, e.g. tied embeddings, is stored once and listed in meta.json)
#   trainer.pt         optimiser, LR scheduler, policy version, the pipeline's ``extra`` and non-tensor
#                      module entries (``torch.load(weights_only=True)``)
#   meta.json          format, base model folder, strategy, weight naming (hf | peft | megatron), LoRA
# Format 1 (earlier releases) was one ``torch.save`` file holding all of it; it still loads.
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
META_FILE = "meta.json"
FORMAT = 2


def save_checkpoint_dir(
    path: str | os.PathLike[str],
    model_state: dict[str, Any],
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
) -> str:
    """Write a format-2 checkpoint folder; each file atomically, ``meta.json`` last (a folder without it
    is incomplete)."""
    import json

    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / META_FILE).unlink(missing_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    other: dict[str, Any] = {}
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            other[key] = value
            continue
        t = value.detach()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[key] = t.to("cpu").contiguous()
    tmp = folder / (MODEL_FILE + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, folder / MODEL_FILE)
    save_checkpoint_file({**trainer_state, "model_extra": other}, folder / TRAINER_FILE)
    meta_tmp = folder / (META_FILE + ".tmp")
    meta_tmp.write_text(json.dumps({"format": FORMAT, **meta, "aliases": aliases}, indent=1))
    os.replace(meta_tmp, folder / META_FILE)
    return str(folder)


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``meta.json`` of a checkpoint folder; ``{"format": 1}`` for an earlier release's single file."""
    import json

    p = Path(path)
    if p.is_file():
        return {"format": 1}
    if not (p / META_FILE).exists():
        raise FileNotFoundError(f"{p}: not a complete checkpoint (no {META_FILE}; the save was interrupted?)")
    meta = json.loads((p / META_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{p}: checkpoint format {meta.get('format')!r}, this rollart reads {FORMAT} and 1")
    return meta


def load_model_state(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """The module weights of a checkpoint folder (aliases restored) or of a format-1 file."""
    p = Path(path)
    if p.is_file():
        return load_checkpoint_file(p, map_location)["model"]
    from safetensors.torch import load_file

    meta = read_meta(p)
    device = str(map_location) if map_location is not None else "cpu"
    state: dict[str, Any] = load_file(str(p / MODEL_FILE), device=device)
    for key, source in meta.get("aliases", {}).items():
        state[key] = state[source]
    extra = load_checkpoint_file(p / TRAINER_FILE, map_location).get("model_extra", {})
    state.update(extra)
    return state


def load_checkpoint_any(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint as one dict (``model``, ``optimizer``, ``scheduler``, ``version``, ``extra``,
    ``meta``): a format-2 folder or a format-1 file. Nothing is unpickled beyond tensors and plain
    containers."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no checkpoint at {p}")
    if p.is_file():
        state = load_checkpoint_file(p, map_location)
        state["meta"] = {"format": 1}
        return state
    meta = read_meta(p)
    state = load_checkpoint_file(p / TRAINER_FILE, map_location)
    state.pop("model_extra", None)
    state["model"] = load_model_state(p, map_location)
    state["meta"] = meta
    return state


# ---------------------------------------------------------------------------------------------------- a run's checkpoints
LATEST_FILE = "latest"
LEGACY_FILE = "last.pt"


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """``root/step-00000012``: the folder of the checkpoint taken after ``step`` steps."""
    return Path(root) / f"step-{step:08d}"


def commit_checkpoint(root: str | os.PathLike[str], folder: str | os.PathLike[str], keep: int) -> list[Path]:
    """Point ``root/latest`` at ``folder`` (atomically), then keep ``folder`` and the ``keep - 1`` step
    folders before it and delete the others (also later steps left by an earlier run in the same
    directory); returns the deleted ones. A crash before the pointer moves leaves the previous one valid."""
    import shutil

    root_p = Path(root)
    tmp = root_p / (LATEST_FILE + ".tmp")
    tmp.write_text(Path(folder).name + "\n")
    os.replace(tmp, root_p / LATEST_FILE)
    current = Path(folder).name
    folders = sorted(p for p in root_p.glob("step-*") if p.is_dir())
    before = [p for p in folders if p.name < current]
    kept = {current, *(p.name for p in before[len(before) - (keep - 1) :] if keep > 1)}
    doomed = [p for p in folders if p.name not in kept]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``--resume`` starts from: the folder ``root/latest`` names, or an earlier
    release's ``root/last.pt``; None when there is none."""
    root_p = Path(root)
    pointer = root_p / LATEST_FILE
    if pointer.exists():
        folder = root_p / pointer.read_text().strip()
        if (folder / META_FILE).exists():
            return folder
    complete = sorted(p for p in root_p.glob("step-*") if (p / META_FILE).exists())
    if complete:
        return complete[-1]
    legacy = root_p / LEGACY_FILE
    return legacy if legacy.is_file() else None
