"""The block radix tree: one root per reuse scope, children keyed by their tokens' bytes.

The tree also owns page states and eviction, per pool (docs/kvcache.md, "Pages" and
"Eviction"):

- a full-attention page is *used* while an open cache holds its block and *cached* once
  none does; it leaves only with its block, and blocks leave leaf first, in order of
  ``(release tick, -depth, creation seq)`` (one lazy heap of blocks);
- a sliding-window or recurrent-snapshot page is *used* while an open cache references it
  (``PagePool.refs``) and *cached* otherwise, even on a block an open cache holds; it can
  leave on its own, oldest release first, in the same order (one lazy heap per pool).

Heap entries are checked when popped, and a heap is rebuilt when stale entries pile up, so
an eviction costs O(log n) whatever the tree's size.

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
    """One node of the tree: a full block of tokens, a partial (leaf) block, or a root.

    ``snapshot_lengths`` counts, per key length, the partial children that carry a
    recurrent snapshot (their end points are reusable; matching looks them up by length).
    """

    __slots__ = (
        "key", "parent", "children", "sorted_keys", "pages", "holders", "tick", "depth", "seq",
        "alive", "scope", "snapshot_lengths",
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
        self.snapshot_lengths: dict[int, int] | None = None  # made on first use

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
    """Roots per scope, page states, holding and per-pool LRU eviction.

    Args:
        pools: one PagePool per life cycle.
        full: the full-attention pool's index (None: no such life cycle).
        recurrent: the recurrent pool's index (None: no such life cycle).
        tokens_per_block: to tell partial blocks (whose snapshots matching looks up by
            length) from full ones.
    """

    def __init__(self, pools: Sequence[PagePool], full: int | None, recurrent: int | None,
                 tokens_per_block: int) -> None:
        self.pools = list(pools)
        self.full = full
        self.recurrent = recurrent
        self._block_bytes = tokens_per_block * TOKEN_BYTES
        self.roots: dict[ReuseScope, Block] = {}
        # Cached pages per pool (attached to a block, needed by no open cache): what
        # eviction can free.
        self.reclaimable = [0] * len(self.pools)
        self.num_blocks = 0
        self.evicted_blocks = 0
        self.evicted_pages = [0] * len(self.pools)
        self.attached = [0] * len(self.pools)  # pages on blocks (recurrent: snapshots kept)
        self._heap: list[tuple[int, int, int, Block]] = []
        self._page_heaps: list[list[tuple[int, int, int, int]]] = [[] for _ in self.pools]
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
        """Attach a page an open cache references (it becomes cached when released)."""
        block.pages[pool] = page
        self.pools[pool].block_of[page] = block
        self.attached[pool] += 1
        if pool == self.full and block.holders == 0:
            self.reclaimable[pool] += 1
        if pool == self.recurrent and len(block.key) < self._block_bytes:
            parent = block.parent
            assert parent is not None
            if parent.snapshot_lengths is None:
                parent.snapshot_lengths = {}
            n = len(block.key) // TOKEN_BYTES
            parent.snapshot_lengths[n] = parent.snapshot_lengths.get(n, 0) + 1

    def detach(self, block: Block, pool: int) -> int:
        page = block.pages[pool]
        assert page is not None
        p = self.pools[pool]
        if self._is_cached(block, pool, page):
            self.reclaimable[pool] -= 1
        block.pages[pool] = None
        p.block_of[page] = None
        self.attached[pool] -= 1
        if pool == self.recurrent and len(block.key) < self._block_bytes:
            lengths = block.parent.snapshot_lengths
            assert lengths is not None
            n = len(block.key) // TOKEN_BYTES
            lengths[n] -= 1
            if not lengths[n]:
                del lengths[n]
        return page

    # -- page references (open caches' needs) ----------------------------------------

    def ref(self, pool: int, page: int) -> None:
        p = self.pools[pool]
        p.refs[page] += 1
        if p.refs[page] == 1 and pool != self.full and p.block_of[page] is not None:
            self.reclaimable[pool] -= 1

    def unref(self, pool: int, page: int, tick: int) -> None:
        """Drop one reference. A page nobody references is freed if it is private, and
        becomes cached (stamped ``tick``) if it is a window or snapshot page on a block;
        a full-attention page on a block becomes cached when its block is released."""
        p = self.pools[pool]
        p.refs[page] -= 1
        if p.refs[page]:
            return
        block = p.block_of[page]
        if block is None:
            p.give_back(page)
        elif pool != self.full:
            self.reclaimable[pool] += 1
            p.cached_at[page] = tick
            heap = self._page_heaps[pool]
            heapq.heappush(heap, (tick, -block.depth, block.seq, page))
            if len(heap) > 2 * self.reclaimable[pool] + 1024:
                self._compact_pages(pool)

    # -- holding ---------------------------------------------------------------------

    def hold(self, block: Block) -> None:
        full = self.full
        if block.holders == 0 and full is not None and block.pages[full] is not None:
            self.reclaimable[full] -= 1
        block.holders += 1

    def hold_all(self, blocks: list[Block]) -> None:
        full = self.full
        reclaimable = self.reclaimable
        for block in blocks:
            if block.holders == 0 and full is not None and block.pages[full] is not None:
                reclaimable[full] -= 1
            block.holders += 1

    def release_all(self, blocks: list[Block], tick: int) -> None:
        """``release`` each of ``blocks`` (root to leaf order)."""
        full = self.full
        reclaimable = self.reclaimable
        for block in blocks:
            block.holders -= 1
            if block.holders:
                continue
            block.tick = tick
            if full is not None and block.pages[full] is not None:
                reclaimable[full] += 1
            if not block.children:
                self._became_candidate(block)

    # -- eviction --------------------------------------------------------------------

    def evict_until_free(self, pool: int, count: int) -> None:
        """Evict, in ``pool``'s own order, until it has ``count`` free pages."""
        target = self.pools[pool]
        evict = self._evict_block if pool == self.full else self._evict_page
        while target.num_free < count:
            if not evict(pool):
                raise RuntimeError(
                    f"pool {pool} needs {count} free pages but nothing is evictable; "
                    "callers must check free + reclaimable pages first"
                )

    def clear(self) -> None:
        """Free every page and block. Only valid while no cache is open."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                stack.append(child)
                for pool, page in enumerate(child.pages):
                    if page is not None:
                        child.pages[pool] = None
                        self.pools[pool].give_back(page)
                        self.evicted_pages[pool] += 1
                child.alive = False
        self.evicted_blocks += self.num_blocks
        self.num_blocks = 0
        self.roots.clear()
        self.reclaimable = [0] * len(self.pools)
        self.attached = [0] * len(self.pools)
        self._heap = []
        self._page_heaps = [[] for _ in self.pools]

    # -- internals -------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _is_cached(self, block: Block, pool: int, page: int) -> bool:
        if pool == self.full:
            return block.holders == 0
        return self.pools[pool].refs[page] == 0

    def _evict_block(self, pool: int) -> bool:
        while self._heap:
            tick, _, _, block = heapq.heappop(self._heap)
            if block.alive and not block.holders and not block.children and block.tick == tick:
                self._remove(block)
                return True
        return False

    def _evict_page(self, pool: int) -> bool:
        p, heap = self.pools[pool], self._page_heaps[pool]
        while heap:
            tick, _, seq, page = heapq.heappop(heap)
            block = p.block_of[page]
            if (block is None or block.seq != seq or p.refs[page]
                    or p.cached_at[page] != tick):
                continue  # stale: re-referenced, moved or freed since it was queued
            self.detach(block, pool)
            p.give_back(page)
            self.evicted_pages[pool] += 1
            if not block.holders and not block.children and not block.has_pages():
                self._remove(block)
            return True
        return False

    def _became_candidate(self, block: Block) -> None:
        """``block`` has no holders and no children: queue it, or drop it if it is empty."""
        if block.parent is None:
            return
        if not block.has_pages():
            self._remove(block)
        elif self.full is not None:
            heapq.heappush(self._heap, (block.tick, -block.depth, block.seq, block))
            if len(self._heap) > 2 * self.num_blocks + 1024:
                self._compact()

    def _remove(self, block: Block) -> None:
        """Remove an unheld leaf, freeing its pages; empty, unheld ancestors go with it."""
        pools, reclaimable, evicted = self.pools, self.reclaimable, self.evicted_pages
        while True:
            # An unheld block's pages are all cached (no open cache references them).
            for pool, page in enumerate(block.pages):
                if page is not None:
                    if pool == self.recurrent:
                        self.detach(block, pool)  # keeps the parent's snapshot counts
                    else:
                        block.pages[pool] = None
                        reclaimable[pool] -= 1
                        self.attached[pool] -= 1
                    pools[pool].give_back(page)  # clears the page's back pointer
                    evicted[pool] += 1
            block.alive = False
            self.num_blocks -= 1
            self.evicted_blocks += 1
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
                self._became_candidate(parent)
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

    def _compact_pages(self, pool: int) -> None:
        p = self.pools[pool]
        live = {}
        for entry in self._page_heaps[pool]:
            tick, _, seq, page = entry
            block = p.block_of[page]
            if block is not None and block.seq == seq and not p.refs[page] \
                    and p.cached_at[page] == tick:
                live[page] = entry
        heap = self._page_heaps[pool] = list(live.values())
        heapq.heapify(heap)
