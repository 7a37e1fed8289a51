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

A page on a block is *needed* (used) while: its block is held (full attention), a cache's
entry names its block (sliding window), or a cache restores from it (recurrent snapshot);
otherwise it is cached. Window and snapshot pages carry the tick of the event at which
they last stopped being needed (their eviction order); every public call that changes
anything is one event with its own tick.

"""

from __future__ import annotations

from array import array

import math
from dataclasses import dataclass

from kvcache.config import CacheConfig, FullAttention, Recurrent, ReuseScope, SlidingWindow

PRIVATE = "private"

Key = tuple  # (ReuseScope, tuple[int, ...])


@dataclass
class RefBlock:
    pages: set  # pool indices this block has a page in
    seq: int  # creation order
    tick: int | None = None  # last release tick
    page_ticks: dict = None  # window / snapshot pool -> tick it last stopped being needed

    def __post_init__(self):
        if self.page_ticks is None:
            self.page_ticks = {}


@dataclass
class RefProbe:
    num_tokens: int
    num_tokens_before_hybrid_pruning: int


@dataclass
class RefMatch:
    raw: int
    full_blocks: int  # m: full blocks matched by the walk
    blocks: list  # the walk's full blocks, then the partial source if there is one
    num_tokens: int
    num_tokens_before_hybrid_pruning: int


@dataclass
class RefPoolStats:
    num_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int
    evicted_pages: int


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
        self.restore = None  # block whose snapshot the first resize restores (held)
        self.live_valid = True
        self.resized = False
        self.live = False  # holds a live recurrent page
        self.closed = False
        self.entries = {i: [] for i in mgr.attention_pools}

    @property
    def num_committed_tokens(self) -> int:
        return len(self.committed)

    def held_keys(self) -> set:
        keys = list(self.chain)
        for key in (self.source, self.restore):
            if key is not None:
                keys.append(key)
        return keys

    def resize(self, total: int) -> bool:
        return self._mgr._resize(self, total)

    def commit(self, new_tokens) -> None:
        self._mgr._commit(self, list(new_tokens))

    def close(self) -> None:
        self._mgr._close(self)

    def invalidate_live_state(self) -> None:
        self.live_valid = False


class RefManager:
    def __init__(self, config: CacheConfig):
        self.config = config
        self.tpb = config.tokens_per_block
        self.pool_pages = config.pool_pages
        self.life_cycles = tuple(config.life_cycles)
        self.attention_pools = [
            i for i, lc in enumerate(self.life_cycles) if not isinstance(lc, Recurrent)
        ]
        rec = [i for i, lc in enumerate(self.life_cycles) if isinstance(lc, Recurrent)]
        self.rec_pool = rec[0] if rec else None
        full = [i for i, lc in enumerate(self.life_cycles) if isinstance(lc, FullAttention)]
        self.full_pool = full[0] if full else None
        self.blocks: dict = {}
        self.free = list(self.pool_pages)
        self.open: list = []
        self._seq = 0
        self._tick = 0
        self.reuse_queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.hit_tokens_before = 0
        self.evicted_blocks = 0
        self.evicted_pages = [0] * len(self.life_cycles)

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
        return [c for c in self.open for k in c.held_keys() if k == key]

    def _needed(self, key, pool: int) -> bool:
        if pool == self.full_pool:
            return bool(self._holders(key))
        if pool == self.rec_pool:
            return any(c.restore == key for c in self.open)
        return any(key in c.entries[pool] for c in self.open)

    def _cached_pages(self) -> set:
        return {(k, i) for k, b in self.blocks.items() for i in b.pages if not self._needed(k, i)}

    def _stamp(self, tick: int, before: set) -> None:
        """End of an event: window and snapshot pages that are cached now but were not
        before it (they stopped being needed, or were attached unneeded) take its tick."""
        for key, i in self._cached_pages() - before:
            if i != self.full_pool:
                self.blocks[key].page_ticks[i] = tick

    def _event(self):
        return self._next_tick(), self._cached_pages()

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
            for i in blk.pages:
                if self._needed(key, i):
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
            assert self.free[i] + used[i] + cached[i] == self.pool_pages[i], (
                f"reference lost pages in pool {i}: free {self.free[i]} used {used[i]} "
                f"cached {cached[i]}"
            )
            assert self.free[i] >= 0
            out.append((self.free[i], used[i], cached[i]))
        return out

    def stats(self) -> RefStats:
        counts = self.pool_counts()
        pools = tuple(RefPoolStats(n, f, u, c, e)
                      for n, (f, u, c), e in zip(self.pool_pages, counts, self.evicted_pages))
        return RefStats(
            num_pages=sum(self.pool_pages),
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
            if c.restore is not None:
                assert self.rec_pool in self.blocks[c.restore].pages
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
            for i in blk.pages:
                if i != self.full_pool and not self._needed(key, i):
                    assert i in blk.page_ticks, "a cached page was never released"

    def _cached_in(self, pool: int) -> int:
        return sum(1 for k, b in self.blocks.items() if pool in b.pages
                   and not self._needed(k, pool))

    def _evict_one(self, pool: int) -> None:
        """Free one page of ``pool``: a whole unheld leaf block for full attention, else
        the pool's own oldest cached page."""
        if pool == self.full_pool:
            cands = [k for k in self.blocks
                     if not self._holders(k) and not self._children(k[0], k[1])]
            assert cands, "reference: nothing to evict although a page was counted evictable"
            key = min(cands,
                      key=lambda k: (self.blocks[k].tick, -self._depth(k), self.blocks[k].seq))
            self._remove(key)
            return
        cands = [k for k, b in self.blocks.items() if pool in b.pages
                 and not self._needed(k, pool)]
        assert cands, "reference: nothing to evict although a page was counted evictable"
        key = min(cands, key=lambda k: (self.blocks[k].page_ticks[pool], -self._depth(k),
                                        self.blocks[k].seq))
        self.blocks[key].pages.discard(pool)
        self.free[pool] += 1
        self.evicted_pages[pool] += 1
        self._prune_pageless(key)

    def _remove(self, key) -> None:
        blk = self.blocks.pop(key)
        self.evicted_blocks += 1
        for i in blk.pages:
            self.free[i] += 1
            self.evicted_pages[i] += 1
        self._prune_pageless(self._parent(key))

    def _prune_pageless(self, key) -> None:
        """An unheld block with no page and no child is removed at once (then its parent...)."""
        while key is not None and key in self.blocks:
            if self.blocks[key].pages or self._children(key[0], key[1]) or self._holders(key):
                return
            del self.blocks[key]
            self.evicted_blocks += 1
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

    def _block_ok_recurrent(self, blocks, m: int, x: int, scope, tokens) -> bool:
        """x ends at a snapshot: the end of a matched full block carrying one, or the end
        of a stored partial block (every token matched) carrying one."""
        if self.rec_pool is None or x == 0:
            return True
        d, r = divmod(x, self.tpb)
        if d > m:
            return False
        if r == 0:
            return self.rec_pool in self.blocks[blocks[d - 1]].pages
        key = (scope, tuple(tokens[:x]))
        return key in self.blocks and self.rec_pool in self.blocks[key].pages

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
            if self._block_ok_attention(blocks, x)
            and self._block_ok_recurrent(blocks, m, x, scope, tokens)
        )
        return RefMatch(raw, m, blocks, num, before)

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
        d, rest = divmod(L, tpb)
        chain = [(scope, tuple(tokens[: (j + 1) * tpb])) for j in range(d)]
        # Inside block d the cache copies the block the match used there.
        source = r.blocks[d] if rest else None
        c = RefCache(self, scope, tokens[:L], L, r.num_tokens_before_hybrid_pruning, chain, source)
        if self.rec_pool is not None and L:
            c.restore = chain[-1] if not rest else (scope, tuple(tokens[:L]))
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
        tick, before = self._event()
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
        if first:
            released = [k for k in (c.source, c.restore) if k is not None]
            if c.source is not None:
                m = len(c.committed) // tpb
                for i in self.attention_pools:
                    c.entries[i][m] = PRIVATE  # own copy of the partial block
            c.source = c.restore = None
            for key in released:
                self.blocks[key].tick = tick
            for key in released:
                self._prune_pageless(key)
        if first and self.rec_pool is not None:
            c.live = True
        c.capacity = total
        c.resized = True
        self._stamp(tick, before)
        return True

    def _commit(self, c: RefCache, new) -> None:
        assert not c.closed
        tpb = self.tpb
        if len(c.committed) + len(new) > c.capacity:
            raise ValueError("commit beyond capacity")
        if not new:
            return
        tick, before = self._event()
        old_h = len(c.committed)
        c.committed.extend(new)
        h = len(c.committed)
        for j in range(old_h // tpb, h // tpb):
            key = (c.scope, tuple(c.committed[: (j + 1) * tpb]))
            if key not in self.blocks:
                self.blocks[key] = RefBlock(set(), self._next_seq())
            self._attach_own(c, key, j)
            c.chain.append(key)
        for i in self.attention_pools:
            lc = self.life_cycles[i]
            if not isinstance(lc, SlidingWindow):
                continue
            first = max(0, (h + 1 - lc.window) // tpb)
            sink = math.ceil(lc.sink_tokens / tpb)
            for j in range(sink, first):
                if c.entries[i][j] == PRIVATE:
                    self.free[i] += 1  # a private page that left the window is freed
                c.entries[i][j] = None  # one on a block stays there, cached if unneeded
        if self.rec_pool is not None and h % tpb == 0 and c.live_valid:
            blk = self.blocks[c.chain[h // tpb - 1]]
            pool = self.rec_pool
            if pool not in blk.pages and self.free[pool] + self._cached_in(pool) > 0:
                self._take(pool)
                blk.pages.add(pool)
        self._stamp(tick, before)

    def _attach_own(self, c: RefCache, key, j: int) -> None:
        """The cache's own page of block j goes to ``key`` in every pool it lacks."""
        blk = self.blocks[key]
        for i in self.attention_pools:
            if i not in blk.pages and c.entries[i][j] == PRIVATE:
                blk.pages.add(i)
                c.entries[i][j] = key

    def _close(self, c: RefCache) -> None:
        if c.closed:
            return
        tick, before = self._event()
        tpb = self.tpb
        h = len(c.committed)
        full, rest = divmod(h, tpb)
        snapshot = c.live and c.live_valid
        live_kept = False
        stored = None
        if self.config.enable_partial_reuse and rest == 0 and snapshot and full:
            blk = self.blocks[c.chain[-1]]
            if self.rec_pool not in blk.pages:
                blk.pages.add(self.rec_pool)
                live_kept = True
        elif self.config.enable_partial_reuse and rest and self.attention_pools \
                and c.source is None:
            prefix = tuple(c.committed[: full * tpb])
            part = tuple(c.committed[full * tpb:])
            key = (c.scope, tuple(c.committed))
            siblings = [k for k in self._children(c.scope, prefix)
                        if k[1][full * tpb: h] == part]
            if key in self.blocks or not siblings or snapshot:
                if key not in self.blocks:
                    self.blocks[key] = RefBlock(set(), self._next_seq())
                    stored = key
                self._attach_own(c, key, full)
                if snapshot and self.rec_pool not in self.blocks[key].pages:
                    self.blocks[key].pages.add(self.rec_pool)
                    live_kept = True
        for key in c.held_keys() + ([stored] if stored else []):
            self.blocks[key].tick = tick
        for i, row in c.entries.items():
            self.free[i] += sum(1 for e in row if e == PRIVATE)
        if c.live and not live_kept:
            self.free[self.rec_pool] += 1
        c.live = False
        self.open.remove(c)
        c.closed = True
        c.entries = {i: [] for i in self.attention_pools}
        released = c.held_keys() + ([stored] if stored else [])
        c.source = c.restore = None
        c.chain = []
        for key in released:
            self._prune_pageless(key)
        self._stamp(tick, before)

    def clear_reusable_blocks(self) -> None:
        if self.open:
            raise RuntimeError("caches are open")
        for blk in self.blocks.values():
            for i in blk.pages:
                self.free[i] += 1
                self.evicted_pages[i] += 1
        self.evicted_blocks += len(self.blocks)
        self.blocks.clear()
