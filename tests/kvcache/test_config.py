import pytest

from kvcache import (CacheConfig, FullAttention, KVCacheManager, Recurrent, ReuseScope,
                     SlidingWindow)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokens_per_block=0), "tokens_per_block must be an int >= 1"),
        (dict(num_pages=0), "num_pages must be an int >= 1"),
        (dict(life_cycles=()), "at least one life cycle"),
        (dict(life_cycles=(FullAttention(), FullAttention())), "the same life cycle twice"),
        (dict(life_cycles=(Recurrent(), FullAttention(), Recurrent())), "the same life cycle"),
        (dict(life_cycles=("full",)), "life_cycles entries must be"),
    ],
)
def test_bad_config_says_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(**kwargs)


@pytest.mark.parametrize("window, sink", [(0, 0), (8, -1)])
def test_bad_sliding_window(window, sink):
    with pytest.raises(ValueError, match="SlidingWindow"):
        SlidingWindow(window=window, sink_tokens=sink)


def test_sink_blocks_round_up():
    cfg = CacheConfig(tokens_per_block=32)
    assert [cfg.sink_blocks(SlidingWindow(64, s)) for s in (0, 1, 32, 33)] == [0, 1, 1, 2]


@pytest.mark.parametrize("tokens, message", [
    ([1, -1], r"in \[0, 2\*\*32\), got -1"),
    ([2**32], r"got 4294967296"),
    ([1, "a"], "must be ints"),
    ([1.5], "must be ints"),
])
def test_bad_tokens_raise_value_error(tokens, message):
    mgr = KVCacheManager(CacheConfig())
    with pytest.raises(ValueError, match=message):
        mgr.probe_reuse(tokens)
    with pytest.raises(ValueError, match=message):
        mgr.create_kv_cache(tokens)
    assert mgr.stats().open_caches == 0


def test_layouts_must_match_life_cycles():
    with pytest.raises(ValueError, match="one \\(or None\\) per life cycle"):
        KVCacheManager(CacheConfig(), layouts=[None, None])


def test_scope_must_be_a_reuse_scope():
    with pytest.raises(TypeError, match="ReuseScope"):
        KVCacheManager(CacheConfig()).probe_reuse([1, 2], scope="tenant-a")
    assert ReuseScope() == ReuseScope(None, None)


@pytest.mark.parametrize("num_pages, message", [
    ((4, 4), "one int >= 1 per life cycle"),
    ((4, 0, 4), "one int >= 1 per life cycle"),
    ((4, True, 4), "one int >= 1 per life cycle"),
    (True, "num_pages must be an int >= 1"),
])
def test_a_page_count_per_life_cycle_is_checked(num_pages, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(num_pages=num_pages,
                    life_cycles=(FullAttention(), SlidingWindow(16), Recurrent()))


def test_each_pool_gets_its_own_page_count():
    life = (FullAttention(), SlidingWindow(16), Recurrent())
    assert CacheConfig(num_pages=7, life_cycles=life).pool_pages == (7, 7, 7)
    cfg = CacheConfig(tokens_per_block=4, num_pages=[12, 5, 3], life_cycles=life)
    assert cfg.num_pages == (12, 5, 3) and cfg.pool_pages == (12, 5, 3)
    mgr = KVCacheManager(cfg)
    stats = mgr.stats()
    assert [p.num_pages for p in stats.pools] == [12, 5, 3]
    assert (stats.num_pages, stats.free_pages) == (20, 20)
    # 3 blocks: 3 full pages, the window's 16 + 1 tokens span 3 blocks too, 1 live state
    cache = mgr.create_kv_cache(list(range(12)))
    assert cache.resize(12)
    assert [p.free_pages for p in mgr.stats().pools] == [9, 2, 2]
    # a second cache of 12 tokens fits the full pool but not the 5-page window pool
    other = mgr.create_kv_cache(list(range(100, 112)))
    assert not other.resize(12)
    assert [p.free_pages for p in mgr.stats().pools] == [9, 2, 2]
    cache.close()
    other.close()
    mgr.check_invariants()


def test_pool_stats_count_the_pages_on_blocks_snapshots_included():
    """block_pages: pages attached to cached blocks, held or not. A 12-token commit at a
    block boundary keeps a snapshot; closing after 2 more tokens keeps the state at 14 on the
    partial block: 2 snapshots, 4 full-attention pages (3 blocks + the partial one)."""
    mgr = KVCacheManager(CacheConfig(tokens_per_block=4, num_pages=(8, 4),
                                     life_cycles=(FullAttention(), Recurrent())))
    cache = mgr.create_kv_cache([])
    assert cache.resize(14)
    cache.commit(list(range(12)))
    assert [p.block_pages for p in mgr.stats().pools] == [3, 1]
    cache.commit([12, 13])
    cache.close()
    stats = mgr.stats()
    assert [p.block_pages for p in stats.pools] == [4, 2]
    assert [p.cached_pages for p in stats.pools] == [4, 2]
    mgr.clear_reusable_blocks()
    assert [p.block_pages for p in mgr.stats().pools] == [0, 0]
    mgr.check_invariants()
