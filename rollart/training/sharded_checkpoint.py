"""Checkpoints of a sharded trainer (``train.sharding: fsdp``) with ``torch.distributed.checkpoint``.

Each rank writes its own shards of the model and of the AdamW states; no rank gathers the model to save.
The folder holds what an unsharded checkpoint holds (:mod:`rollart.training.checkpoint_io`), with the
weights and optimiser in ``shards/`` instead of ``model.safetensors``::

    shards/          DCP files: every rank's pieces and ``.metadata`` (global shapes, who holds what)
    trainer.pt       LR scheduler, policy version, the pipeline's ``extra``
    meta.json        format 2, base model, ``"shards": "dcp"`` and the layout that wrote it
                     (``{"sharding": "fsdp", "tensor_parallel": N, "ranks": R}``), written last

Loading reads each rank's part of the saved global tensors, whatever the layout now: a checkpoint of 4
ranks resumes on 2 (or 8), and one of ``tensor_parallel: 2`` on 1. A checkpoint of an unsharded trainer
cannot resume a sharded one, nor the other way: the error names ``train.sharding``.

:func:`iter_checkpoint_weights` reads the weights of such a folder in one process without a process
group, a bounded number of bytes at a time (``rollart export``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rollart.training.checkpoint_io import FORMAT, META_FILE, TRAINER_FILE, save_checkpoint_file

SHARDS_DIR = "shards"
SHARDS_KIND = "dcp"


def is_sharded_checkpoint(meta: dict[str, Any]) -> bool:
    return meta.get("shards") == SHARDS_KIND


def save_sharded(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
) -> str:
    """Every rank writes its shards of ``model`` and ``optimizer`` into ``path/shards``; rank 0 then writes
    ``trainer.pt`` and ``meta.json`` (last: a folder without it is incomplete). Collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(path)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / META_FILE).unlink(missing_ok=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / SHARDS_DIR))
    if rank == 0:
        save_checkpoint_file({**trainer_state, "model_extra": {}}, folder / TRAINER_FILE)
        tmp = folder / (META_FILE + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, **meta, "shards": SHARDS_KIND}, indent=1))
        os.replace(tmp, folder / META_FILE)
    dist.barrier()
    return str(folder)


def load_sharded(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read this rank's part of the saved model and optimiser states into ``model`` and ``optimizer``
    (resharded from the layout that wrote them). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(Path(path) / SHARDS_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _model_tensors(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{name: TensorStorageMetadata}`` of the model weights a sharded checkpoint holds (global shapes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(Path(path) / SHARDS_DIR)).read_metadata()
    prefix = "model."
    return {
        key[len(prefix) :]: md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


def iter_checkpoint_weights(
    path: str | os.PathLike[str], bucket_bytes: int, skip: set[str] | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The whole weights of a sharded checkpoint, in the saved order, a bucket of at most ``bucket_bytes``
    (or one tensor) at a time, read in this process alone (no process group); ``skip`` names left out."""
    import torch.distributed.checkpoint as dcp

    tensors = [(k, md) for k, md in _model_tensors(path).items() if k not in (skip or set())]
    bucket: dict[str, torch.Tensor] = {}
    size = 0

    def read(names: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = {"model": names}
        dcp.load(state, checkpoint_id=str(Path(path) / SHARDS_DIR), no_dist=True)
        return state["model"]

    for name, md in tensors:
        nbytes = md.size.numel() * md.properties.dtype.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield read(bucket)
            bucket, size = {}, 0
        bucket[name] = torch.empty(md.size, dtype=md.properties.dtype)
        size += nbytes
    if bucket:
        yield read(bucket)


__all__ = ["is_sharded_checkpoint", "iter_checkpoint_weights", "load_sharded", "save_sharded"]
