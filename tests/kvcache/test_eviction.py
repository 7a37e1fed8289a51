import pytest

from kvcache import CacheConfig, FullAttention, KVCacheManager, Recurrent, SlidingWindow

from .helpers import seq, serve

TPB = 4


def manager(pages, *life_cycles):
    return KVCacheManager(CacheConfig(tokens_per_block=TPB, num_pages=pages,
                                      life_cycles=life_cycles or (FullAttention(),)))


def cached(mgr, sequences):
    """Tokens of each sequence reusable now."""
    return [mgr.probe_reuse(s).num_tokens for s in sequences]


def test_oldest_release_is_evicted_first_tail_before_head():
    mgr = manager(6)
    a, b, c = seq(0, 8), seq(100, 8), seq(200, 4)
    serve(mgr, a)
    serve(mgr, b)                      # 4 pages cached, 2 free
    serve(mgr, seq(300, 12))           # needs 3 pages: evicts a's tail block only
    assert cached(mgr, [a, b]) == [4, 8]
    assert mgr.stats().evicted_blocks == 1
    serve(mgr, c)                      # needs 1 page: a's head goes next
    assert cached(mgr, [a, b, c]) == [0, 8, 4]
    assert mgr.stats().evicted_blocks == 2
    mgr.check_invariants()


@pytest.mark.parametrize("touch, survivor", [("probe", "b"), ("reuse", "a")])
def test_probe_does_not_change_eviction_order_but_reuse_does(touch, survivor):
    mgr = manager(4)
    a, b = seq(0, 8), seq(100, 8)
    serve(mgr, a)
    serve(mgr, b)
    before = mgr.stats()
    if touch == "probe":
        assert mgr.probe_reuse(a).num_tokens == 8
        assert mgr.stats() == before  # no page, no statistic changed
    else:
        assert serve(mgr, a) == 8
    serve(mgr, seq(500, 8))            # needs 2 pages: evicts all of the older sequence
    assert cached(mgr, [a, b]) == ([8, 0] if survivor == "a" else [0, 8])


def test_open_caches_are_never_evicted():
    mgr = manager(4)
    holder = mgr.create_kv_cache([])
    assert holder.resize(8)
    holder.commit(seq(0, 8))
    serve(mgr, seq(100, 8))
    other = mgr.create_kv_cache(seq(900, 9))
    assert not other.resize(9)         # 3 pages: 2 evictable + 0 free is not enough
    assert cached(mgr, [seq(0, 8), seq(100, 8)]) == [8, 8]
    assert other.resize(8)             # 2 pages: evicts the closed sequence only
    assert cached(mgr, [seq(0, 8), seq(100, 8)]) == [8, 0]
    holder.close()
    other.close()
    mgr.check_invariants()


def test_failed_resize_changes_nothing():
    mgr = manager(8, FullAttention(), SlidingWindow(window=8), Recurrent())
    serve(mgr, seq(0, 16), chunks=[8, 8])
    cache = mgr.create_kv_cache(seq(0, 16))
    assert cache.num_reused_tokens == 16
    before = (mgr.stats(), cache.block_table(0), cache.block_table(1), cache.capacity)
    assert not cache.resize(16 + 4 * 8)
    assert (mgr.stats(), cache.block_table(0), cache.block_table(1), cache.capacity) == before
    assert cache.live_state_page(2) is None
    assert cache.resize(20)
    assert cache.capacity == 20 and cache.live_state_page(2) is not None
    cache.close()
    mgr.check_invariants()


def test_shrinking_gives_back_uncommitted_pages():
    mgr = manager(8)
    cache = mgr.create_kv_cache([])
    assert cache.resize(30)            # 8 blocks
    cache.commit(seq(0, 5))
    assert cache.resize(6)             # back to 2 blocks
    assert mgr.stats().free_pages == 6
    with pytest.raises(ValueError, match="already committed"):
        cache.resize(4)
    with pytest.raises(ValueError, match="call resize"):
        cache.commit(seq(5, 2))
    cache.close()
    assert mgr.stats().used_pages == 0


def test_close_is_idempotent_and_closed_caches_refuse_work():
    mgr = manager(8)
    cache = mgr.create_kv_cache(seq(0, 4))
    cache.close()
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.resize(8)
    with pytest.raises(RuntimeError, match="closed"):
        cache.commit([1])
    assert mgr.stats().open_caches == 0


def test_clear_reusable_blocks_refuses_while_a_cache_is_open():
    mgr = manager(8)
    serve(mgr, seq(0, 8))
    cache = mgr.create_kv_cache(seq(0, 8))
    with pytest.raises(RuntimeError, match="1 open caches"):
        mgr.clear_reusable_blocks()
    cache.close()
    mgr.clear_reusable_blocks()
    stats = mgr.stats()
    assert (stats.free_pages, stats.cached_blocks, stats.evicted_blocks) == (8, 0, 2)
    assert mgr.probe_reuse(seq(0, 8)).num_tokens == 0


def test_statistics_count_creates_not_probes():
    mgr = manager(16, FullAttention(), Recurrent())
    serve(mgr, seq(0, 8), chunks=[4, 4])      # snapshots at 4 and 8
    mgr.probe_reuse(seq(0, 8))
    serve(mgr, seq(0, 6))                     # attention 6, recurrent 4
    s = mgr.stats()
    assert (s.reuse_queries, s.query_tokens, s.hit_tokens,
            s.hit_tokens_before_hybrid_pruning) == (2, 14, 4, 6)


def test_snapshot_evicts_cached_blocks_when_its_pool_is_full():
    mgr = manager(3, FullAttention(), Recurrent())
    serve(mgr, seq(0, 4), chunks=[4])          # snapshot at 4
    serve(mgr, seq(100, 4), chunks=[4])        # snapshot at 4
    # Recurrent pool: 2 snapshots + 1 free. A new sequence takes the free page as its live
    # state; its snapshot evicts the oldest block (and that block's snapshot).
    serve(mgr, seq(200, 4), chunks=[4])
    assert cached(mgr, [seq(0, 4), seq(100, 4), seq(200, 4)]) == [0, 4, 4]
    mgr.check_invariants()
