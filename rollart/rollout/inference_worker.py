"""Inference worker: a command-driven loop over one engine (RollArt paper §5.3, "LLMProxy").

Between engine steps the loop applies the commands that arrived (ADD, ABORT, UPDATE of weights);
when commands are pending none of them waits for a step, and a request that finishes in a step is
answered at once (its caller's future resolves), without waiting for the rest of the batch.

Invariants:
- weights change only between steps and only with no request in the engine, so every token of one
  engine segment comes from one weight version (an update preempts in-flight requests first);
- a suspended worker answers in-flight requests with their partial tokens (``preempted=True``) and
  holds new ones until ``resume``;
- a request answered before its ADD reached the engine (an UPDATE or ABORT that was queued ahead of it
  preempted it) never enters the engine: its caller already has the answer and may send the same id
  again;
- a request the engine refuses fails its own caller; the loop goes on. Should the loop itself stop on
  an error, every waiting caller gets that error and later calls raise it: nothing waits forever.

Streaming (:meth:`InferenceWorker.generate_stream`): the request enters the engine with ``stream``; after
each engine step in which it got tokens the worker yields them (a
:class:`~rollart.rollout.types.GenerateDelta`), and at the end its whole ``GenerateOutput``, answered,
preempted or aborted exactly as ``generate`` answers it. The worker keeps, per recent streaming request,
the engine step and the monotonic time at which its first and last tokens were reported
(:meth:`InferenceWorker.stream_records`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollart.cluster.batch import Batch
from rollart.cluster.worker import Worker
from rollart.decorators.hw_mapping import hw_mapping
from rollart.decorators.register import register
from rollart.decorators.specs import Dispatch
from rollart.engines.base import EngineRequest, RequestOutput, TokenDelta
from rollart.rollout.engine_config import EngineConfig, build_engine
from rollart.rollout.types import GenerateDelta, GenerateOutput, GenerateRequest
from rollart.weights.base import WeightChannel
from rollart.weights.stream import Assembler

BUCKETS_AT_ONCE = 8  # a trainer's buckets a worker fetches from the object store together


@dataclass
class _Pending:
    request: GenerateRequest
    future: asyncio.Future[GenerateOutput]
    version: int
    added_at: float = field(default_factory=time.monotonic)
    deltas: asyncio.Queue[GenerateDelta | None] | None = None  # a streaming request's tokens as they come


# ---------------------------------------------------------------------- commands of the loop
@dataclass(frozen=True)
class AddCommand:
    """Put a request into the engine; its caller is answered through ``pending.future``."""

    pending: _Pending


@dataclass(frozen=True)
class AbortCommand:
    """Abort these requests (``preempt``: answered as preempted); ``reply`` gets how many ran here."""

    request_ids: tuple[str, ...]
    preempt: bool
    reply: asyncio.Future[int]


@dataclass(frozen=True)
class UpdateCommand:
    """Preempt every request, then load ``weights`` as ``version``; ``reply`` gets the version."""

    weights: Mapping[str, Any]
    version: int
    reply: asyncio.Future[int]


@dataclass(frozen=True)
class EngineCommand:
    """Preempt every request, then run ``fn`` on the engine between two steps; ``reply`` gets its result
    (colocated mode: the engine sleeps and wakes this way, never during a step)."""

    fn: Callable[[], Any]
    reply: asyncio.Future[Any]


Command = AddCommand | AbortCommand | UpdateCommand | EngineCommand


@dataclass(frozen=True)
class RequestFailed:
    """A request of a :meth:`InferenceWorker.generate_many` call that failed on the worker (the engine
    refused it, or its id was running already): its caller gets an error naming ``reason``."""

    request_id: str
    reason: str


class InferenceWorker(Worker):
    """Serves ``generate`` calls routed by tag. Subclass with ``@hw_mapping`` on ``generate`` (or use
    :func:`inference_worker_class`) to choose the hardware per tag."""

    def __init__(self, engine: EngineConfig | dict[str, Any] | None = None, *, colocated: bool = False):
        from rollart.cluster.devices import worker_device

        self.engine = build_engine(
            engine or EngineConfig(),
            device=str(worker_device(getattr(self, "device_ids", ()))),
            hardware=getattr(self, "hardware", None),
            colocated=colocated,
        )
        self._commands: asyncio.Queue[Command] | None = None
        self._loop_task: asyncio.Task | None = None
        self._loop_error: BaseException | None = None
        self._current: Command | None = None  # the command being applied
        self._pending: dict[str, _Pending] = {}
        self._resumed: asyncio.Event | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._stream_records: OrderedDict[str, dict[str, Any]] = OrderedDict()  # recent streaming requests
        self.max_stream_records = 1024
        self.stats = {
            "requests": 0,
            "finished": 0,
            "aborted": 0,
            "preempted": 0,
            "output_tokens": 0,
            "steps": 0,
            "step_time_s": 0.0,
            "weight_updates": 0,
        }

    # ------------------------------------------------------------------ the loop
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._commands = asyncio.Queue()
            self._resumed = asyncio.Event()
            self._resumed.set()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
            self._loop_task.add_done_callback(self._loop_stopped)
        elif self._loop_task.done():
            raise RuntimeError(
                f"the inference loop of rank {self.rank} ({self.hardware}) stopped: "
                f"{self._loop_error!r}; restart this worker"
            ) from self._loop_error

    def _loop_stopped(self, task: asyncio.Task) -> None:
        """The loop ended (it never returns on its own): fail every caller still waiting on it."""
        if task.cancelled():  # the actor is shutting down
            self._loop_error = asyncio.CancelledError("the inference loop was cancelled")
        else:
            err = task.exception()
            self._loop_error = err or RuntimeError("the inference loop returned")
            self.logger.error("inference loop stopped: %r", self._loop_error, exc_info=err)
        for rid in list(self._pending):
            self._fail(rid, self._loop_error)
        waiting = [self._current] if self._current is not None else []
        while self._commands is not None and not self._commands.empty():
            waiting.append(self._commands.get_nowait())
        for cmd in waiting:  # an ADD's caller was failed above, through its pending request
            if isinstance(cmd, (AbortCommand, UpdateCommand, EngineCommand)) and not cmd.reply.done():
                cmd.reply.set_exception(self._loop_error)

    async def _run(self) -> None:
        assert self._commands is not None
        loop = asyncio.get_running_loop()
        while True:
            while not self._commands.empty():
                self._current = self._commands.get_nowait()
                await self._apply(self._current)
                self._current = None
            if self.engine.has_unfinished():
                t0 = time.monotonic()
                try:
                    finished, deltas = await loop.run_in_executor(self._executor, self._step_with_deltas)
                except Exception as err:  # the engine broke: fail every caller, never hang them
                    self.logger.exception("engine step failed")
                    for rid in list(self._pending):
                        self._fail(rid, err)
                        with contextlib.suppress(Exception):  # nothing of a failed step stays in the engine
                            self.engine.abort(rid)
                    continue
                self.stats["steps"] += 1
                self.stats["step_time_s"] += time.monotonic() - t0
                for delta in deltas:  # before the finished ones: a stream's deltas come before its end
                    self._send_delta(delta)
                for out in finished:
                    self._finish(out, preempted=False)
            else:
                self._current = await self._commands.get()
                await self._apply(self._current)
                self._current = None

    async def _apply(self, cmd: Command) -> None:
        match cmd:
            case AddCommand(pending=pending):
                req = pending.request
                if self._pending.get(req.request_id) is not pending or pending.future.done():
                    return  # answered (preempted or aborted) before it reached the engine
                try:
                    self.engine.add_request(
                        EngineRequest(
                            request_id=req.request_id,
                            prompt_token_ids=list(req.prompt_token_ids),
                            params=req.sampling,
                            stream=pending.deltas is not None,
                        )
                    )
                except Exception as err:  # the engine refuses this request: its caller gets the error
                    self._fail(req.request_id, err)
            case AbortCommand(request_ids=rids, preempt=preempt, reply=reply):
                n = 0
                for rid in rids:
                    if rid in self._pending:
                        out = self.engine.abort(rid)
                        self._finish(out, preempted=preempt, rid=rid)
                        n += 1
                reply.set_result(n)
            case UpdateCommand(weights=weights, version=version, reply=reply):
                self._preempt_all()  # no request may straddle two weight versions
                try:
                    self.engine.update_weights(weights, version)
                except Exception as err:
                    reply.set_exception(err)
                    return
                self.stats["weight_updates"] += 1
                reply.set_result(version)
            case EngineCommand(fn=fn, reply=reply):
                self._preempt_all()
                try:
                    reply.set_result(fn())
                except Exception as err:
                    reply.set_exception(err)

    def _preempt_all(self) -> None:
        """Answer every request in flight as preempted (its partial tokens go back to its caller)."""
        for rid in list(self._pending):
            self._finish(self.engine.abort(rid), preempted=True, rid=rid)

    def _step_engine(self) -> list[RequestOutput]:
        """One engine step (in the loop's step thread)."""
        return self.engine.step()

    def _step_with_deltas(self) -> tuple[list[RequestOutput], list[TokenDelta]]:
        """One engine step and the new tokens of its streaming requests (in the loop's step thread)."""
        finished = self._step_engine()
        return finished, self.engine.take_deltas()

    def _send_delta(self, delta: TokenDelta) -> None:
        pending = self._pending.get(delta.request_id)
        if pending is None or pending.deltas is None or pending.future.done():
            return
        now, step = time.monotonic(), self.stats["steps"]
        record = self._stream_records.get(delta.request_id)
        if record is not None:
            if record["first_step"] is None:
                record["first_step"], record["first_at"] = step, now
            record["last_step"], record["last_at"], record["tokens"] = step, now, delta.start + len(delta.token_ids)
        pending.deltas.put_nowait(
            GenerateDelta(
                request_id=delta.request_id,
                start=delta.start,
                token_ids=delta.token_ids,
                logprobs=delta.logprobs,
                top_logprobs=delta.top_logprobs,
                version=pending.version,
                hardware=self.hardware,
                rank=self.rank,
            )
        )

    async def _between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine between two steps, every request in flight preempted first."""
        self._ensure_loop()
        assert self._commands is not None
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._commands.put(EngineCommand(fn, reply))
        return await reply

    def _finish(self, out: RequestOutput | None, *, preempted: bool, rid: str | None = None) -> None:
        rid = rid or (out.request_id if out is not None else None)
        pending = self._pending.pop(rid, None) if rid else None
        if rid is None or pending is None or pending.future.done():
            return
        tokens = list(out.output_token_ids) if out is not None else []
        logprobs = list(out.output_logprobs) if out is not None else []
        top = list(out.output_top_logprobs) if out is not None else []
        reason = out.finish_reason if out is not None and not preempted else "abort"
        if preempted:
            self.stats["preempted"] += 1
        elif reason == "abort":
            self.stats["aborted"] += 1
        else:
            self.stats["finished"] += 1
        self.stats["output_tokens"] += len(tokens)
        record = self._stream_records.get(rid) if pending.deltas is not None else None
        if record is not None and tokens:  # the tokens of the last step reach the caller with the output
            record["end_step"], record["end_at"], record["tokens"] = self.stats["steps"], time.monotonic(), len(tokens)
        pending.future.set_result(
            GenerateOutput(
                request_id=rid,
                output_token_ids=tokens,
                output_logprobs=logprobs,
                output_top_logprobs=top,
                token_versions=[pending.version] * len(tokens),
                finish_reason=reason or "abort",
                hardware=self.hardware,
                rank=self.rank,
                preempted=preempted,
            )
        )

    def _fail(self, rid: str, err: BaseException) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(err)

    # ------------------------------------------------------------------ exposed methods
    async def generate(self, request: GenerateRequest, tag_name: str) -> GenerateOutput:
        """Generate one continuation; answered as soon as it finishes (or is preempted/aborted)."""
        self._ensure_loop()
        assert self._resumed is not None and self._commands is not None
        await self._resumed.wait()
        if request.request_id in self._pending:
            raise ValueError(f"request_id {request.request_id!r} is already running on this worker")
        fut: asyncio.Future[GenerateOutput] = asyncio.get_running_loop().create_future()
        pending = _Pending(request, fut, self.engine.weight_version)
        self._pending[request.request_id] = pending
        self.stats["requests"] += 1
        await self._commands.put(AddCommand(pending))
        return await fut

    async def generate_stream(
        self, request: GenerateRequest, tag_name: str
    ) -> AsyncIterator[GenerateDelta | GenerateOutput]:
        """Generate one continuation and stream it: a :class:`GenerateDelta` after each engine step in
        which it got tokens, then its whole ``GenerateOutput`` (as :meth:`generate` answers it: finished,
        preempted or aborted). Called as a Ray streaming generator (``num_returns="streaming"``); only
        requests sent this way make the engine report partial outputs."""
        self._ensure_loop()
        assert self._resumed is not None and self._commands is not None
        await self._resumed.wait()
        if request.request_id in self._pending:
            raise ValueError(f"request_id {request.request_id!r} is already running on this worker")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerateOutput] = loop.create_future()
        queue: asyncio.Queue[GenerateDelta | None] = asyncio.Queue()
        fut.add_done_callback(lambda _: queue.put_nowait(None))  # after the deltas already queued
        pending = _Pending(request, fut, self.engine.weight_version, deltas=queue)
        self._pending[request.request_id] = pending
        self._stream_records[request.request_id] = {
            "added_step": self.stats["steps"],
            "added_at": pending.added_at,
            "first_step": None,
            "first_at": None,
            "last_step": None,
            "last_at": None,
            "end_step": None,
            "end_at": None,
            "tokens": 0,
        }
        self._stream_records.move_to_end(request.request_id)
        while len(self._stream_records) > self.max_stream_records:
            self._stream_records.popitem(last=False)
        self.stats["requests"] += 1
        await self._commands.put(AddCommand(pending))
        while (item := await queue.get()) is not None:
            yield item
        yield await fut

    async def generate_many(
        self, requests: Sequence[GenerateRequest], tag_name: str
    ) -> AsyncIterator[list[GenerateOutput | RequestFailed]]:
        """Generate several requests sent in one call (the LLMProxy's batched ADD); yields, as they
        finish, the outputs of each engine step's finished requests together (a ``RequestFailed`` for a
        request the engine refused). Called as a Ray streaming generator: one Ray call and a few yields
        per batch instead of one call per request; each request still finishes on its own."""
        self._ensure_loop()
        assert self._resumed is not None and self._commands is not None
        await self._resumed.wait()
        loop = asyncio.get_running_loop()
        futures: dict[asyncio.Future[GenerateOutput], str] = {}
        failed: list[GenerateOutput | RequestFailed] = []
        for request in requests:
            if request.request_id in self._pending:
                failed.append(
                    RequestFailed(request.request_id, f"request_id {request.request_id!r} is already running")
                )
                continue
            fut: asyncio.Future[GenerateOutput] = loop.create_future()
            pending = _Pending(request, fut, self.engine.weight_version)
            self._pending[request.request_id] = pending
            self.stats["requests"] += 1
            self._commands.put_nowait(AddCommand(pending))
            futures[fut] = request.request_id
        if failed:
            yield failed
        waiting = set(futures)
        while waiting:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            yield [
                f.result() if f.exception() is None else RequestFailed(futures[f], repr(f.exception())) for f in done
            ]

    async def generate_n(self, request: GenerateRequest, n: int, tag_name: str) -> list[GenerateOutput]:
        """``n`` samples of one prompt as one request pinned to this worker (no prompt replication:
        the samples cannot spread over workers). Sample ``i`` uses seed ``seed + i`` when a seed is set."""
        reqs = []
        for i in range(n):
            sampling = request.sampling
            if sampling.seed is not None:
                sampling = sampling.model_copy(update={"seed": sampling.seed + i})
            reqs.append(request.model_copy(update={"request_id": f"{request.request_id}#{i}", "sampling": sampling}))
        return list(await asyncio.gather(*(self.generate(r, tag_name) for r in reqs)))

    @register(dispatch=Dispatch.DP_SPLIT)
    async def generate_batch(self, batch: Batch) -> list[GenerateOutput]:
        """Batch-level generation (a ``Batch`` with a ``requests`` column): every request of this rank's
        share is added at once and the call returns when the last one finishes — the batched baseline
        the trajectory-level path is compared against."""
        return list(await asyncio.gather(*(self.generate(r, "*") for r in batch["requests"])))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def abort(self, request_ids: Sequence[str]) -> int:
        """Abort these requests if they run here; their callers get the partial tokens."""
        return await self._command_abort(list(request_ids), preempt=False)

    async def _command_abort(self, rids: list[str], preempt: bool) -> int:
        self._ensure_loop()
        assert self._commands is not None
        reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        await self._commands.put(AbortCommand(tuple(rids), preempt, reply))
        return await reply

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def suspend(self) -> int:
        """Stop generating: in-flight requests return their partial tokens (preempted); new ones wait."""
        self._ensure_loop()
        assert self._resumed is not None
        self._resumed.clear()
        return await self._command_abort(list(self._pending), preempt=True)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def resume(self) -> int:
        """Serve again; returns the engine's weight version."""
        self._ensure_loop()
        assert self._resumed is not None
        self._resumed.set()
        return self.engine.weight_version

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights: Mapping[str, Any] | list[Any], version: int) -> int:
        """Load a full state dict as ``version`` between two steps (in-flight requests are preempted).
        ``weights`` may also be a list of ObjectRefs of its buckets (a trainer's ``snapshot_weights``): they
        are fetched a few at a time, a piece of a tensor larger than a bucket written into its rows of the
        whole tensor (so the worker never holds the pieces and their tensor at once)."""
        self._ensure_loop()
        assert self._commands is not None
        if isinstance(weights, list):  # the trainer's buckets, each an object in the object store
            assembler = Assembler()
            for at in range(0, len(weights), BUCKETS_AT_ONCE):
                for bucket in await asyncio.gather(*weights[at : at + BUCKETS_AT_ONCE]):
                    assembler.add_bucket(bucket)
            weights = assembler.result()
        reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        await self._commands.put(UpdateCommand(weights, version, reply))
        return await reply

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def load_weights_from(self, channel: WeightChannel, version: int) -> int:
        """Fetch ``version`` from a weight channel while generation goes on, then swap it in between two
        engine steps (requests in flight are preempted and continue under it; their tokens keep the
        version that produced each)."""
        weights = await asyncio.get_running_loop().run_in_executor(None, channel.fetch, version)
        return await self.update_weights(weights, version)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def warm_channel(self, channel: WeightChannel) -> None:
        """Set up what ``channel`` needs on this worker's host (e.g. join its store) before the first
        weight update, so that update is not slower than the next ones."""
        warm = getattr(channel, "warm", None)
        if warm is not None:
            await asyncio.get_running_loop().run_in_executor(None, warm)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def retire_channel(self, name: str) -> None:
        """Weight channel ``name`` was replaced (a trainer restart): this worker reads nothing more of it
        (a load of it still in flight fails instead of making a new host cache)."""
        from rollart.weights.host_cache import retire_channel

        retire_channel(name)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def stream_records(self) -> dict[str, dict[str, Any]]:
        """Per recent streaming request (the last :attr:`max_stream_records`): the engine step count and
        ``time.monotonic()`` when it was added (``added_step``, ``added_at``), when its first and last
        streamed tokens were reported (``first_*``, ``last_*``; None if none were) and when the tokens of
        its final step were (``end_*``: the step that decoded its last token), and ``tokens``, its tokens
        so far. What a caller compares its own receipt of the stream against."""
        return {rid: dict(r) for rid, r in self._stream_records.items()}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    async def metrics(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "hardware": self.hardware,
            "weight_version": self.engine.weight_version,
            "engine_profile": getattr(getattr(self.engine, "profile", None), "name", None),
            "engine_busy_s": getattr(self.engine, "busy_s", None),  # the simulated engine's modelled time
            "running": len(self._pending),
            **self.stats,
            # the engine's own counters (the torch engine: prefilled tokens, prefix-cache hits, decode steps)
            "engine_stats": dict(getattr(self.engine, "stats", None) or {}),
        }


def inference_worker_class(
    mapping: Mapping[str, Sequence[str]], base: type[InferenceWorker] = InferenceWorker
) -> type[InferenceWorker]:
    """An ``InferenceWorker`` subclass whose ``generate`` carries ``@hw_mapping(mapping)`` — the mapping
    comes from the pipeline config (``tags: {FrozenLake: [H800, H20], "*": [H20, H800]}``)."""

    async def generate(self: InferenceWorker, request: GenerateRequest, tag_name: str) -> GenerateOutput:
        return await base.generate(self, request, tag_name)

    async def generate_n(
        self: InferenceWorker, request: GenerateRequest, n: int, tag_name: str
    ) -> list[GenerateOutput]:
        return await base.generate_n(self, request, n, tag_name)

    generate.__doc__ = base.generate.__doc__
    generate_n.__doc__ = base.generate_n.__doc__
    hw_mapping(mapping)(generate)
    hw_mapping(mapping)(generate_n)
    return type(
        "InferenceWorker",
        (base,),
        {
            "generate": generate,
            "generate_n": generate_n,
            "__module__": __name__,
            "__qualname__": "InferenceWorker.mapped",
        },
    )
