"""``rollart replay``: train a run's recorded batches again (the training side only, no rollout).

The run recorded every batch its trainer trained (``record_batches: true``,
:mod:`rollart.training.batch_record`). A replay builds the trainer the run built (its resolved
``train:`` config, one rank, in this process, with the run's thread count), starts from the initial
weights or from one of the run's checkpoints, trains the recorded batches of the following steps in their
order and writes a checkpoint folder in the run's own format: with the run's config it holds the weights
the run's checkpoint of that step holds (:func:`compare_checkpoints` says by how much they differ), and
``rollart run --resume`` can start from it. ``sets`` (``train.KEY=VALUE``) train the same data under
another loss, learning rate, ... : an offline ablation on a real run's data.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollart.cluster.batch import Batch

log = logging.getLogger(__name__)


class ReplayError(ValueError):
    """A replay that cannot run as asked; the message names what and the fix."""


@dataclass
class ReplayResult:
    out: Path
    """The checkpoint folder written."""
    start_step: int
    """Steps done before the first replayed one (0: from the initial weights)."""
    to: int
    version: int
    """The policy version written (the run's after step ``to``)."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """The trainer's metrics of each replayed step (loss, grad_norm, lr, ...)."""


def _checkpoint_arg(run_dir: Path, start: str | os.PathLike[str] | int | None) -> Path | None:
    """``--from``: a step number (the run's ``checkpoint/step-N``) or a checkpoint folder; None: the
    initial weights."""
    if start is None:
        return None
    from rollart.training.checkpoint_io import META_FILE, step_dir

    text = str(start)
    path = step_dir(run_dir / "checkpoint", int(text)) if text.isdigit() else Path(text)
    if not (path / META_FILE).is_file():
        have = sorted(p.name for p in (run_dir / "checkpoint").glob("step-*") if (p / META_FILE).is_file())
        raise ReplayError(
            f"--from {start}: {path} is not a complete checkpoint folder; give one of the run's checkpoints "
            f"({', '.join(have) or 'it has none'}) or leave --from out to start from the initial weights"
        )
    return path


def _train_config(recorded: Mapping[str, Any], sets: Mapping[str, Any]) -> Any:
    """The run's trainer config with ``sets`` (dotted ``train.*`` keys) over it."""
    from pydantic import ValidationError

    from rollart.config import ConfigError, _problem, set_dotted
    from rollart.training.config import TrainConfig

    raw: dict[str, Any] = json.loads(json.dumps(recorded))
    for dotted, value in sets.items():
        head, _, rest = dotted.partition(".")
        if head != "train" or not rest:
            raise ReplayError(
                f"--set {dotted}: a replay trains the recorded batches again, it changes only the trainer; "
                "give train.* keys (e.g. --set train.lr=0.002, --set train.loss=cispo). Rollout, data and "
                "advantage settings shaped the recorded batches: run again with them instead"
            )
        set_dotted(raw, rest, value)
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as err:
        problems = [_problem({**e, "loc": ("train", *e["loc"])}) for e in err.errors()]
        raise ConfigError("--set: " + "; ".join(dict.fromkeys(problems)), problems) from None


def _steps_to_train(root: Path, start_step: int, to: int) -> None:
    """Refuse a ``to`` past the record, or a record with a hole between ``start_step`` and ``to``."""
    from rollart.training.batch_record import recorded_steps

    if to < 1:
        raise ReplayError(f"--to {to}: steps count from 1 (as in metrics.jsonl and checkpoint/step-N)")
    steps = recorded_steps(root)
    if not steps:
        raise ReplayError(f"{root} holds no recorded batch (step-*.pt); the run stopped before its first step")
    if to > steps[-1]:
        raise ReplayError(
            f"--to {to}: the run recorded the batches of steps {steps[0]}..{steps[-1]} ({root}); give --to "
            f"{steps[-1]} or less"
        )
    if to <= start_step:
        raise ReplayError(f"--to {to}: the checkpoint given to --from is after step {start_step}; give a later --to")
    have = set(steps)
    missing = [s for s in range(start_step + 1, to + 1) if s not in have]
    if missing:
        before = max(missing)
        raise ReplayError(
            f"--to {to}: no recorded batch of step(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} in {root} "
            f"(the run recorded from step {steps[0]}: record_batches was off before?); replay from a checkpoint "
            f"taken at step {before} or later (--from STEP)"
        )


def replay(
    run_dir: str | os.PathLike[str],
    to: int,
    *,
    out: str | os.PathLike[str] | None = None,
    sets: Mapping[str, Any] | None = None,
    start: str | os.PathLike[str] | int | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> ReplayResult:
    """Train the recorded batches of ``run_dir`` through step ``to`` (counted from 1) from the initial
    weights (or the checkpoint ``start``: a step number or a folder) under the run's trainer config with
    ``sets`` over it, and write the checkpoint folder ``out`` (default ``RUN_DIR/replay/step-N``)."""
    from rollart.training import columns as C
    from rollart.training.batch_record import FOLDER, read_step
    from rollart.training.checkpoint_io import load_checkpoint_file, step_dir

    run = Path(run_dir)
    root = run / FOLDER
    trainer, cfg = _recorded_trainer(run, root, sets or {})
    ckpt = _checkpoint_arg(run, start)
    start_step = 0
    if ckpt is not None:
        start_step = int(load_checkpoint_file(ckpt / "trainer.pt")["extra"]["step"]) + 1
    _steps_to_train(root, start_step, to)
    target = Path(out) if out is not None else step_dir(run / "replay", to)
    if target.exists() and any(target.iterdir()):
        raise ReplayError(f"--out {target}: the folder exists and is not empty; remove it or give another --out")
    first = read_step(root, start_step + 1)
    if cfg.kl_coef > 0 and C.REF_LOGPROBS not in first[0]:
        raise ReplayError(
            f"train.kl_coef: {cfg.kl_coef}: the recorded batches hold no reference log-probs (the run trained "
            "with kl_coef 0); a replay cannot add a KL term, keep train.kl_coef: 0"
        )
    if trainer.get("critic"):
        log.warning("the run trained a critic (advantage: gae); replay trains the actor only (no critic.pt)")
    result = ReplayResult(out=target, start_step=start_step, to=to, version=0)
    _train_recorded(root, trainer, cfg, ckpt, first, result, on_step)
    (target / "replay.json").write_text(
        json.dumps(
            {
                "run_dir": str(run.resolve()),
                "from": str(ckpt) if ckpt is not None else None,
                "to": to,
                "sets": dict(sets or {}),
                "metrics": result.metrics,
            },
            indent=1,
        )
    )
    return result


def _recorded_trainer(run: Path, root: Path, sets: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """The run's recorded trainer and its config with ``sets`` over it; refuses a run without a record,
    or one that replay cannot reproduce (not one torch DDP rank)."""
    from rollart.training.batch_record import TRAINER_FILE, read_trainer

    if not (root / TRAINER_FILE).is_file():
        raise ReplayError(
            f"{run} holds no batch record ({root / TRAINER_FILE}); replay trains a run's recorded batches: run it "
            "with record_batches: true (rollart run CONFIG --set record_batches=true)"
        )
    trainer = read_trainer(root)
    cfg = _train_config(trainer["train"], sets)
    if cfg.strategy != "torch":
        raise ReplayError(f"train.strategy: {cfg.strategy}: replay trains with the torch strategy only")
    if cfg.sharding != "ddp":
        raise ReplayError(
            f"train.sharding: {cfg.sharding}: replay reproduces one-rank runs trained with train.sharding: ddp"
        )
    if int(trainer.get("ranks", 1)) != 1:
        raise ReplayError(
            f"{run} trained on {trainer['ranks']} ranks; replay trains on one rank in this process and reproduces "
            "one-rank runs only (a data-parallel run's gradient sums run in another order)"
        )
    return trainer, cfg


def _train_recorded(
    root: Path,
    trainer: Mapping[str, Any],
    cfg: Any,
    ckpt: Path | None,
    first: tuple[Batch, dict[str, Any]],
    result: ReplayResult,
    on_step: Callable[[int, dict[str, Any]], None] | None,
) -> None:
    """Train the steps of ``result`` (``first``: its first step's recorded batch) on one rank in this
    process, with the run's thread count, and save the checkpoint ``result.out``."""
    import torch

    from rollart.cluster.worker import WorkerContext, host_class
    from rollart.resource_manager.net import free_port
    from rollart.training.batch_record import read_step
    from rollart.training.torch_strategy import TorchTrainWorker

    start_step, to = result.start_step, result.to
    threads = torch.get_num_threads()
    torch.set_num_threads(int(trainer.get("threads", threads)))
    ctx = WorkerContext(cluster="replay", job_id="replay", rank=0, world_size=1, pool=None, hardware="CPU")
    worker: Any = None
    try:
        worker = host_class(TorchTrainWorker)(ctx, (), {"config": cfg.model_dump()})
        worker.setup_distributed("127.0.0.1", free_port())
        if ckpt is not None:
            worker.load_checkpoint(str(ckpt))  # with the replay's train.lr / weight_decay / betas (--set)
        info: dict[str, Any] = {}
        for step in range(start_step + 1, to + 1):
            batch, info = first if step == start_step + 1 else read_step(root, step)
            metrics = worker.train_step(batch) or {}
            result.metrics.append({"step": step, **metrics})
            if on_step is not None:
                on_step(step, metrics)
        result.version = int(info.get("version", worker.version))
        worker.set_version(result.version)
        worker.save_checkpoint(str(result.out), info.get("extra", {"step": to - 1}))
    finally:
        torch.set_num_threads(threads)


def compare_checkpoints(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> dict[str, float]:
    """The max absolute difference of each weight of two checkpoint folders (unsharded, format 2); a
    weight only one of them holds is a ValueError."""
    import torch

    from rollart.training.checkpoint_io import load_model_state

    sa, sb = load_model_state(a), load_model_state(b)
    tensors_a = {k: v for k, v in sa.items() if isinstance(v, torch.Tensor)}
    tensors_b = {k: v for k, v in sb.items() if isinstance(v, torch.Tensor)}
    if set(tensors_a) != set(tensors_b):
        only = sorted(set(tensors_a) ^ set(tensors_b))
        raise ValueError(f"{a} and {b} hold different weights: {only[:5]}")
    return {k: float((tensors_a[k].double() - tensors_b[k].double()).abs().max()) for k in sorted(tensors_a)}


__all__ = ["ReplayError", "ReplayResult", "compare_checkpoints", "replay"]
