"""CUDA graphs of the torch engine's decode step, one per (batch bucket, context bucket).

A decode step of a small model on a GPU is bound by kernel launches, not by the device: hundreds of
small kernels, each launched from Python. :class:`DecodeGraphs` captures
:meth:`~rollart.models.decoder.StaticDecoder.decode` once per shape and replays it: the step's token
ids and positions are copied into static input buffers (one host-to-device copy), the graph runs every
layer's kernels at once, and its output (the final hidden states) is projected to logits outside it. With ``compile`` the
decoder's elementwise steps are fused by ``torch.compile`` first (a norm, the rotary embedding, the SiLU
gate: one kernel each instead of several), which a capture then records; should that fail, the plain
steps are captured instead.

Shapes are bucketed so that few graphs serve every batch: the rows are the cache slots
``0 .. B-1`` with ``B`` the next power of two above the highest running slot (free slots in that range
compute a throw-away row at position 0), and the attention reads the first ``C`` positions, ``C`` the
next power of two (at least 64) above the longest running sequence. A graph is captured the first time
its shape is needed, during a real step: the warm-up runs on that step's inputs and writes the same keys
and values the replay writes. Graphs hold the addresses of the KV cache and the weights: they are
dropped when the cache is reallocated (it grew, or the engine slept) and when the engine slept at level
2 (the weights' storage was freed and allocated again).
"""

from __future__ import annotations

import logging

import torch

from rollart.models.decoder import StaticDecoder

log = logging.getLogger(__name__)

__all__ = ["DecodeGraphs", "bucket"]


def bucket(n: int, floor: int, ceiling: int) -> int:
    """The smallest power of two ``>= max(n, floor)``, at most ``ceiling``."""
    size = floor
    while size < n:
        size *= 2
    return min(size, ceiling)


class DecodeGraphs:
    """Captured decode steps of ``decoder`` on its (CUDA) device (module docstring)."""

    MIN_COLUMNS = 64

    def __init__(self, decoder: StaticDecoder, max_rows: int):
        self.decoder = decoder
        self.device = decoder.cache.device
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        self._host = torch.zeros((2, max_rows), dtype=torch.long, pin_memory=True)
        self._inputs = torch.zeros((2, max_rows), dtype=torch.long, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: object | None = None
        self._generation = -1  # the cache generation the graphs were captured against
        self.captures = 0
        self.replays = 0

    def reset(self) -> None:
        """Drop every graph (the cache or the weights moved)."""
        self._graphs.clear()
        self._pool = None
        self._generation = -1

    def run(self, ids: list[int], positions: list[int]) -> torch.Tensor:
        """Decode slots ``0 .. len(ids)-1``; logits ``[len(ids), V]``."""
        cache = self.decoder.cache
        if cache.generation != self._generation:
            self.reset()
            self._generation = cache.generation
        n = len(ids)
        rows = bucket(n, 1, cache.slots)
        columns = bucket(max(positions) + 1, self.MIN_COLUMNS, cache.capacity)
        host = self._host
        host[:, :rows].zero_()  # rows past n: free slots, a throw-away token at position 0
        host[0, :n] = torch.tensor(ids, dtype=torch.long)
        host[1, :n] = torch.tensor(positions, dtype=torch.long)
        self._inputs[:, :rows].copy_(host[:, :rows], non_blocking=True)
        key = (rows, columns)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(rows, columns)
            except Exception:
                if not self.decoder.ops.compiled:
                    raise
                # the fused kernels failed to compile or to be captured: the plain ones serve from now on
                log.warning(
                    "decode graphs: capturing the torch.compile'd steps failed; capturing the plain ones", exc_info=True
                )
                self.decoder.ops = type(self.decoder.ops)()
                self.reset()
                self._generation = cache.generation
                entry = self._capture(rows, columns)
            self._graphs[key] = entry
        else:
            entry[0].replay()
            self.replays += 1
        return self.decoder.head(entry[1][:n])

    def _capture(self, rows: int, columns: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, positions = self._inputs[0, :rows], self._inputs[1, :rows]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up on this step's inputs (it writes what the replay writes)
            for _ in range(2):
                self.decoder.decode(ids, positions, columns)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.decoder.decode(ids, positions, columns)
        if self._pool is None:
            self._pool = graph.pool()
        graph.replay()  # capturing ran nothing: this step's decode
        self.captures += 1
        log.debug("captured the decode step at %d rows x %d columns", rows, columns)
        return graph, out
