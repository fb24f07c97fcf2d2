"""The tokens of a trained trajectory, read from the run's batch record (``record_batches: true``,
:mod:`rollart.training.batch_record`): each token's id and text (decoded with the run's tokenizer), its
behaviour log-prob, loss mask and policy version, and the row's reward and advantages.

A trajectory's ``trained`` trace event names its step, so one step file is read for it (with
``torch.load(weights_only=True)``); the newest :data:`STEPS_KEPT` steps read stay in memory with their
``traj_id`` → row index. The tokenizer (the model folder of ``batches/trainer.json``) is loaded once, on
the first trajectory shown; when it cannot be loaded the tokens are shown as ids.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STEPS_KEPT = 4
"""Step files kept in memory (a step's batch can be large; the record is read a step at a time)."""
TOKENS_NOTE = "tokens are recorded for trained trajectories with record_batches: true"
"""What the trajectory page says where it has no tokens to show."""
FOLDER, TRAINER_FILE = "batches", "trainer.json"
"""The record's folder and its trainer file, as :mod:`rollart.training.batch_record` names them (which
imports torch: the viewer starts without it, and imports it when it first reads a step file)."""
_UNLOADED = object()


class BatchTokens:
    """The batch record under ``run_dir/batches`` as the viewer reads it; safe across threads (one lock)."""

    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / FOLDER
        self._lock = threading.Lock()
        self._steps: OrderedDict[int, tuple[Any, dict[str, int]]] = OrderedDict()  # step -> (batch, traj_id -> row)
        self._stamps: dict[int, tuple[int, int]] = {}  # step -> (size, mtime) of the file read
        self._tokenizer: Any = _UNLOADED  # then a decoder of id lists (None: it could not be loaded)
        self._tokenizer_error: str | None = None
        self._texts: dict[int, str] = {}

    def recorded(self) -> bool:
        """Whether the run folder holds a batch record."""
        return (self.root / TRAINER_FILE).is_file()

    def tokens(self, traj_id: str, step: int | None) -> dict[str, Any] | None:
        """The trained row of ``traj_id`` in ``step``'s batch, or None when the record does not hold it."""
        if step is None or not self.recorded():
            return None
        with self._lock:
            found = self._step(step)
            if found is None:
                return None
            batch, index = found
            row = index.get(traj_id)
            if row is None:
                return None
            return self._row(batch, row, step)

    # --------------------------------------------------------------------------------------- reading
    def _step(self, step: int) -> tuple[Any, dict[str, int]] | None:
        from rollart.training import columns as C
        from rollart.training.batch_record import read_step, step_file

        try:  # a step recorded again (a run resumed from an earlier checkpoint) is read again
            st = step_file(self.root, step).stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_size, st.st_mtime_ns)
        if step in self._steps and self._stamps.get(step) == stamp:
            self._steps.move_to_end(step)
            return self._steps[step]
        try:
            batch, _ = read_step(self.root, step)
        except Exception as err:  # a file cut short or written by another version: no tokens (logged)
            log.warning("rollart view: cannot read the batch record of step %d in %s: %s", step, self.root, err)
            return None
        ids = batch.get(C.TRAJ_ID, [])
        found = (batch, {str(t): r for r, t in enumerate(ids)})
        self._steps[step], self._stamps[step] = found, stamp
        self._steps.move_to_end(step)
        while len(self._steps) > STEPS_KEPT:
            self._stamps.pop(self._steps.popitem(last=False)[0], None)
        return found

    def _row(self, batch: Any, r: int, step: int) -> dict[str, Any]:
        from rollart.training import columns as C

        def cell(name: str) -> Any:
            if name not in batch:
                return None
            value = batch[name][r]
            return value.tolist() if hasattr(value, "tolist") else value

        ids = [int(x) for x in cell(C.INPUT_IDS) or []]
        text, error = self._decode(ids)
        return {
            "step": step,
            "row": r,
            "token_ids": ids,
            "text": text,
            "logprobs": cell(C.BEHAVIOUR_LOGPROBS),
            "loss_mask": cell(C.LOSS_MASK),
            "versions": cell(C.VERSIONS),
            "advantages": cell(C.ADVANTAGES),
            "token_rewards": cell(C.TOKEN_REWARDS),
            "reward": cell(C.REWARDS),
            "tokenizer_error": error,
        }

    # -------------------------------------------------------------------------------------- decoding
    def _load_tokenizer(self) -> None:
        """The run's tokenizer: its ``tokenizer.json`` through ``tokenizers`` (quick to import), else
        ``AutoTokenizer`` from the model folder (local files only: nothing is downloaded)."""
        from rollart.training.batch_record import read_trainer

        self._tokenizer = None
        try:
            model = str(read_trainer(self.root)["train"]["model"])
            if Path(model).is_absolute() and not Path(model).is_dir():
                raise FileNotFoundError(f"the model folder {model} is not there (moved or deleted since the run?)")
            if (Path(model) / "tokenizer.json").is_file():
                from tokenizers import Tokenizer

                fast = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
                self._tokenizer = lambda seqs: fast.decode_batch(seqs, skip_special_tokens=False)
            else:
                from transformers import AutoTokenizer

                slow = AutoTokenizer.from_pretrained(model, local_files_only=True)
                self._tokenizer = lambda seqs: slow.batch_decode(
                    seqs, skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
        except Exception as err:  # a moved or deleted model folder: the ids are still shown
            self._tokenizer_error = f"the run's tokenizer could not be loaded ({err}); token ids shown"
            log.warning("rollart view: %s", self._tokenizer_error)

    def _decode(self, ids: list[int]) -> tuple[list[str] | None, str | None]:
        """Each token's text (special tokens included), or None and why."""
        if self._tokenizer is _UNLOADED:
            self._load_tokenizer()
        if self._tokenizer is None:
            return None, self._tokenizer_error
        new = sorted({i for i in ids if i not in self._texts})
        if new:
            self._texts.update(zip(new, (str(t) for t in self._tokenizer([[i] for i in new]))))
        return [self._texts[i] for i in ids], None


__all__ = ["STEPS_KEPT", "TOKENS_NOTE", "BatchTokens"]
