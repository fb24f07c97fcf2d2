"""The batch record of a run (``record_batches: true``): every training batch exactly as the trainer got
it, one file per step, for ``rollart replay`` (:mod:`rollart.pipeline.replay`).

``RUN_DIR/batches/``:

* ``trainer.json``: the trainer's config as the run resolved it (model folder, loss, lr, seed, ...), its
  number of ranks and the run's name; written when the run starts.
* ``step-00000012.pt``: the batch of step 12 (steps count from 1), written after the step's train call
  was sent, by a background thread (the step loop only hands the batch over): its columns (token ids,
  loss masks, behaviour and reference log-probs, advantages, rewards, versions, trajectory ids, ...) in
  the order the trainer trained them, the trainer's policy version after the step, and the pipeline's
  side of a checkpoint taken after it (what makes a replayed checkpoint resumable).

Lossless: a per-token column is stored as one flat tensor plus row lengths, its integers in the smallest
integer type that holds them, its floats as float32 only where every value survives the round trip
(else float64); a column of anything else (strings, ids) as a plain list. A step file is read with
``torch.load(weights_only=True)``: nothing in it is unpickled beyond tensors and plain containers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rollart.cluster.batch import Batch

log = logging.getLogger(__name__)

FOLDER = "batches"
TRAINER_FILE = "trainer.json"
FORMAT = 1


def step_file(root: str | os.PathLike[str], step: int) -> Path:
    """``root/step-00000012.pt``: the batch of step 12 (steps count from 1)."""
    return Path(root) / f"step-{step:08d}.pt"


def recorded_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps whose batch is recorded under ``root``, ascending."""
    out = []
    for p in Path(root).glob("step-*.pt"):
        try:
            out.append(int(p.stem.removeprefix("step-")))
        except ValueError:
            continue
    return sorted(out)


# ---------------------------------------------------------------------------------------------- columns
def _int_dtype(lo: int, hi: int) -> torch.dtype:
    for dtype in (torch.int8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype
    return torch.int64


def _numbers(values: list[Any]) -> torch.Tensor:
    """``values`` (Python ints or floats) as the smallest tensor that gives them back exactly."""
    if all(type(v) is int for v in values):
        t = torch.tensor(values, dtype=torch.int64)
        return t.to(_int_dtype(int(t.min()), int(t.max()))) if t.numel() else t
    t = torch.tensor(values, dtype=torch.float64)
    small = t.to(torch.float32)
    same = torch.equal(small.to(torch.float64), t) or bool(
        ((small.to(torch.float64) == t) | (t.isnan() & small.isnan())).all()
    )
    return small if same else t


def _is_number(v: Any) -> bool:
    return type(v) in (int, float)


def encode_column(col: Any) -> dict[str, Any]:
    """One batch column in the record's form (see the module docstring)."""
    if isinstance(col, torch.Tensor):
        return {"kind": "tensor", "data": col.detach().cpu().clone()}
    rows = list(col)
    ragged = rows and all(r is None or (isinstance(r, (list, tuple)) and all(map(_is_number, r))) for r in rows)
    if ragged:
        flat = [v for r in rows if r is not None for v in r]
        lengths = torch.tensor([-1 if r is None else len(r) for r in rows], dtype=torch.int64)
        return {"kind": "ragged", "values": _numbers(flat), "lengths": lengths}
    return {"kind": "plain", "data": rows}


def decode_column(enc: dict[str, Any]) -> Any:
    """The column :func:`encode_column` recorded, as the pipeline built it (lists of Python numbers)."""
    kind = enc["kind"]
    if kind == "tensor":
        return enc["data"]
    if kind == "plain":
        return list(enc["data"])
    if kind != "ragged":
        raise ValueError(f"unknown column kind {kind!r} in a batch record (written by a newer rollart?)")
    flat = enc["values"].tolist()
    out: list[Any] = []
    at = 0
    for n in enc["lengths"].tolist():
        if n < 0:
            out.append(None)
            continue
        out.append(flat[at : at + n])
        at += n
    return out


def encode_batch(batch: Batch) -> dict[str, Any]:
    return {"columns": {k: encode_column(v) for k, v in batch.data.items()}, "meta": dict(batch.meta)}


def decode_batch(state: dict[str, Any]) -> Batch:
    return Batch({k: decode_column(v) for k, v in state["columns"].items()}, meta=state.get("meta", {}))


# ---------------------------------------------------------------------------------------------- files
def write_step(root: str | os.PathLike[str], step: int, batch: Batch, info: dict[str, Any]) -> Path:
    """``root/step-N.pt`` (atomically): ``batch`` and ``info`` (the version after the step, the checkpoint
    side of the pipeline)."""
    from rollart.training.checkpoint_io import save_checkpoint_file

    path = step_file(root, step)
    save_checkpoint_file({"format": FORMAT, "step": step, **info, "batch": encode_batch(batch)}, path)
    return path


def read_step(root: str | os.PathLike[str], step: int) -> tuple[Batch, dict[str, Any]]:
    """The batch of ``step`` and its info (``version``, ``extra``); FileNotFoundError when not recorded."""
    from rollart.training.checkpoint_io import load_checkpoint_file

    path = step_file(root, step)
    if not path.is_file():
        raise FileNotFoundError(path)
    state = load_checkpoint_file(path)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: batch record format {state.get('format')!r}, this rollart reads {FORMAT}")
    batch = decode_batch(state.pop("batch"))
    return batch, state


def write_trainer(root: str | os.PathLike[str], info: dict[str, Any]) -> Path:
    path = Path(root) / TRAINER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **info}, indent=1, default=str))
    os.replace(tmp, path)
    return path


def read_trainer(root: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(root) / TRAINER_FILE
    return dict(json.loads(path.read_text()))


class BatchRecorder:
    """Writes a run's batch record off the step loop: :meth:`record` hands a step's batch to one background
    thread (steps are written in order); :meth:`close` waits for every write. A write that fails is logged
    and raised at the next :meth:`record` or :meth:`close` (a record with a hole would not replay)."""

    def __init__(self, out_dir: Path, trainer: dict[str, Any], *, keep_through: int = 0):
        self.root = Path(out_dir) / FOLDER
        self.root.mkdir(parents=True, exist_ok=True)
        self._pool: ThreadPoolExecutor | None = None  # started by the first record, ended by close
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self.bytes_written = 0
        # a fresh run (0) or a resumed one (its checkpoint's step): the steps after it are trained again
        self.drop_after(keep_through)
        write_trainer(self.root, trainer)

    def _write(self, step: int, batch: Batch, info: dict[str, Any]) -> None:
        path = write_step(self.root, step, batch, info)
        self.bytes_written += path.stat().st_size

    def _raise_failed(self, futures: Sequence[Future]) -> None:
        for f in futures:
            err = f.exception()
            if err is not None:
                raise RuntimeError(f"record_batches: writing {self.root} failed: {err}") from err

    def record(self, step: int, batch: Batch, info: dict[str, Any]) -> None:
        """Write ``batch`` of ``step`` (counted from 1) in the background; the caller must not change the
        batch afterwards (the pipeline never does)."""
        with self._lock:
            done = [f for f in self._pending if f.done()]
            self._pending = [f for f in self._pending if not f.done()]
        self._raise_failed(done)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-record")
        fut = self._pool.submit(self._write, step, batch, info)
        with self._lock:
            self._pending.append(fut)

    def drop_after(self, step: int) -> None:
        """Delete the record of the steps after ``step`` (a resume or a trainer restore trains them again,
        maybe fewer of them: an older step file past the run's last would not be this run's)."""
        self.close()
        for s in recorded_steps(self.root):
            if s > step:
                step_file(self.root, s).unlink(missing_ok=True)

    def close(self) -> None:
        """Wait for every write (the end of the steps; a later :meth:`record` starts writing again, e.g.
        after a trainer restore); raise the first that failed."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            pending, self._pending = self._pending, []
        self._raise_failed(pending)


__all__ = [
    "FOLDER",
    "BatchRecorder",
    "decode_batch",
    "encode_batch",
    "read_step",
    "read_trainer",
    "recorded_steps",
    "step_file",
    "write_step",
]
