"""Colocated (time-shared) mode: one worker per trainer rank that holds both the rank's training strategy
and an inference engine loop, on the same devices (the "hybrid engine" layout of other RL frameworks).

The pipeline's config says ``pools: {rollout: {colocate_with: train}}``; its Cluster of these workers
is both the trainer (``train_step`` and the rest of the strategy's methods) and the inference Cluster the
LLMProxy routes ``generate`` to by tag. One step, on every rank:

1. the engine generates (the rollout) while the trainer holds nothing but its weights and optimiser;
2. :meth:`ColocatedRank.sleep_engine` (between two engine steps, every request in flight preempted with
   its tokens): the engine frees its KV cache (``engine.sleep_level`` 2: its weights too);
3. ``train_step`` (refused while the engine is awake);
4. :meth:`ColocatedRank.wake_engine`: the engine takes the device again and loads the trainer's
   weights from this process (the module's own tensors: a copy on the device, no snapshot, no object
   store, no network), then serves the new version.

Only one process per device: both halves share its CUDA context and torch's caching allocator, so the
memory the engine frees is what the trainer's step allocates. Each rank keeps the record of its step
(:class:`PhaseLog`): when its engine generated, when it trained and slept, and what the engine held
(``kv_cache_bytes`` while training), which the pipeline writes to ``metrics.jsonl``. Times are the rank's
``time.monotonic()`` (system-wide on Linux; compare them within a rank).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollart.cluster.batch import Batch
from rollart.decorators.register import register
from rollart.decorators.specs import Dispatch
from rollart.engines.base import RequestOutput
from rollart.rollout.config import EngineConfig
from rollart.rollout.inference_worker import InferenceWorker, inference_worker_class
from rollart.training.placement import DP_SPLIT_EVERY_RANK
from rollart.training.strategies import train_worker_class
from rollart.training.torch_strategy import TorchTrainWorker


@dataclass
class PhaseLog:
    """One rank's record of a step, from one wake-up to the next."""

    generate: list[list[float]] = field(default_factory=list)
    """Spans of engine steps: ``[start of the first, end of the last]`` of each run of steps."""
    train: list[list[float]] = field(default_factory=list)
    """Spans of ``train_step`` calls."""
    asleep: list[float] = field(default_factory=list)
    """``[fell asleep, woke]``."""
    sleep_s: float = 0.0
    wake_s: float = 0.0
    engine_generating: dict[str, Any] | None = None
    """The engine's memory just before it slept (its KV cache peak of the rollout)."""
    engine_asleep: dict[str, Any] | None = None
    """Its memory right after it slept."""
    engine_training: dict[str, Any] | None = None
    """Its memory when the (last) train step began."""


class ColocatedRank:
    """Mixin of the colocated worker: ``colocated_worker_class`` puts it before a training strategy class
    and an :class:`InferenceWorker` class (``_train_base``, ``_infer_base``)."""

    _train_base: type[TorchTrainWorker]
    _infer_base: type[InferenceWorker]
    engine: Any
    rank: int
    _resumed: Any

    def __init__(self, config: Mapping[str, Any] | None = None, engine: Mapping[str, Any] | None = None):
        self._train_base.__init__(self, config)  # type: ignore[arg-type]
        engine_cfg = EngineConfig.model_validate(engine or {})
        self._infer_base.__init__(self, engine_cfg, colocated=True)  # type: ignore[arg-type]
        self.sleep_level = engine_cfg.sleep_level
        self._log = PhaseLog()
        self._open: list[float] | None = None  # the run of engine steps going on
        self._log_lock = threading.Lock()  # engine steps are timed in the loop's step thread

    # ------------------------------------------------------------------ the record
    def _step_engine(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        try:
            return self._infer_base._step_engine(self)  # type: ignore[arg-type]
        finally:
            t1 = time.monotonic()
            with self._log_lock:
                if self._open is None:
                    self._open = [t0, t1]
                    self._log.generate.append(self._open)
                else:
                    self._open[1] = t1

    def _close_run(self) -> None:
        with self._log_lock:
            self._open = None

    # ------------------------------------------------------------------ device hand-over
    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def sleep_engine(self) -> dict[str, Any]:
        """Hand the device to the trainer: new requests are held, the ones in flight are preempted (their
        callers get the tokens so far), then the engine sleeps at ``engine.sleep_level``. Returns what
        the engine holds asleep."""
        self._infer_base._ensure_loop(self)  # type: ignore[arg-type]
        self._resumed.clear()

        def fall_asleep() -> dict[str, Any]:
            if self.engine.sleep_level:  # asleep already: the record keeps when it fell asleep
                return dataclasses.asdict(self.engine.memory())
            self._close_run()
            before = dataclasses.asdict(self.engine.memory())
            t0 = time.monotonic()
            self.engine.sleep(self.sleep_level)
            t1 = time.monotonic()
            self._log.asleep = [t1]
            self._log.sleep_s = t1 - t0
            self._log.engine_generating = before
            self._log.engine_asleep = dataclasses.asdict(self.engine.memory())
            return self._log.engine_asleep

        return await self._infer_base._between_steps(self, fall_asleep)  # type: ignore[arg-type]

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def wake_engine(self, version: int) -> dict[str, Any]:
        """Take the device back: the engine wakes and loads this rank's trainer weights, in this process,
        as ``version`` (awake already, e.g. before a resumed run's first step: it only loads them).
        Requests stay held until the rollout resumes. Returns this rank's :class:`PhaseLog` of the step."""

        def wake() -> dict[str, Any]:
            t0 = time.monotonic()
            if self.engine.sleep_level and torch.cuda.is_available():
                torch.cuda.empty_cache()  # the trainer's freed blocks back to the device (vLLM allocates outside torch)
            self.engine.wake_up(self.engine_weights(), version)
            t1 = time.monotonic()
            log, self._log = self._log, PhaseLog()
            self._close_run()
            if log.asleep:
                log.asleep.append(t1)
                log.wake_s = t1 - t0
            return {"rank": self.rank, **dataclasses.asdict(log)}

        return await self._infer_base._between_steps(self, wake)  # type: ignore[arg-type]

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The trainer's weights as the engine loads them (Hugging Face names): the module's own tensors,
        on its device (a LoRA model's adapters merged in first)."""
        return self.publish_state()  # type: ignore[attr-defined]

    @register(dispatch=DP_SPLIT_EVERY_RANK)
    def train_step(self, batch: Batch) -> dict[str, float] | None:
        """The strategy's ``train_step``, only while this rank's engine sleeps (the pipeline's weight path
        puts it to sleep first); timed for the rank's record."""
        if not self.engine.sleep_level:
            raise RuntimeError(
                f"colocated rank {self.rank}: train_step while its engine holds the device; call sleep_engine "
                "first (the pipeline's in-process weight path does, before every step)"
            )
        self._log.engine_training = dataclasses.asdict(self.engine.memory())
        t0 = time.monotonic()
        try:
            return self._train_base.train_step(self, batch)  # type: ignore[arg-type]
        finally:
            self._log.train.append([t0, time.monotonic()])


def colocated_worker_class(strategy: str, mapping: Mapping[str, Sequence[str]]) -> type[ColocatedRank]:
    """The colocated worker of ``train.strategy`` (``torch``) whose ``generate`` routes by ``mapping``
    (the pipeline's ``tags:``): ``ColocatedRank`` + the strategy's worker + the mapped InferenceWorker."""
    train_cls = train_worker_class(strategy)
    infer_cls = inference_worker_class(mapping)
    return type(
        "ColocatedWorker",
        (ColocatedRank, train_cls, infer_cls),
        {
            "__module__": __name__,
            "__qualname__": "ColocatedWorker.mapped",  # shipped by value (the class is made here)
            "__doc__": ColocatedRank.__doc__,
            "_train_base": train_cls,
            "_infer_base": infer_cls,
        },
    )


__all__ = ["ColocatedRank", "PhaseLog", "colocated_worker_class"]
