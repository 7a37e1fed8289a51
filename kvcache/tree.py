"""The block radix tree: one root per reuse scope, children keyed by their tokens' bytes.

The tree also owns the eviction order. A block is an eviction candidate when no open
cache holds it and it has no children; candidates leave in order of
``(release tick, -depth, creation seq)``: the oldest release first and, within one
release, the tail of a sequence before its head. The heap is lazy: entries are checked
when popped and the heap is rebuilt when stale entries pile up.

::

    root(scope) ── [t0..t31] ── [t32..t63] ── [t64..t95]
                                     └──────── [t32..t47']   (partial leaf)
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from .config import ReuseScope
from .pool import PagePool
from .tokens import TOKEN_BYTES, common_prefix_tokens


class Block:
    """One node of the tree: a full block of tokens, a partial (leaf) block, or a root."""

    __slots__ = (
        "key", "parent", "children", "sorted_keys", "pages", "holders", "tick", "depth", "seq",
        "alive", "scope",
    )

    def __init__(self, key: bytes, parent: Block | None, num_pools: int, depth: int, seq: int):
        self.key = key
        self.parent = parent
        self.children: dict[bytes, Block] = {}
        # Children's keys in byte order: the child sharing the longest prefix with a
        # lookup sits next to the lookup's insertion point (partial matching).
        self.sorted_keys: list[bytes] = []
        self.pages: list[int | None] = [None] * num_pools
        self.holders = 0
        self.tick = 0
        self.depth = depth
        self.seq = seq
        self.alive = True
        self.scope: ReuseScope | None = None  # set on roots only

    @property
    def num_tokens(self) -> int:
        return len(self.key) // TOKEN_BYTES

    def has_pages(self) -> bool:
        return any(p is not None for p in self.pages)

    def longest_common_child(self, query: bytes, pools: tuple[int, ...]
                             ) -> tuple[Block | None, int]:
        """The child sharing the most leading tokens with ``query``, and how many.

        Among children sharing that many, the first in key order with a page in every pool
        of ``pools``; (None, 0) when none has them or nothing is shared.
        """
        keys = self.sorted_keys
        at = bisect.bisect_left(keys, query)
        best = 0
        for i in (at - 1, at):
            if 0 <= i < len(keys):
                best = max(best, common_prefix_tokens(keys[i], query))
        if best == 0:
            return None, 0
        prefix = query[: best * TOKEN_BYTES]
        i = bisect.bisect_left(keys, prefix)
        while i < len(keys) and keys[i].startswith(prefix):
            child = self.children[keys[i]]
            if all(child.pages[p] is not None for p in pools):
                return child, best
            i += 1
        return None, 0

    def child_starting_with(self, tokens: bytes) -> Block | None:
        keys = self.sorted_keys
        i = bisect.bisect_left(keys, tokens)
        if i < len(keys) and keys[i].startswith(tokens):
            return self.children[keys[i]]
        return None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Block(depth={self.depth}, tokens={self.num_tokens}, holders={self.holders})"


class BlockTree:
    """Roots per scope, page attachment, holding and leaf-first LRU eviction."""

    def __init__(self, pools: Sequence[PagePool]) -> None:
        self.pools = list(pools)
        self.roots: dict[ReuseScope, Block] = {}
        # Pages attached to blocks no open cache holds, per pool: what eviction can free.
        self.reclaimable = [0] * len(self.pools)
        self.num_blocks = 0
        self.evicted_blocks = 0
        self.evicted_pages = [0] * len(self.pools)
        self._heap: list[tuple[int, int, int, Block]] = []
        self._seq = 0

    # -- structure -------------------------------------------------------------------

    def root(self, scope: ReuseScope) -> Block:
        root = self.roots.get(scope)
        if root is None:
            root = self.roots[scope] = Block(b"", None, len(self.pools), -1, self._next_seq())
            root.scope = scope
        return root

    def insert(self, parent: Block, key: bytes) -> Block:
        """A new child of ``parent`` (not yet holding pages or holders)."""
        block = Block(key, parent, len(self.pools), parent.depth + 1, self._next_seq())
        parent.children[key] = block
        bisect.insort(parent.sorted_keys, key)
        self.num_blocks += 1
        return block

    def attach(self, block: Block, pool: int, page: int) -> None:
        block.pages[pool] = page
        self.pools[pool].block_of[page] = block
        if block.holders == 0:
            self.reclaimable[pool] += 1

    def detach(self, block: Block, pool: int) -> int:
        page = block.pages[pool]
        assert page is not None
        block.pages[pool] = None
        self.pools[pool].block_of[page] = None
        if block.holders == 0:
            self.reclaimable[pool] -= 1
        return page

    # -- holding ---------------------------------------------------------------------

    def hold(self, block: Block) -> None:
        if block.holders == 0:
            for pool, page in enumerate(block.pages):
                if page is not None:
                    self.reclaimable[pool] -= 1
        block.holders += 1

    def hold_all(self, blocks: list[Block]) -> None:
        reclaimable = self.reclaimable
        single = len(reclaimable) == 1
        for block in blocks:
            if block.holders == 0:
                if single:
                    if block.pages[0] is not None:
                        reclaimable[0] -= 1
                else:
                    for pool, page in enumerate(block.pages):
                        if page is not None:
                            reclaimable[pool] -= 1
            block.holders += 1

    def release_all(self, blocks: list[Block], tick: int) -> None:
        """``release`` each of ``blocks`` (root to leaf order)."""
        reclaimable = self.reclaimable
        single = len(reclaimable) == 1  # the common case, without the inner loop
        for block in blocks:
            block.holders -= 1
            if block.holders:
                continue
            block.tick = tick
            if single:
                if block.pages[0] is not None:
                    reclaimable[0] += 1
            else:
                for pool, page in enumerate(block.pages):
                    if page is not None:
                        reclaimable[pool] += 1
            if not block.children:
                self._became_candidate(block)

    def release(self, block: Block, tick: int) -> None:
        block.holders -= 1
        if block.holders:
            return
        block.tick = tick
        for pool, page in enumerate(block.pages):
            if page is not None:
                self.reclaimable[pool] += 1
        self._became_candidate(block)

    # -- eviction --------------------------------------------------------------------

    def evict_until_free(self, pool: int, count: int) -> None:
        """Evict candidates one at a time until ``pool`` has ``count`` free pages."""
        target = self.pools[pool]
        while target.num_free < count:
            if not self._evict_one():
                raise RuntimeError(
                    f"pool {pool} needs {count} free pages but nothing is evictable; "
                    "callers must check free + reclaimable pages first"
                )

    def clear(self) -> None:
        """Evict every candidate; with nothing held, that empties the tree."""
        while self._evict_one():
            pass

    # -- internals -------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _evict_one(self) -> bool:
        while self._heap:
            tick, _, _, block = heapq.heappop(self._heap)
            if block.alive and not block.holders and not block.children and block.tick == tick:
                self.evicted_blocks += 1
                self._remove(block)
                return True
        return False

    def _became_candidate(self, block: Block) -> None:
        """``block`` has no holders; queue it if it is a leaf, drop it if it is also empty."""
        if block.children or block.parent is None:
            return
        if not block.has_pages():
            self._remove(block)
            return
        heapq.heappush(self._heap, (block.tick, -block.depth, block.seq, block))
        if len(self._heap) > 2 * self.num_blocks + 1024:
            self._compact()

    def _remove(self, block: Block) -> None:
        """Remove a leaf, freeing its pages; empty, unheld ancestors go with it."""
        while True:
            for pool, page in enumerate(block.pages):
                if page is not None:
                    self.detach(block, pool)
                    self.pools[pool].give_back(page)
                    self.evicted_pages[pool] += 1
            block.alive = False
            self.num_blocks -= 1
            parent = block.parent
            assert parent is not None
            del parent.children[block.key]
            keys = parent.sorted_keys
            del keys[bisect.bisect_left(keys, block.key)]
            if parent.children or parent.holders:
                return
            if parent.parent is None:
                del self.roots[parent.scope]
                return
            if parent.has_pages():
                heapq.heappush(self._heap, (parent.tick, -parent.depth, parent.seq, parent))
                return
            block = parent

    def _compact(self) -> None:
        live = {}
        for entry in self._heap:
            tick, _, _, block = entry
            if block.alive and not block.holders and not block.children and block.tick == tick:
                live[block.seq] = entry
        self._heap = list(live.values())
        heapq.heapify(self._heap)
