"""LLMProxy: the gateway EnvManagers share to reach inference workers (seed 004 §5.3).

It routes each request by its ``tag`` through the inference Cluster's ``@hw_mapping`` (first live
hardware type of the tag's preference, least-loaded worker within it), and carries partial rollouts
across ``suspend`` / ``model_update`` / ``resume``: a preempted request is continued with its prompt
plus the tokens generated so far (the prefix is recomputed under the new weights), and its output
records, per token, the policy version and behaviour logprob that produced it.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from rollart.cluster import Cluster
from rollart.rollout.types import GenerateOutput, GenerateRequest
from rollart.weights.base import WeightChannel

log = logging.getLogger(__name__)


class LLMProxy:
    """Shared by many EnvManagers; every method is a coroutine on the caller's event loop."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._aborted: set[str] = set()
        self._inflight: set[str] = set()
        self.version = 0
        self._by_hw: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    async def generate(self, request: GenerateRequest, tag: str) -> GenerateOutput:
        """Generate until the request stops or runs out of tokens, continuing across preemptions."""
        rid = request.request_id
        budget = request.sampling.max_new_tokens
        out: GenerateOutput | None = None
        self._inflight.add(rid)
        t0 = time.monotonic()
        try:
            req = request
            while True:
                if rid in self._aborted:
                    base = out or GenerateOutput(request_id=rid)
                    return base.model_copy(update={"finish_reason": "abort", "preempted": False})
                part: GenerateOutput = await self.cluster.generate(req, tag_name=tag)
                out = part if out is None else out.extend(part)
                if not part.preempted or rid in self._aborted:
                    break
                remaining = budget - len(out.output_token_ids)
                if remaining <= 0:
                    out = out.model_copy(update={"finish_reason": "length", "preempted": False})
                    break
                req = request.model_copy(
                    update={
                        "prompt_token_ids": list(request.prompt_token_ids) + out.output_token_ids,
                        "sampling": request.sampling.model_copy(update={"max_new_tokens": remaining}),
                    }
                )
            if rid in self._aborted:
                out = out.model_copy(update={"finish_reason": "abort", "preempted": False})
            stats = self._by_hw[out.hardware]
            stats["requests"] += 1
            stats["output_tokens"] += len(out.output_token_ids)
            stats["latency_s"] += time.monotonic() - t0
            return out
        finally:
            self._inflight.discard(rid)
            self._aborted.discard(rid)

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests for good (their callers get ``finish_reason="abort"`` and partial tokens)."""
        live = [r for r in request_ids if r in self._inflight]
        self._aborted.update(live)
        if live:
            await self.cluster.abort(live)

    async def suspend(self) -> None:
        """Preempt every in-flight request (partial tokens kept) and hold new ones."""
        await self.cluster.suspend()

    async def resume(self) -> None:
        await self.cluster.resume()

    async def model_update(self, weights: Any, version: int) -> None:
        """Load new weights on every worker (a state dict, or an ObjectRef of one)."""
        await self.cluster.update_weights(weights, version)
        self.version = version

    async def model_update_from(self, channel: WeightChannel, version: int) -> None:
        """Every worker fetches ``version`` from a weight channel itself (e.g. Mooncake)."""
        await self.cluster.load_weights_from(channel, version)
        self.version = version

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
