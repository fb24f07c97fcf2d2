"""The torch engine's prefix cache: keys and values of earlier sequences, reused by later requests
that start with the same tokens (a multi-turn session's next call, the next sample of a prompt).

A radix tree over token ids: each edge holds a run of tokens and, for each, the index of its keys and
values in a token pool (``[pool_tokens, layers, kv_heads, head_dim]``, keys and values). A request
that finishes (or is aborted) stores its sequence — the tokens whose keys and values its cache slot
holds — and only the tokens not already in the tree are copied. A request that joins looks up the
longest stored prefix of its sequence, copies those keys and values into its slot and prefills only
the rest.

Bounded by ``budget`` tokens (the pool's size; it grows by doubling up to it): storing evicts the
least recently used leaves first (a leaf's tokens are the end of some stored sequence, so a shared
beginning outlives the tails that extend it). Keys and values come from the weights that computed
them: the engine clears the cache when it loads new weights.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from rollart.models.kv_cache import StaticKVCache

__all__ = ["PrefixCache"]


class _Node:
    __slots__ = ("children", "last_used", "parent", "pool", "tokens")

    def __init__(self, tokens: list[int], pool: list[int], parent: _Node | None):
        self.tokens = tokens  # the run of token ids on the edge into this node
        self.pool = pool  # their keys' and values' rows in the pool
        self.parent = parent
        self.children: dict[int, _Node] = {}  # by first token
        self.last_used = 0


def _common(run: list[int], seq: Sequence[int], at: int) -> int:
    """How many tokens of ``run`` equal ``seq[at:]``'s first ones."""
    if list(seq[at : at + len(run)]) == run:
        return len(run)
    n = 0
    for a, b in zip(run, seq[at:]):
        if a != b:
            break
        n += 1
    return n


class PrefixCache:
    """Keys and values of stored token sequences, by prefix (module docstring)."""

    INITIAL_POOL = 1024

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError(f"prefix_cache_tokens={budget}: use 0 (off) or more tokens")
        self.budget = budget
        self.root = _Node([], [], None)
        self._clock = 0
        self._free: list[int] = []
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self.held = 0  # tokens stored now
        self.stats = {"stored_tokens": 0, "evicted_tokens": 0}

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def nbytes(self) -> int:
        if self._keys is None or self._values is None:
            return 0
        return self._keys.numel() * self._keys.element_size() + self._values.numel() * self._values.element_size()

    def clear(self, release: bool = False) -> None:
        """Forget every stored sequence; ``release`` also drops the pool's tensors."""
        self.root = _Node([], [], None)
        self.held = 0
        if release:
            self._keys = self._values = None
            self._free = []
        elif self._keys is not None:
            self._free = list(range(self._keys.shape[0]))

    # ------------------------------------------------------------------ lookup
    def match(self, seq: Sequence[int]) -> tuple[int, list[int]]:
        """The longest stored prefix of ``seq``: its length and its pool rows (marked as just used)."""
        if not self.enabled:
            return 0, []
        self._clock += 1
        node, i, rows = self.root, 0, []
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                break
            n = _common(child.tokens, seq, i)
            rows.extend(child.pool[:n])
            child.last_used = self._clock
            i += n
            if n < len(child.tokens):
                break
            node = child
        return i, rows

    def load(self, rows: list[int], cache: StaticKVCache, slot: int) -> None:
        """Copy the keys and values of pool ``rows`` into positions ``0 .. len(rows)-1`` of ``slot``."""
        assert self._keys is not None and self._values is not None
        idx = torch.tensor(rows, dtype=torch.long, device=self._keys.device)
        cache.write(slot, 0, self._keys.index_select(0, idx), self._values.index_select(0, idx))

    # ------------------------------------------------------------------ storing
    def store(self, seq: Sequence[int], cache: StaticKVCache, slot: int) -> int:
        """Store ``seq``, whose keys and values are positions ``0 .. len(seq)-1`` of ``slot``; the tokens
        newly stored (what was there already is kept; with too little room, a shorter prefix)."""
        if not self.enabled or not seq:
            return 0
        self._clock += 1
        node, i = self.root, 0
        path = {id(self.root)}
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                return self._add_leaf(node, seq, i, cache, slot, path)
            n = _common(child.tokens, seq, i)
            if n < len(child.tokens):  # the sequence leaves this edge in its middle: split it there
                child = self._split(node, child, n)
            child.last_used = self._clock
            path.add(id(child))
            node, i = child, i + n
        return 0

    def _split(self, parent: _Node, child: _Node, n: int) -> _Node:
        mid = _Node(child.tokens[:n], child.pool[:n], parent)
        mid.last_used = child.last_used
        child.tokens, child.pool, child.parent = child.tokens[n:], child.pool[n:], mid
        mid.children[child.tokens[0]] = child
        parent.children[mid.tokens[0]] = mid
        return mid

    def _add_leaf(
        self, node: _Node, seq: Sequence[int], at: int, cache: StaticKVCache, slot: int, path: set[int]
    ) -> int:
        rows = self._allocate(len(seq) - at, cache, path)
        if not rows:
            return 0
        keys, values = cache.read(slot, at, at + len(rows))
        assert self._keys is not None and self._values is not None
        idx = torch.tensor(rows, dtype=torch.long, device=self._keys.device)
        self._keys.index_copy_(0, idx, keys)
        self._values.index_copy_(0, idx, values)
        leaf = _Node(list(seq[at : at + len(rows)]), rows, node)
        leaf.last_used = self._clock
        node.children[leaf.tokens[0]] = leaf
        self.held += len(rows)
        self.stats["stored_tokens"] += len(rows)
        return len(rows)

    def _allocate(self, n: int, cache: StaticKVCache, keep: set[int]) -> list[int]:
        """Up to ``n`` free pool rows: the pool grows toward the budget, then least recently used leaves
        (none of ``keep``) are evicted."""
        want = min(n, self.budget)
        self._grow(want, cache)
        if len(self._free) < want:
            self._evict(want - len(self._free), keep)
        take = min(want, len(self._free))
        rows, self._free = self._free[:take], self._free[take:]
        return rows

    def _grow(self, want: int, cache: StaticKVCache) -> None:
        size = 0 if self._keys is None else self._keys.shape[0]
        needed = self.held + want
        if needed <= size or size >= self.budget:
            return
        new = max(size, min(self.INITIAL_POOL, self.budget))
        while new < needed and new < self.budget:
            new = min(2 * new, self.budget)
        shape = (new, cache.layers, cache.kv_heads, cache.head_dim)
        keys = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
        values = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
        if self._keys is not None and self._values is not None:
            keys[:size], values[:size] = self._keys, self._values
        self._keys, self._values = keys, values
        self._free.extend(range(size, new))

    def _evict(self, n: int, keep: set[int]) -> None:
        leaves: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self.root and id(node) not in keep:
                leaves.append((node.last_used, id(node), node))
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < n:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self._free.extend(leaf.pool)
            freed += len(leaf.pool)
            self.held -= len(leaf.pool)
            self.stats["evicted_tokens"] += len(leaf.pool)
            if not parent.children and parent is not self.root and id(parent) not in keep:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
