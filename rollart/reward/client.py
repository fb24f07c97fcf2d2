"""RewardClient: the rollout side of the reward service (RollArt paper §5.3: rewards are requested as
non-blocking tasks as soon as a trajectory ends).

``await client.score(trajectory)`` queues the trajectory; a flusher sends up to ``max_batch``
trajectories or whatever arrived within ``max_wait_ms`` as one POST, with at most ``max_concurrency``
POSTs in flight. Each POST carries one ``Idempotency-Key`` reused by all its retries, so a retried
request is never scored twice by the server. After the retries, every trajectory of the batch fails
with :class:`RewardFailed` — never a score of 0; ``on_failure`` ("requeue" or "drop") tells the rollout
what to do with it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Literal

import httpx

from rollart.cluster.serverless import RetryPolicy, ServerlessError, acall_serverless


class RewardFailed(RuntimeError):
    """The reward of a trajectory could not be computed; ``policy`` says requeue or drop."""

    def __init__(self, message: str, policy: str, cause: BaseException | None = None):
        super().__init__(message)
        self.policy, self.cause = policy, cause


class RewardClient:
    def __init__(
        self,
        url: str,
        *,
        max_batch: int = 32,
        max_wait_ms: float = 20.0,
        max_concurrency: int = 8,
        retry: RetryPolicy | None = None,
        timeout_s: float = 30.0,
        token_env: str | None = None,
        tenant: str | None = None,
        on_failure: Literal["requeue", "drop"] = "requeue",
    ):
        if max_batch < 1 or max_concurrency < 1:
            raise ValueError("RewardClient: max_batch and max_concurrency must be >= 1")
        if on_failure not in ("requeue", "drop"):
            raise ValueError("RewardClient(on_failure=...): use 'requeue' or 'drop'")
        self.url, self.max_batch, self.max_wait_s = url, max_batch, max_wait_ms / 1000.0
        self.retry = retry or RetryPolicy()
        self.timeout_s, self.token_env, self.tenant, self.on_failure = timeout_s, token_env, tenant, on_failure
        self._max_concurrency = max_concurrency
        self._sem = asyncio.Semaphore(max_concurrency)
        self._queue: list[tuple[dict[str, Any], asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._flusher: asyncio.Task | None = None
        self._http: httpx.AsyncClient | None = None
        self._inflight: set[asyncio.Task] = set()
        self.stats = {"requests": 0, "trajectories": 0, "failed": 0}

    async def score(self, trajectory: dict[str, Any]) -> float:
        """The trajectory's reward; raises :class:`RewardFailed` when the service could not give one."""
        if self._flusher is None:
            self._wakeup = asyncio.Event()
            self._http = httpx.AsyncClient(timeout=self.timeout_s)
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((trajectory, fut))
        assert self._wakeup is not None
        self._wakeup.set()
        return await fut

    async def _flush_loop(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if len(self._queue) < self.max_batch:
                try:  # wait a little for more to batch with, unless the batch fills first
                    await asyncio.wait_for(self._full(), timeout=self.max_wait_s)
                except TimeoutError:
                    pass
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                await self._sem.acquire()
                task = asyncio.get_running_loop().create_task(self._send(batch))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)

    async def _full(self) -> None:
        assert self._wakeup is not None
        while len(self._queue) < self.max_batch:
            await self._wakeup.wait()
            self._wakeup.clear()

    async def _send(self, batch: list[tuple[dict[str, Any], asyncio.Future]]) -> None:
        try:
            payload = {"trajectories": [t for t, _ in batch]}
            self.stats["requests"] += 1
            try:
                result = await acall_serverless(
                    self.url,
                    payload,
                    timeout_s=self.timeout_s,
                    retry=self.retry,
                    token_env=self.token_env,
                    tenant=self.tenant,
                    idempotency_key=uuid.uuid4().hex,
                    client=self._http,
                )
                if not isinstance(result, list) or len(result) != len(batch):
                    raise ServerlessError(self.url, f"expected {len(batch)} scores, got {result!r:.200}")
            except Exception as err:
                self.stats["failed"] += len(batch)
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(RewardFailed(f"reward from {self.url} failed: {err}", self.on_failure, err))
                return
            self.stats["trajectories"] += len(batch)
            for (_, fut), score in zip(batch, result):
                if not fut.done():
                    fut.set_result(float(score))
        finally:
            self._sem.release()

    def counts(self) -> dict[str, Any]:
        """What this client sent, as its tenant: POSTs answered or failed (``requests``), trajectories
        scored (``trajectories``: what the service's ``rollart_reward_trajectories`` counts for the
        tenant) and trajectories whose reward failed."""
        return {"tenant": self.tenant, **self.stats}

    async def aclose(self) -> None:
        """Stop batching; the POSTs already in flight finish (and are counted). The client can be used
        again afterwards (in a new event loop)."""
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, *self._inflight, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
        self._flusher, self._http, self._wakeup = None, None, None
        self._sem = asyncio.Semaphore(self._max_concurrency)
        self._queue = []
