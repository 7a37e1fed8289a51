"""KVCacheManager: the public face of the package.

One manager per replica (or per simulated replica). It is synchronous and not thread-safe:
the engine's scheduler calls it from one thread.

    mgr = KVCacheManager(CacheConfig(tokens_per_block=32, num_pages=256))
    probe = mgr.probe_reuse(prompt[:-1], scope=ReuseScope(salt="tenant-a"))
    with mgr.create_kv_cache(prompt[:-1], scope=ReuseScope(salt="tenant-a")) as cache:
        cache.resize(len(prompt) + max_new_tokens)
        cache.commit(prompt[cache.num_reused_tokens:])   # after computing their KV
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cache import KVCache
from .config import CacheConfig, FullAttention, PageLayout, Recurrent, ReuseScope, SlidingWindow
from .match import Matcher, ReuseProbe
from .pool import PagePool
from .tokens import as_token_array
from .tree import BlockTree


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Which pool index plays which role (derived from ``CacheConfig.life_cycles``)."""

    attention: tuple[int, ...]  # FullAttention and SlidingWindow pools
    full: int | None  # the FullAttention pool
    windows: tuple[tuple[int, int, int], ...]  # (pool, window, sink blocks)
    recurrent: int | None
    names: tuple[str, ...]  # per pool, for statistics

    @classmethod
    def of(cls, config: CacheConfig) -> PoolLayout:
        lcs = config.life_cycles
        return cls(
            attention=tuple(i for i, lc in enumerate(lcs) if not isinstance(lc, Recurrent)),
            full=next((i for i, lc in enumerate(lcs) if isinstance(lc, FullAttention)), None),
            windows=tuple(
                (i, lc.window, config.sink_blocks(lc))
                for i, lc in enumerate(lcs)
                if isinstance(lc, SlidingWindow)
            ),
            recurrent=next((i for i, lc in enumerate(lcs) if isinstance(lc, Recurrent)), None),
            names=tuple(_name(lc) for lc in lcs),
        )


def _name(lc) -> str:
    if isinstance(lc, SlidingWindow):
        sinks = f", sink={lc.sink_tokens}" if lc.sink_tokens else ""
        return f"sliding_window({lc.window}{sinks})"
    return "recurrent" if isinstance(lc, Recurrent) else "full_attention"


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One life cycle's pool. ``free + used + cached == num_pages``."""

    life_cycle: str  # "full_attention", "sliding_window(W)" or "recurrent"
    num_pages: int
    free_pages: int
    used_pages: int  # needed by open caches
    cached_pages: int  # attached to tree blocks, needed by no open cache: reusable, evictable
    evicted_pages: int  # cached pages freed so far to make room (or by clear_reusable_blocks)
    block_pages: int = 0  # attached to tree blocks, needed or not (recurrent: snapshots kept)


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """Totals over pools, per-pool figures, and reuse counters (probes not counted)."""

    num_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int
    pools: tuple[PoolStats, ...]
    open_caches: int
    cached_blocks: int
    reuse_queries: int
    query_tokens: int
    hit_tokens: int
    hit_tokens_before_hybrid_pruning: int
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class KVCacheManager:
    """Paged KV cache with a block radix tree, reuse matching and LRU eviction.

    Args:
        config: what to manage.
        layouts: optional real storage, one ``PageLayout`` (or None) per life cycle.
    """

    def __init__(self, config: CacheConfig,
                 layouts: Sequence[PageLayout | None] | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        if layouts is not None and len(layouts) != len(config.life_cycles):
            raise ValueError(
                f"layouts has {len(layouts)} entries but config has "
                f"{len(config.life_cycles)} life cycles; give one (or None) per life cycle"
            )
        self.config = config
        self.layout = PoolLayout.of(config)
        self._pools = [
            PagePool(pages, layouts[i] if layouts else None)
            for i, pages in enumerate(config.pool_pages)
        ]
        self._tree = BlockTree(self._pools, self.layout.full, self.layout.recurrent,
                               config.tokens_per_block)
        self._matcher = Matcher(config, self._tree, self.layout)
        self._open: dict[int, KVCache] = {}
        self._tick = 0
        self._queries = self._query_tokens = self._hits = self._hits_attention = 0

    # -- the contract ----------------------------------------------------------------

    def probe_reuse(self, tokens: Sequence[int], scope: ReuseScope | None = None) -> ReuseProbe:
        """Tokens of ``tokens`` reusable right now. Holds nothing, changes nothing."""
        return self._matcher.probe(as_token_array(tokens), _scope(scope))

    def create_kv_cache(self, tokens: Sequence[int], scope: ReuseScope | None = None) -> KVCache:
        """A cache for a sequence starting with ``tokens``, holding its reusable prefix.

        Allocates no page (``resize`` does), so it never fails for lack of capacity.
        """
        array_tokens = as_token_array(tokens)
        scope = _scope(scope)
        match = self._matcher.match(array_tokens, scope)
        cache = KVCache(self, scope, array_tokens, match)
        self._open[id(cache)] = cache
        self._queries += 1
        self._query_tokens += len(array_tokens)
        self._hits += match.probe.num_tokens
        self._hits_attention += match.probe.num_tokens_before_hybrid_pruning
        return cache

    def stats(self) -> ManagerStats:
        pools = []
        for i, pool in enumerate(self._pools):
            cached = self._tree.reclaimable[i]
            free = pool.num_free
            pools.append(PoolStats(self.layout.names[i], pool.num_pages, free,
                                   pool.num_pages - free - cached, cached,
                                   self._tree.evicted_pages[i], self._tree.attached[i]))
        return ManagerStats(
            num_pages=sum(p.num_pages for p in pools),
            free_pages=sum(p.free_pages for p in pools),
            used_pages=sum(p.used_pages for p in pools),
            cached_pages=sum(p.cached_pages for p in pools),
            pools=tuple(pools),
            open_caches=len(self._open),
            cached_blocks=self._tree.num_blocks,
            reuse_queries=self._queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hits,
            hit_tokens_before_hybrid_pruning=self._hits_attention,
            evicted_blocks=self._tree.evicted_blocks,
        )

    def clear_reusable_blocks(self) -> None:
        """Drop every cached block. Raises RuntimeError while a cache is open."""
        if self._open:
            raise RuntimeError(
                f"clear_reusable_blocks() with {len(self._open)} open caches; close them first"
            )
        self._tree.clear()

    # -- for engines -----------------------------------------------------------------

    def page_storage(self, pool: int):
        """The torch tensor ``[num_pages, *shape]`` of a pool, or None (bookkeeping only)."""
        return self._pools[pool].storage

    def snapshot_page(self, cache: KVCache) -> int | None:
        """Page of the recurrent snapshot ``cache`` restores from on its first resize."""
        block = cache._restore_from
        return None if block is None else block.pages[self.layout.recurrent]

    # -- for KVCache -----------------------------------------------------------------

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _forget(self, cache: KVCache) -> None:
        del self._open[id(cache)]

    def check_invariants(self) -> None:
        """Recompute every count from scratch; AssertionError on any mismatch (tests)."""
        from .checks import check_manager

        check_manager(self)


def _scope(scope: ReuseScope | None) -> ReuseScope:
    if scope is None:
        return ReuseScope()
    if not isinstance(scope, ReuseScope):
        raise TypeError(f"scope must be a ReuseScope or None, got {type(scope).__name__}")
    return scope
