"""LLMProxy: the gateway EnvManagers share to reach inference workers (RollArt paper §5.3).

It routes each request by its ``tag`` through the inference Cluster's ``@hw_mapping`` (first live
hardware type of the tag's preference, least-loaded worker within it), and carries partial rollouts
across ``suspend`` / ``model_update`` / ``resume``: a preempted request is continued with its prompt
plus the tokens generated so far (the prefix is recomputed under the new weights), and its output
records, per token, the policy version and behaviour logprob that produced it.

Faults: a request whose worker dies is sent again from its stored state — the prompt plus the tokens
already returned (with their logprobs and versions) — to a live worker (the Cluster reroutes it, or,
while every worker of its tag is being restarted, the proxy waits for one to come back, bounded by
``wait_for_worker_s``). Tokens a dead worker had not returned yet are generated again. When no worker
can serve it (all removed, or the restart policy failed the job) the request raises with the cause.
With a :class:`~rollart.cluster.fault.WorkerSupervisor`, every weight push records the version it
sends under the supervisor's lock, and a restarted worker loads that version before it takes traffic.
A worker that joins an elastic pool does the same (:meth:`LLMProxy.admit_worker`), and takes traffic
only while the rollout is not suspended (a worker never serves through a weight swap the others paused for).

Streaming (:meth:`LLMProxy.generate_stream`, the policy endpoint's ``stream: true``): the request goes to
its worker's ``generate_stream`` and its tokens come back as they are decoded, positioned in the whole
reply. A preempted stream continues like any request, and a stream whose worker died continues from
every token it had already received (those are kept, with their versions and log-probs, not generated
again): tokens sent to the caller stay sent, and the final output holds each token with the version
that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import ray

from rollart.cluster import Cluster
from rollart.cluster.errors import NoLiveWorkerError, WorkerDiedError
from rollart.cluster.fault import RestartPolicy, WorkerSupervisor
from rollart.cluster.future import ACTOR_GONE
from rollart.rollout.affinity import AutoAffinity
from rollart.rollout.batching import RequestBatcher, RequestFailedError
from rollart.rollout.cost import BusyMeter, TrajectoryCost
from rollart.rollout.policy_clock import PolicyClock
from rollart.rollout.types import GenerateDelta, GenerateOutput, GenerateRequest
from rollart.weights.base import WeightChannel

log = logging.getLogger(__name__)
T = TypeVar("T")


def _has_generate_many(cluster: Cluster, method: str = "generate_many") -> bool:
    """Whether the cluster's workers answer batched calls (``InferenceWorker.generate_many``), or
    streamed ones (``generate_stream``), the way their ``generate`` answers single ones: a worker class
    that overrides ``generate`` keeps one call per request, so its own ``generate`` runs for every request."""
    from rollart.rollout import inference_worker  # the module whose generate answers like generate_many

    cls = cluster.worker_cls
    if not callable(getattr(cls, method, None)):
        return False
    if getattr(getattr(cls, "generate", None), "__module__", None) != inference_worker.__name__:
        log.info("%s off for %s: it overrides generate (one Ray call per request)", method, cls.__name__)
        return False
    return True


def _segment(rid: str, deltas: list[GenerateDelta]) -> GenerateOutput:
    """The tokens a stream received from one worker before it died, as a preempted output."""
    out = GenerateOutput(request_id=rid, preempted=True)
    for d in deltas:
        out.output_token_ids += d.token_ids
        out.output_logprobs += d.logprobs
        out.output_top_logprobs += d.top_logprobs
        out.token_versions += [d.version] * len(d.token_ids)
        out.hardware, out.rank = d.hardware, d.rank
    return out


def _tail_delta(rid: str, out: GenerateOutput, sent: int) -> GenerateDelta:
    """The tokens of ``out`` from position ``sent`` on, as one delta (a segment's last step, or the whole
    answer of an engine that does not stream)."""
    return GenerateDelta(
        request_id=rid,
        start=sent,
        token_ids=out.output_token_ids[sent:],
        logprobs=out.output_logprobs[sent:],
        top_logprobs=out.output_top_logprobs[sent:],
        version=out.token_versions[-1] if out.token_versions else 0,
        hardware=out.hardware,
        rank=out.rank,
    )


def _ended(out: GenerateOutput, reason: str) -> GenerateOutput:
    """``out`` as a final answer that stopped for ``reason`` (``abort``, ``length``)."""
    return out.model_copy(update={"finish_reason": reason, "preempted": False})


class LLMProxy:
    """Shared by many EnvManagers; every method is a coroutine on the caller's event loop."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        restart: RestartPolicy | None = None,
        wait_for_worker_s: float = 300.0,
        affinity: AutoAffinity | None = None,
        batch_requests: bool = False,
        clock: PolicyClock | None = None,
    ):
        self.cluster = cluster
        self.clock = clock if clock is not None else PolicyClock()  # the run's: the served version moves here
        # the cost ledger: each worker's busy time, split among the requests in flight on it
        self.meter = BusyMeter(getattr(cluster, "pool", None) or getattr(cluster, "name", ""), self._devices_of)
        # batched ADD (rollart.rollout.batching): one streaming call per worker per event-loop turn
        self.batcher = (
            RequestBatcher(cluster, meter=self.meter) if batch_requests and _has_generate_many(cluster) else None
        )
        self.streams = _has_generate_many(cluster, "generate_stream")  # generate_stream streams (else: one answer)
        # automatic hardware affinity: every finished request's lengths reorder its tag's preference
        self.affinity = affinity
        if affinity is not None:
            cluster.route_override = affinity.preference
        self._aborted: set[str] = set()
        self._affinity: OrderedDict[str, int] = OrderedDict()  # affinity key -> the rank that served it last
        self.max_affinity_keys = 65536
        self._inflight: set[str] = set()
        self._by_hw: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.wait_for_worker_s = wait_for_worker_s
        self.counts: Counter[str] = Counter()  # "migrated": requests sent again after their worker died
        # the weights being served: (state dict or its ObjectRef, channel, version); what a restart loads
        self._serving: tuple[Any, Any, int] = (None, None, 0)
        self._push_lock = threading.Lock()
        self._resumed = threading.Event()  # cleared while suspend() holds the workers (a weight swap)
        self._resumed.set()
        self.supervisor: WorkerSupervisor | None = None
        if restart is not None:
            cluster.skip_dead_ranks = True
            self.supervisor = WorkerSupervisor(
                cluster, restart, prepare=self._load_serving, current_version=lambda: self._serving[2]
            )
            self._push_lock = self.supervisor.version_lock

    @property
    def version(self) -> int:
        """The version every worker serves (the run's :class:`~rollart.rollout.policy_clock.PolicyClock`)."""
        return self.clock.served

    def _devices_of(self, rank: int) -> int:
        """A worker's accelerator devices (a CPU worker: 0)."""
        if self.cluster.hardware_of(rank) == "CPU":
            return 0
        return int(getattr(self.cluster, "devices_per_worker", 1))

    def _load_serving(self, actor: Any) -> int:
        """Load the served weights into a restarted worker (runs in the supervisor's thread)."""
        weights, channel, version = self._serving
        try:
            if channel is not None:
                ray.get(actor.load_weights_from.remote(channel, version))
            elif weights is not None:
                ray.get(actor.update_weights.remote(weights, version))
        except ray.exceptions.RayTaskError as err:
            if self._serving[2] == version:
                raise
            # the served version moved on while this load ran (e.g. a trainer restart replaced the weight
            # channel, whose caches now refuse it): the supervisor sees a newer version and loads that
            log.info(
                "version %d not loaded into a restarted worker (%s); version %d is served now",
                version,
                err,
                self._serving[2],
            )
        return version

    async def _wait_for_worker(self, rid: str) -> bool:
        """While a worker is being restarted: wait until one serves (True), or none can (False)."""
        deadline = time.monotonic() + self.wait_for_worker_s
        while time.monotonic() < deadline and rid not in self._aborted:
            step = min(1.0, deadline - time.monotonic())
            if await asyncio.to_thread(self.cluster.wait_until_serving, step):
                return True
            if not self.cluster.recoverable():
                return False
        return rid in self._aborted

    async def generate(
        self,
        request: GenerateRequest,
        tag: str,
        *,
        affinity: str | None = None,
        trace: Callable[[str, dict[str, Any]], None] | None = None,
        cost: TrajectoryCost | None = None,
    ) -> GenerateOutput:
        """Generate until the request stops or runs out of tokens, continuing across preemptions.

        ``affinity``: a key (e.g. a session) whose requests go to the worker that served its last one
        while that worker is alive and of the tag's hardware, so an engine with a prefix cache still
        holds the earlier turns (with batched ADD; one Ray call per request routes by load alone).
        ``trace(event, fields)`` hears each worker's answer (``generate``: the worker, its host, the
        versions and counts of its tokens, the call's latency; a preempted answer is followed by the
        continuation's) and each move to another worker after a death (``migrate``). ``cost``: where its
        share of its workers' busy time goes (:mod:`rollart.rollout.cost`; without one it is counted as
        unattributed)."""
        rid = request.request_id
        budget = request.sampling.max_new_tokens
        out: GenerateOutput | None = None
        with self._running(rid, cost):
            t0 = time.monotonic()
            req = request
            while True:
                if rid in self._aborted:
                    base = out or GenerateOutput(request_id=rid)
                    return base.model_copy(update={"finish_reason": "abort", "preempted": False})
                t_call = time.monotonic()
                try:
                    if self.batcher is not None:
                        prefer = self._affinity.get(affinity) if affinity is not None else None
                        part: GenerateOutput = await self.batcher.submit(req, tag, prefer)
                    else:
                        call = self.cluster.generate(req, tag_name=tag)
                        self.meter.begin(rid, call.ranks[0])
                        call.on_reroute = lambda _dead, new, rid=rid: self.meter.move(rid, new)
                        try:
                            part = await call
                        finally:
                            self.meter.end(rid)
                        if trace is not None:  # the Cluster sent it again to a live worker after a death
                            for rank, why, when, _ in getattr(call, "reroutes", ()):
                                trace("migrate", {**self._rerouted(rank, why, req, request), "t": when})
                except (NoLiveWorkerError, WorkerDiedError) as err:
                    t_wait = time.monotonic()
                    if not await self._wait_for_worker(rid):
                        raise
                    if rid in self._aborted:
                        continue
                    self.counts["migrated"] += 1
                    log.info(
                        "request %s: %r; sent again from its %d stored tokens", rid, err, len(req.prompt_token_ids)
                    )
                    if trace is not None:
                        trace("migrate", self._migration(err, req, request, t_call, t_wait))
                    continue  # ``req`` is the stored state: prompt + the tokens returned so far
                if trace is not None:
                    trace("generate", self._segment_fields(req, part, t_call))
                out = part if out is None else out.extend(part)
                self._note_affinity(affinity, part.rank)
                if not part.preempted or rid in self._aborted:
                    break
                remaining = budget - len(out.output_token_ids)
                if remaining <= 0:
                    out = out.model_copy(update={"finish_reason": "length", "preempted": False})
                    break
                req = _continuation(request, out.output_token_ids, remaining)
            if rid in self._aborted:
                out = out.model_copy(update={"finish_reason": "abort", "preempted": False})
            self._account(tag, request, out, t0)
            return out

    @contextlib.contextmanager
    def _running(self, rid: str, cost: TrajectoryCost | None) -> Iterator[None]:
        """While request ``rid`` runs: it can be aborted; after it, its busy time is settled on ``cost``."""
        self._inflight.add(rid)
        try:
            yield
        finally:
            self.meter.settle(rid, cost)
            self._inflight.discard(rid)
            self._aborted.discard(rid)

    def _segment_fields(self, req: GenerateRequest, part: GenerateOutput, t_call: float) -> dict[str, Any]:
        """A ``generate`` trace event: who answered one call, with what, how long the call took."""
        versions = sorted(set(part.token_versions))
        return {
            "rank": part.rank,
            "hardware": part.hardware,
            "node_ip": self._node_ip(part.rank),
            "versions": versions,
            "prompt_tokens": len(req.prompt_token_ids),
            "response_tokens": len(part.output_token_ids),
            "latency_s": time.monotonic() - t_call,  # queue, decode and the round trip, as the proxy sees it
            "finish_reason": part.finish_reason,
            "preempted": part.preempted,
        }

    def _node_ip(self, rank: int) -> str:
        try:
            return self.cluster.node_ip_of(rank) if rank >= 0 else ""
        except IndexError:  # a worker of an elastic pool that is gone
            return ""

    def _rerouted(
        self, rank: int, err: BaseException, req: GenerateRequest, request: GenerateRequest
    ) -> dict[str, Any]:
        """A ``migrate`` trace event of a call the Cluster sent again to another worker (the dead one's
        tokens of that call are generated again; those of earlier calls are kept)."""
        try:
            hardware = self.cluster.hardware_of(rank)
        except IndexError:
            hardware = ""
        return {
            "from_rank": rank,
            "from_hardware": hardware,
            "from_node_ip": self._node_ip(rank),
            "error": type(err).__name__,
            "tokens_kept": len(req.prompt_token_ids) - len(request.prompt_token_ids),
        }

    def _migration(
        self, err: BaseException, req: GenerateRequest, request: GenerateRequest, t_call: float, t_wait: float
    ) -> dict[str, Any]:
        """A ``migrate`` trace event: the worker that died under the request and what the request keeps."""
        dead = err if isinstance(err, WorkerDiedError) else None
        return {
            "from_rank": dead.rank if dead is not None else -1,
            "from_hardware": dead.hardware if dead is not None else "",
            "from_node_ip": dead.node_ip if dead is not None else "",
            "error": type(err).__name__,
            "tokens_kept": len(req.prompt_token_ids) - len(request.prompt_token_ids),
            "lost_s": t_wait - t_call,  # the call that died
            "wait_s": time.monotonic() - t_wait,  # waiting for a live worker
        }

    def _note_affinity(self, affinity: str | None, rank: int) -> None:
        if affinity is not None and rank >= 0:
            self._affinity[affinity] = rank
            self._affinity.move_to_end(affinity)
            while len(self._affinity) > self.max_affinity_keys:
                self._affinity.popitem(last=False)

    async def _stream_once(
        self, request: GenerateRequest, tag: str, affinity: str | None
    ) -> AsyncIterator[GenerateDelta | GenerateOutput]:
        """One worker's stream of ``request`` (preferably the one that served ``affinity`` last): its deltas,
        then its output. A dead worker raises ``WorkerDiedError`` (it is marked dead), no live one
        ``NoLiveWorkerError``."""
        prefer = self._affinity.get(affinity) if affinity is not None else None
        ((rank, actor),) = self.cluster.route_many("generate", tag, 1, [prefer] if prefer is not None else None)
        self.meter.begin(request.request_id, rank)
        try:
            stream = actor.generate_stream.options(num_returns="streaming").remote(request, tag)
            async for ref in stream:
                yield await ref
        except ACTOR_GONE as err:
            raise self.cluster.worker_died(rank, err) from err
        except ray.exceptions.RayTaskError as err:  # the engine refused it, or its id was running already
            raise RequestFailedError(f"request {request.request_id}: {err.cause!r}") from err
        finally:
            self.cluster.release(rank)
            self.meter.end(request.request_id)

    async def generate_stream(
        self, request: GenerateRequest, tag: str, *, affinity: str | None = None
    ) -> AsyncIterator[GenerateDelta | GenerateOutput]:
        """:meth:`generate`, streamed: a :class:`GenerateDelta` whenever tokens were decoded (``start``:
        their position in the whole reply, across preemptions), then the whole ``GenerateOutput``, as
        :meth:`generate` returns it. Deltas never repeat or skip a position; the output's tokens begin with
        every token sent. Workers whose class overrides ``generate`` answer only the output."""
        if not self.streams:
            yield await self.generate(request, tag, affinity=affinity)
            return
        rid = request.request_id
        budget = request.sampling.max_new_tokens
        out: GenerateOutput | None = None  # the segments answered so far, joined
        sent = 0  # tokens of the reply sent to the caller
        with self._running(rid, None):  # a stream's caller has no trajectory here: unattributed
            t0 = time.monotonic()
            req = request
            while True:
                if rid in self._aborted:
                    out = _ended(out or GenerateOutput(request_id=rid), "abort")
                    break
                done = len(out.output_token_ids) if out is not None else 0
                seen: list[GenerateDelta] = []  # this segment's deltas
                part: GenerateOutput | None = None
                try:
                    async for item in self._stream_once(req, tag, affinity):
                        if isinstance(item, GenerateOutput):
                            part = item
                            continue
                        got = sum(len(d.token_ids) for d in seen)
                        skip = got - item.start  # deltas of one segment are contiguous: nothing to skip
                        if skip < 0 or skip >= len(item.token_ids):
                            continue
                        item = item.model_copy(
                            update={
                                "start": got,
                                "token_ids": item.token_ids[skip:],
                                "logprobs": item.logprobs[skip:],
                                "top_logprobs": item.top_logprobs[skip:],
                            }
                        )
                        seen.append(item)
                        if done + got + len(item.token_ids) > sent:
                            cut = max(0, sent - done - got)
                            yield item.model_copy(
                                update={
                                    "request_id": rid,
                                    "start": done + got + cut,
                                    "token_ids": item.token_ids[cut:],
                                    "logprobs": item.logprobs[cut:],
                                    "top_logprobs": item.top_logprobs[cut:],
                                }
                            )
                            sent = done + got + len(item.token_ids)
                except (NoLiveWorkerError, WorkerDiedError) as err:
                    out, serving = await self._stream_lost(rid, err, seen, out, sent)
                    if not serving:
                        raise
                    if rid in self._aborted:
                        continue
                    part = None
                if part is not None:
                    out = part if out is None else out.extend(part)
                    self._note_affinity(affinity, part.rank)
                    if len(out.output_token_ids) > sent:  # the segment's last step (or an engine that does not stream)
                        yield _tail_delta(rid, out, sent)
                        sent = len(out.output_token_ids)
                    if not part.preempted or rid in self._aborted:
                        break
                remaining = budget - (len(out.output_token_ids) if out is not None else 0)
                if remaining <= 0 and out is not None:
                    out = _ended(out, "length")
                    break
                req = _continuation(request, out.output_token_ids if out is not None else [], remaining)
            if rid in self._aborted:
                out = _ended(out, "abort")
            self._account(tag, request, out, t0)
            yield out

    async def _stream_lost(
        self, rid: str, err: BaseException, seen: list[GenerateDelta], out: GenerateOutput | None, sent: int
    ) -> tuple[GenerateOutput | None, bool]:
        """A stream whose worker died (or that had none): what it streamed stays (``seen`` joins ``out``: the
        request continues after those tokens), and it waits for a live worker. Returns the output so far and
        whether a worker serves again (or the request was aborted meanwhile); False: the error stands."""
        if seen:
            kept = _segment(rid, seen)
            out = kept if out is None else out.extend(kept)
        if not await self._wait_for_worker(rid):
            return out, False
        if rid not in self._aborted:
            self.counts["migrated"] += 1
            log.info("stream %s: %r; sent again from its %d received tokens", rid, err, sent)
        return out, True

    def _account(self, tag: str, request: GenerateRequest, out: GenerateOutput, t0: float) -> None:
        if self.affinity is not None and out.finish_reason != "abort":
            self.affinity.observe(tag, len(request.prompt_token_ids), len(out.output_token_ids))
        stats = self._by_hw[out.hardware]
        stats["requests"] += 1
        stats["output_tokens"] += len(out.output_token_ids)
        stats["latency_s"] += time.monotonic() - t0

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests for good (their callers get ``finish_reason="abort"`` and partial tokens)."""
        live = [r for r in request_ids if r in self._inflight]
        self._aborted.update(live)
        if live:
            try:
                await self.cluster.abort(live)
            except (NoLiveWorkerError, WorkerDiedError) as err:  # nothing runs them any more: already ended
                log.warning("abort of %d requests: %r", len(live), err)

    async def suspend(self) -> None:
        """Preempt every in-flight request (partial tokens kept) and hold new ones."""
        with (
            self._push_lock
        ):  # a joining worker is admitted before this (and suspended with the others) or after resume
            self._resumed.clear()
            fut = self.cluster.suspend()
        await fut

    async def resume(self) -> None:
        with self._push_lock:
            fut = self.cluster.resume()
            self._resumed.set()
        await fut

    def admit_worker(self, rank: int, timeout_s: float = 300.0) -> int:
        """Let a new worker of the pool (it joined an elastic pool) take traffic: it loads the weights being
        served and is marked alive once it serves the current version and the rollout is not suspended.
        Blocks (call it off the event loop); returns the version it serves. Raises ``TimeoutError`` when
        the rollout stays suspended for ``timeout_s``."""
        actor = self.cluster.workers[rank]
        deadline = time.monotonic() + timeout_s
        while not self.cluster.is_retired(rank):
            version = self._load_serving(actor)
            with self._push_lock:
                if version == self._serving[2] and self._resumed.is_set():
                    self.cluster.mark_alive(rank)
                    return version
            if not self._resumed.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"rank {rank}: the rollout stayed suspended for {timeout_s:.0f}s")
        raise RuntimeError(f"rank {rank} left the pool before it served")

    async def model_update(self, weights: Any, version: int) -> None:
        """Load new weights on every worker (a state dict, or an ObjectRef of one)."""
        with self._push_lock:  # a worker coming back from a restart sees this version, or gets this push
            self._serving = (weights, None, version)
            fut = self.cluster.update_weights(weights, version)
        await fut
        self.clock.serve(version)

    async def model_update_from(self, channel: WeightChannel, version: int) -> None:
        """Every worker fetches ``version`` from a weight channel itself (e.g. Mooncake)."""
        with self._push_lock:
            self._serving = (None, channel, version)
            fut = self.cluster.load_weights_from(channel, version)
        await fut
        self.clock.serve(version)

    async def model_update_in_process(self, load: Callable[[], Awaitable[T]], version: int) -> T:
        """The workers serve ``version`` from weights they hold themselves (colocated mode: each takes its
        trainer's, in its own process); ``load()`` starts that. Returns what it answers."""
        with self._push_lock:
            self._serving = (None, None, version)
            fut = load()
        out = await fut
        self.clock.serve(version)
        return out

    def fault_metrics(self) -> dict[str, int]:
        """Deaths, reroutes, skipped control calls, restarts and removals of the pool; migrated requests."""
        return {**self.cluster.fault_counts, "migrated": self.counts["migrated"]}

    def close(self) -> None:
        """Stop restarting workers (before the cluster shuts down)."""
        if self.supervisor is not None:
            self.supervisor.stop()

    async def worker_metrics(self) -> list[dict[str, Any]]:
        return await self.cluster.metrics()

    def metrics(self) -> dict[str, dict[str, float]]:
        """Per hardware type: requests served, output tokens, mean latency."""
        out = {}
        for hw, s in self._by_hw.items():
            n = max(s["requests"], 1)
            out[hw] = {
                "requests": s["requests"],
                "output_tokens": s["output_tokens"],
                "mean_latency_s": s["latency_s"] / n,
            }
        return out


def _continuation(request: GenerateRequest, tokens: list[int], remaining: int) -> GenerateRequest:
    """``request`` resumed after a preemption: its prompt followed by the ``tokens`` generated so far, with
    the ``remaining`` new-token budget."""
    return request.model_copy(
        update={
            "prompt_token_ids": list(request.prompt_token_ids) + list(tokens),
            "sampling": request.sampling.model_copy(update={"max_new_tokens": remaining}),
        }
    )
