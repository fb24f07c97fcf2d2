"""Batched ADD: the generate requests that EnvManagers send in one turn of the event loop go to each
inference worker as one Ray call, and come back in a few batches as they finish.

One Ray call per request costs the driver about half a millisecond (submission, a future, a reply),
and the worker as much again on the core its engine runs on; a step of 32 prompts × 8 samples is 256
of them. :class:`RequestBatcher` collects the requests submitted before the event loop next runs its
callbacks, routes each one as a call of its own would be (:meth:`Cluster.route_many`: tag preference,
least-loaded live worker), and sends each worker its share as one ``generate_many`` call, a Ray
streaming generator that yields the requests finished by each engine step together. Every request
still finishes on its own: its caller's future resolves with the batch it finished in. A share of a
single request goes as a plain ``generate`` call: a streaming call costs more than a plain one (its
end is a message of its own), so batching pays only from two requests on. Multi-turn agents whose
turns have drifted apart (env steps of different lengths) mostly send one request per turn of the
loop; the burst of a rollout's first turn, or of a step's prompts, goes as one call per worker.

Faults keep the per-request contract of the routed call: when a worker dies, it is marked dead
(routing skips it, its supervisor is told) and each of its unanswered requests raises
:class:`~rollart.cluster.errors.WorkerDiedError`, which the LLMProxy answers by sending that request
again from its stored state.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from typing import Any

from ray.exceptions import RayTaskError

from rollart.cluster import Cluster
from rollart.cluster.future import ACTOR_GONE
from rollart.rollout.cost import BusyMeter
from rollart.rollout.types import GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)


def _unanswered(futures: dict[str, deque[asyncio.Future[GenerateOutput]]]) -> list[asyncio.Future[GenerateOutput]]:
    return [f for waiting in futures.values() for f in waiting if not f.done()]


class RequestFailedError(RuntimeError):
    """A request of a batched call failed on its worker (the engine refused it)."""


class RequestBatcher:
    """Coalesces ``generate`` calls per event-loop turn into one streaming call per worker."""

    def __init__(
        self,
        cluster: Cluster,
        method: str = "generate",
        batch_method: str = "generate_many",
        meter: BusyMeter | None = None,
    ):
        self.cluster = cluster
        self.meter = meter  # each request's time on its worker (the LLMProxy's cost ledger)
        self.method = method  # the routed method whose @hw_mapping routes each request
        self.batch_method = batch_method
        self._queued: dict[str, list[tuple[GenerateRequest, asyncio.Future[GenerateOutput]]]] = defaultdict(list)
        self._prefer: dict[str, int] = {}  # request id -> the rank it should go to (affinity)
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self.calls = 0  # Ray calls sent
        self.streams = 0  # of them, streaming generate_many calls (a share of two requests or more)
        self.requests = 0  # requests they carried

    def submit(self, request: GenerateRequest, tag: str, prefer: int | None = None) -> asyncio.Future[GenerateOutput]:
        """Queue ``request``; it is sent when the event loop next runs its callbacks (to rank ``prefer``
        while that rank is alive and of the tag's hardware)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerateOutput] = loop.create_future()
        self._queued[tag].append((request, fut))
        if prefer is not None:
            self._prefer[request.request_id] = prefer
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._flush_scheduled = False
        queued, self._queued = self._queued, defaultdict(list)
        for tag, items in queued.items():
            prefer = [self._prefer.pop(req.request_id, None) for req, _ in items]
            try:
                routes = self.cluster.route_many(
                    self.method, tag, len(items), prefer if any(p is not None for p in prefer) else None
                )
            except Exception as err:  # no live worker for the tag, or the job failed: every caller learns it
                for _, fut in items:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            by_rank: dict[int, tuple[Any, list[tuple[GenerateRequest, asyncio.Future[GenerateOutput]]]]] = {}
            for (rank, actor), item in zip(routes, items):
                by_rank.setdefault(rank, (actor, []))[1].append(item)
                if self.meter is not None:
                    self.meter.begin(item[0].request_id, rank)
            loop = asyncio.get_running_loop()
            for rank, (actor, share) in by_rank.items():
                send = (
                    self._single(rank, actor, tag, *share[0])
                    if len(share) == 1
                    else self._stream(rank, actor, tag, share)
                )
                task = loop.create_task(send)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _single(
        self, rank: int, actor: Any, tag: str, req: GenerateRequest, fut: asyncio.Future[GenerateOutput]
    ) -> None:
        """One request as a plain ``generate`` call; answered and failed as it would be in a batch."""
        self.calls += 1
        self.requests += 1
        failure: BaseException | None = None
        try:
            out = await getattr(actor, self.method).remote(req, tag)
        except ACTOR_GONE as err:
            failure = self.cluster.worker_died(rank, err)
        except RayTaskError as err:  # the engine refused it, or its id was running already
            failure = RequestFailedError(f"request {req.request_id}: {err.cause!r}")
        except Exception as err:  # the call itself broke
            failure = err
        finally:
            self.cluster.release(rank)
            if self.meter is not None:
                self.meter.end(req.request_id)
        if fut.done():
            return
        if failure is not None:
            fut.set_exception(failure)
        else:
            fut.set_result(out)

    async def _stream(
        self, rank: int, actor: Any, tag: str, items: list[tuple[GenerateRequest, asyncio.Future[GenerateOutput]]]
    ) -> None:
        futures: dict[str, deque[asyncio.Future[GenerateOutput]]] = defaultdict(deque)  # an id sent twice: in order
        for req, fut in items:
            futures[req.request_id].append(fut)
        self.calls += 1
        self.streams += 1
        self.requests += len(items)
        try:
            stream = (
                getattr(actor, self.batch_method)
                .options(num_returns="streaming")
                .remote([req for req, _ in items], tag)
            )
            async for ref in stream:
                for out in await ref:
                    waiting = futures.get(out.request_id)
                    if not waiting:
                        continue
                    fut = waiting.popleft()
                    if not waiting:
                        del futures[out.request_id]
                    self.cluster.release(rank)
                    if self.meter is not None:
                        self.meter.end(out.request_id)
                    if fut.done():
                        continue
                    if isinstance(out, GenerateOutput):
                        fut.set_result(out)
                    else:
                        fut.set_exception(RequestFailedError(f"request {out.request_id}: {out.reason}"))
        except ACTOR_GONE as err:
            died = self.cluster.worker_died(rank, err)
            for fut in _unanswered(futures):
                fut.set_exception(died)
        except Exception as err:  # the call itself broke: its unanswered requests fail with the cause
            for fut in _unanswered(futures):
                fut.set_exception(err)
        finally:
            left = sum(len(w) for w in futures.values())
            if left:
                self.cluster.release(rank, left)
            if self.meter is not None:
                for rid in futures:
                    self.meter.end(rid)
            for fut in _unanswered(futures):
                fut.set_exception(RuntimeError(f"rank {rank}: the batched call ended without answering"))
