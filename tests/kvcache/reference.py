"""A slow, obviously-correct reference model of ``kvcache`` (docs/kvcache.md).

Written from the semantics page alone, with data structures chosen to be unlike a radix
tree: every block lives in one flat dict keyed by ``(scope, every token up to and
including the block)``; parents, children and holders are recomputed by brute force on
every question; matching tries every prefix length; eviction sorts every evictable block.
Pages are not named, only counted: a pool is a number of free pages, and a page's state
(used or cached) is derived from who has it.

Where a cache keeps a page for block ``j`` of pool ``i`` it records where that page lives:

- ``PRIVATE``: the cache's own page, attached to no block (freed when the cache lets go);
- a block key: the page attached to that block (shared with every cache naming that key);
- ``None``: no page (a sliding-window page that left the window, or was never held).

Decisions where docs/kvcache.md leaves room are named in ``ReferenceChoices`` so a test
can say which reading it holds the implementation to.
"""

from __future__ import annotations

from array import array

import math
from dataclasses import dataclass

from kvcache.config import CacheConfig, FullAttention, Recurrent, ReuseScope, SlidingWindow

PRIVATE = "private"

Key = tuple  # (ReuseScope, tuple[int, ...])


@dataclass(frozen=True)
class ReferenceChoices:
    """Readings of the spec where it could be read two ways."""

    # An empty commit is a no-op. (Read literally, "a snapshot is kept at the end of each
    # commit call that ends on a block boundary" would make an empty commit on a boundary
    # whose block lacks a snapshot, because taking one failed earlier, try again.)
    snapshot_on_empty_commit: bool = False
    # At close, a cache that did its first resize but never committed past a partial
    # reuse (committed still ends inside a block, own copy of it) stores that block.
    store_partial_without_commit: bool = True
    # When a pool needs a page, eviction walks the one global order (tick, -depth, seq)
    # and stops once that pool has a free page, even if evicted blocks had no page there.
    evict_in_global_order: bool = True
    # clear_reusable_blocks() counts its evictions in stats().evicted_blocks.
    count_clear_as_evictions: bool = True


@dataclass
class RefBlock:
    pages: set  # pool indices this block has a page in
    seq: int  # creation order
    tick: int | None = None  # last release tick


@dataclass
class RefProbe:
    num_tokens: int
    num_tokens_before_hybrid_pruning: int


@dataclass
class RefMatch:
    raw: int
    full_blocks: int  # m: full blocks matched by the walk
    source: Key | None  # partial source (None when there is none)
    num_tokens: int
    num_tokens_before_hybrid_pruning: int


@dataclass
class RefPoolStats:
    num_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int


@dataclass
class RefStats:
    num_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int
    pools: tuple
    reuse_queries: int
    query_tokens: int
    hit_tokens: int
    hit_tokens_before_hybrid_pruning: int
    evicted_blocks: int


def _scope(scope):
    return ReuseScope() if scope is None else scope


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RefCache:
    def __init__(self, mgr: RefManager, scope, committed, reused, before, chain, source):
        self._mgr = mgr
        self.scope = scope
        self.committed = list(committed)
        self.num_reused_tokens = reused
        self.num_tokens_before_hybrid_pruning = before
        self.capacity = reused
        self.chain = list(chain)  # keys of the full committed blocks, in order
        self.source = source  # partial source, held until the first resize
        self.resized = False
        self.live = False  # holds a live recurrent page
        self.closed = False
        self.entries = {i: [] for i in mgr.attention_pools}

    @property
    def num_committed_tokens(self) -> int:
        return len(self.committed)

    def held_keys(self) -> set:
        keys = set(self.chain)
        if self.source is not None:
            keys.add(self.source)
        return keys

    def resize(self, total: int) -> bool:
        return self._mgr._resize(self, total)

    def commit(self, new_tokens) -> None:
        self._mgr._commit(self, list(new_tokens))

    def close(self) -> None:
        self._mgr._close(self)


class RefManager:
    def __init__(self, config: CacheConfig, choices: ReferenceChoices = ReferenceChoices()):
        self.config = config
        self.choices = choices
        self.tpb = config.tokens_per_block
        self.num_pages = config.num_pages
        self.life_cycles = tuple(config.life_cycles)
        self.attention_pools = [
            i for i, lc in enumerate(self.life_cycles) if not isinstance(lc, Recurrent)
        ]
        rec = [i for i, lc in enumerate(self.life_cycles) if isinstance(lc, Recurrent)]
        self.rec_pool = rec[0] if rec else None
        self.blocks: dict = {}
        self.free = [self.num_pages] * len(self.life_cycles)
        self.open: list = []
        self._seq = 0
        self._tick = 0
        self.reuse_queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.hit_tokens_before = 0
        self.evicted_blocks = 0

    # ----------------------------------------------------------------- tree by brute force
    def _parent_len(self, key) -> int:
        return ((len(key[1]) - 1) // self.tpb) * self.tpb

    def _parent(self, key):
        """Parent key, or None for the scope root."""
        plen = self._parent_len(key)
        return None if plen == 0 else (key[0], key[1][:plen])

    def _depth(self, key) -> int:
        return (len(key[1]) - 1) // self.tpb

    def _children(self, scope, prefix) -> list:
        n = len(prefix)
        return [
            k
            for k in self.blocks
            if k[0] == scope and self._parent_len(k) == n and k[1][:n] == prefix
        ]

    def _holders(self, key) -> list:
        return [c for c in self.open if key in c.held_keys()]

    def _is_full(self, key) -> bool:
        return len(key[1]) % self.tpb == 0

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # ----------------------------------------------------------------- page accounting
    def pool_counts(self) -> list:
        """(free, used, cached) per pool, derived from who has each page."""
        used = [0] * len(self.life_cycles)
        cached = [0] * len(self.life_cycles)
        for key, blk in self.blocks.items():
            held = bool(self._holders(key))
            for i in blk.pages:
                if held:
                    used[i] += 1
                else:
                    cached[i] += 1
        for c in self.open:
            for i, row in c.entries.items():
                used[i] += sum(1 for e in row if e == PRIVATE)
            if c.live:
                used[self.rec_pool] += 1
        out = []
        for i in range(len(self.life_cycles)):
            assert self.free[i] + used[i] + cached[i] == self.num_pages, (
                f"reference lost pages in pool {i}: free {self.free[i]} used {used[i]} "
                f"cached {cached[i]}"
            )
            assert self.free[i] >= 0
            out.append((self.free[i], used[i], cached[i]))
        return out

    def stats(self) -> RefStats:
        counts = self.pool_counts()
        pools = tuple(RefPoolStats(self.num_pages, f, u, c) for f, u, c in counts)
        return RefStats(
            num_pages=self.num_pages * len(pools),
            free_pages=sum(p.free_pages for p in pools),
            used_pages=sum(p.used_pages for p in pools),
            cached_pages=sum(p.cached_pages for p in pools),
            pools=pools,
            reuse_queries=self.reuse_queries,
            query_tokens=self.query_tokens,
            hit_tokens=self.hit_tokens,
            hit_tokens_before_hybrid_pruning=self.hit_tokens_before,
            evicted_blocks=self.evicted_blocks,
        )

    def check(self) -> None:
        """The reference's own consistency (a bug here is a bug in the test)."""
        self.pool_counts()
        for c in self.open:
            for j, key in enumerate(c.chain):
                assert key in self.blocks, "a held block vanished"
                assert key[1] == tuple(c.committed[: (j + 1) * self.tpb])
            assert len(c.chain) == len(c.committed) // self.tpb
            if c.source is not None:
                assert c.source in self.blocks
            for i, row in c.entries.items():
                assert len(row) == math.ceil(c.capacity / self.tpb)
                for e in row:
                    if e not in (None, PRIVATE):
                        assert i in self.blocks[e].pages, "cache names a page its block lost"
        for key, blk in self.blocks.items():
            assert blk.pages or self._children(key[0], key[1]) or self._holders(key)
            parent = self._parent(key)
            assert parent is None or parent in self.blocks, "orphan block"
            if not self._holders(key):
                assert blk.tick is not None, "unheld block never released"

    def _cached_in(self, pool: int) -> int:
        return sum(1 for k, b in self.blocks.items() if pool in b.pages and not self._holders(k))

    def _evict_one(self, pool: int | None = None) -> None:
        cands = [k for k in self.blocks if not self._holders(k) and not self._children(k[0], k[1])]
        if pool is not None and not self.choices.evict_in_global_order:
            cands = [k for k in cands if pool in self.blocks[k].pages] or cands
        assert cands, "reference: nothing to evict although a page was counted evictable"
        key = min(cands, key=lambda k: (self.blocks[k].tick, -self._depth(k), self.blocks[k].seq))
        self._remove(key)
        self.evicted_blocks += 1

    def _remove(self, key) -> None:
        blk = self.blocks.pop(key)
        for i in blk.pages:
            self.free[i] += 1
        self._prune_pageless(self._parent(key))

    def _prune_pageless(self, key) -> None:
        """A block with no page and no child is removed at once (then its parent...)."""
        while key is not None and key in self.blocks:
            if self.blocks[key].pages or self._children(key[0], key[1]):
                return
            assert not self._holders(key), "reference: a held block lost every page"
            del self.blocks[key]
            key = self._parent(key)

    def _take(self, pool: int) -> None:
        while self.free[pool] == 0:
            self._evict_one(pool)
        self.free[pool] -= 1

    # ----------------------------------------------------------------- matching
    def _block_ok_attention(self, blocks, x: int) -> bool:
        tpb = self.tpb
        last = math.ceil(x / tpb) - 1
        for i, lc in enumerate(self.life_cycles):
            if isinstance(lc, FullAttention):
                needed = range(last + 1)
            elif isinstance(lc, SlidingWindow):
                first = max(0, (x + 1 - lc.window) // tpb)
                sink = math.ceil(lc.sink_tokens / tpb)
                needed = set(range(first, last + 1)) | set(range(min(sink, last + 1)))
            else:
                continue
            if any(i not in self.blocks[blocks[j]].pages for j in needed):
                return False
        return True

    def _block_ok_recurrent(self, blocks, m: int, x: int) -> bool:
        if self.rec_pool is None or x == 0:
            return True
        if x % self.tpb or x // self.tpb > m:
            return False
        return self.rec_pool in self.blocks[blocks[x // self.tpb - 1]].pages

    def _match(self, tokens, scope) -> RefMatch:
        tokens = tuple(tokens)
        scope = _scope(scope)
        tpb, n = self.tpb, len(tokens)
        blocks = []
        while (len(blocks) + 1) * tpb <= n:
            key = (scope, tokens[: (len(blocks) + 1) * tpb])
            if key not in self.blocks:
                break
            blocks.append(key)
        m = len(blocks)
        e = m * tpb
        source, p = None, 0
        if self.config.enable_partial_reuse and e < n:
            # docs/kvcache.md, Matching 2: p is the longest common prefix with ANY child;
            # the source is the first child in key order (bytes of array('I')) among those
            # sharing p tokens that has a page in every attention pool; none: no extension.
            look = tokens[e : e + tpb]
            children = self._children(scope, tokens[:e])
            shared = {key: _common_prefix(key[1][e:], look) for key in children}
            best = max(shared.values(), default=0)
            if best > 0:
                eligible = [key for key, q in shared.items() if q == best and all(
                    i in self.blocks[key].pages for i in self.attention_pools)]
                if eligible:
                    source = min(eligible, key=lambda key: array("I", key[1][e:]).tobytes())
                    p = best
                    blocks.append(source)
        raw = e + p
        before = max(x for x in range(raw + 1) if self._block_ok_attention(blocks, x))
        num = max(
            x
            for x in range(raw + 1)
            if self._block_ok_attention(blocks, x) and self._block_ok_recurrent(blocks, m, x)
        )
        return RefMatch(raw, m, source, num, before)

    # ----------------------------------------------------------------- public API
    def probe_reuse(self, tokens, scope=None) -> RefProbe:
        r = self._match(tokens, scope)
        return RefProbe(r.num_tokens, r.num_tokens_before_hybrid_pruning)

    def create_kv_cache(self, tokens, scope=None) -> RefCache:
        tokens = list(tokens)
        scope = _scope(scope)
        r = self._match(tokens, scope)
        L, tpb = r.num_tokens, self.tpb
        self.reuse_queries += 1
        self.query_tokens += len(tokens)
        self.hit_tokens += L
        self.hit_tokens_before += r.num_tokens_before_hybrid_pruning
        chain = [(scope, tuple(tokens[: (j + 1) * tpb])) for j in range(L // tpb)]
        source = r.source if L > r.full_blocks * tpb else None
        c = RefCache(self, scope, tokens[:L], L, r.num_tokens_before_hybrid_pruning, chain, source)
        row_keys = chain + ([source] if source is not None else [])
        assert len(row_keys) == math.ceil(L / tpb)
        for i in self.attention_pools:
            lc = self.life_cycles[i]
            if isinstance(lc, SlidingWindow):
                first = max(0, (L + 1 - lc.window) // tpb)
                sink = math.ceil(lc.sink_tokens / tpb)
                c.entries[i] = [
                    k if (j >= first or j < sink) else None for j, k in enumerate(row_keys)
                ]
            else:
                c.entries[i] = list(row_keys)
        self.open.append(c)
        return c

    def _resize(self, c: RefCache, total: int) -> bool:
        assert not c.closed
        if total < c.num_committed_tokens:
            raise ValueError("total below committed")
        tpb = self.tpb
        old_blocks = math.ceil(c.capacity / tpb)
        new_blocks = math.ceil(total / tpb)
        first = not c.resized
        need = [0] * len(self.life_cycles)
        for i in self.attention_pools:
            need[i] = max(0, new_blocks - old_blocks) + (1 if first and c.source is not None else 0)
        if self.rec_pool is not None and first:
            need[self.rec_pool] = 1
        for i, k in enumerate(need):
            if k > self.free[i] + self._cached_in(i):
                return False
        for i, k in enumerate(need):
            for _ in range(k):
                self._take(i)
        for i in self.attention_pools:
            row = c.entries[i]
            for j in range(new_blocks, old_blocks):  # shrink: whole uncommitted blocks
                assert row[j] == PRIVATE
                self.free[i] += 1
            del row[new_blocks:]
            row.extend([PRIVATE] * (new_blocks - len(row)))
        if first and c.source is not None:
            m = len(c.committed) // tpb
            for i in self.attention_pools:
                c.entries[i][m] = PRIVATE  # own copy of the partial block
            released = c.source
            c.source = None
            self.blocks[released].tick = self._next_tick()
        if first and self.rec_pool is not None:
            c.live = True
        c.capacity = total
        c.resized = True
        return True

    def _commit(self, c: RefCache, new) -> None:
        assert not c.closed
        tpb = self.tpb
        if len(c.committed) + len(new) > c.capacity:
            raise ValueError("commit beyond capacity")
        old_h = len(c.committed)
        c.committed.extend(new)
        h = len(c.committed)
        for j in range(old_h // tpb, h // tpb):
            key = (c.scope, tuple(c.committed[: (j + 1) * tpb]))
            if key in self.blocks:
                blk = self.blocks[key]
                for i in self.attention_pools:
                    assert c.entries[i][j] == PRIVATE
                    if i not in blk.pages:
                        blk.pages.add(i)
                        c.entries[i][j] = key
            else:
                for i in self.attention_pools:
                    assert c.entries[i][j] == PRIVATE
                    c.entries[i][j] = key
                self.blocks[key] = RefBlock(set(self.attention_pools), self._next_seq())
            c.chain.append(key)
        for i in self.attention_pools:
            lc = self.life_cycles[i]
            if not isinstance(lc, SlidingWindow):
                continue
            first = max(0, (h + 1 - lc.window) // tpb)
            sink = math.ceil(lc.sink_tokens / tpb)
            for j in range(sink, first):
                self._drop_window_page(c, i, j)
        if (
            self.rec_pool is not None
            and h > 0
            and h % tpb == 0
            and (new or self.choices.snapshot_on_empty_commit)
        ):
            blk = self.blocks[c.chain[h // tpb - 1]]
            pool = self.rec_pool
            if pool not in blk.pages and self.free[pool] + self._cached_in(pool) > 0:
                self._take(pool)
                blk.pages.add(pool)

    def _drop_window_page(self, c: RefCache, i: int, j: int) -> None:
        e = c.entries[i][j]
        c.entries[i][j] = None
        if e is None:
            return
        if e == PRIVATE:
            self.free[i] += 1
            return
        if any(j < len(o.entries[i]) and o.entries[i][j] == e for o in self.open if o is not c):
            return
        self.blocks[e].pages.discard(i)
        self.free[i] += 1
        self._prune_pageless(e)

    def _close(self, c: RefCache) -> None:
        if c.closed:
            return
        tpb = self.tpb
        h = len(c.committed)
        stored = None
        committed_past_reuse = h > c.num_reused_tokens
        if (
            self.config.enable_partial_reuse
            and h % tpb
            and c.source is None  # so the cache has its own copy of the partial block
            and (committed_past_reuse or self.choices.store_partial_without_commit)
        ):
            m = h // tpb
            prefix = tuple(c.committed[: m * tpb])
            part = tuple(c.committed[m * tpb : h])
            if not any(k[1][m * tpb : h] == part for k in self._children(c.scope, prefix)):
                stored = (c.scope, tuple(c.committed))
                for i in self.attention_pools:
                    assert c.entries[i][m] == PRIVATE
                    c.entries[i][m] = stored
                self.blocks[stored] = RefBlock(set(self.attention_pools), self._next_seq())
        tick = self._next_tick()
        for key in c.held_keys() | ({stored} if stored else set()):
            self.blocks[key].tick = tick
        for i, row in c.entries.items():
            self.free[i] += sum(1 for e in row if e == PRIVATE)
        if c.live:
            self.free[self.rec_pool] += 1
            c.live = False
        self.open.remove(c)
        c.closed = True
        c.entries = {i: [] for i in self.attention_pools}

    def clear_reusable_blocks(self) -> None:
        if self.open:
            raise RuntimeError("caches are open")
        while self.blocks:
            before = self.evicted_blocks
            self._evict_one()
            if not self.choices.count_clear_as_evictions:
                self.evicted_blocks = before
