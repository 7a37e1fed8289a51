import random

import pytest

from kvcache import (CacheConfig, FullAttention, KVCacheManager, PoolStats, Recurrent, ReuseScope,
                     SlidingWindow)

from .helpers import seq, serve

TPB = 32


def manager(*life_cycles, partial=True, pages=256):
    return KVCacheManager(CacheConfig(tokens_per_block=TPB, num_pages=pages,
                                      life_cycles=life_cycles or (FullAttention(),),
                                      enable_partial_reuse=partial))


# -- scope isolation, paired: the same scope reuses, every other scope reuses 0 ---------

SCOPES = {
    "salt a": ReuseScope(salt="a"),
    "salt b": ReuseScope(salt="b"),
    "lora 1": ReuseScope(salt="a", lora_id=1),
    "lora 2": ReuseScope(salt="a", lora_id=2),
    "no scope": ReuseScope(),
}


@pytest.mark.parametrize("owner", list(SCOPES))
def test_scopes_never_share(owner):
    mgr = manager()
    tokens = seq(0, 128)
    assert serve(mgr, tokens, SCOPES[owner]) == 0
    for name, scope in SCOPES.items():
        expected = 128 if name == owner else 0
        assert mgr.probe_reuse(tokens, scope=scope).num_tokens == expected, name
        cache = mgr.create_kv_cache(tokens, scope=scope)
        assert cache.num_reused_tokens == expected, name
        cache.close()


def test_none_scope_is_the_empty_scope():
    mgr = manager()
    serve(mgr, seq(0, 64), None)
    assert mgr.probe_reuse(seq(0, 64), scope=ReuseScope()).num_tokens == 64
    assert mgr.probe_reuse(seq(0, 64), scope=ReuseScope(salt="")).num_tokens == 0


# -- full blocks and partial reuse -------------------------------------------------------

def test_exact_hit_reports_every_token():
    mgr = manager(partial=False)
    serve(mgr, seq(0, 96))
    assert mgr.probe_reuse(seq(0, 96)).num_tokens == 96
    assert mgr.probe_reuse(seq(0, 64)).num_tokens == 64


@pytest.mark.parametrize("partial, diverge_at, expected", [
    (True, 40, 40),    # diverges 8 tokens into block 1: those 8 are reused
    (False, 40, 32),   # only full blocks
    (True, 32, 32),
    (True, 63, 63),
    (False, 63, 32),
])
def test_divergence_inside_a_block(partial, diverge_at, expected):
    mgr = manager(partial=partial)
    serve(mgr, seq(0, 96))
    lookup = seq(0, diverge_at) + seq(1000, 96 - diverge_at)
    assert mgr.probe_reuse(lookup).num_tokens == expected
    cache = mgr.create_kv_cache(lookup)
    assert cache.num_reused_tokens == expected
    cache.close()


@pytest.mark.parametrize("partial, expected", [(True, 50), (False, 32)])
def test_lookup_ending_inside_a_block(partial, expected):
    mgr = manager(partial=partial)
    serve(mgr, seq(0, 96))
    assert mgr.probe_reuse(seq(0, 50)).num_tokens == expected


@pytest.mark.parametrize("partial, expected", [(True, 45), (False, 32)])
def test_partial_tail_of_a_closed_cache_is_stored(partial, expected):
    mgr = manager(partial=partial)
    serve(mgr, seq(0, 45))  # the last commit ends 13 tokens into block 1
    assert mgr.probe_reuse(seq(0, 45) + seq(500, 40)).num_tokens == expected
    assert mgr.stats().cached_blocks == (2 if partial else 1)


def test_partial_tail_not_stored_when_a_sibling_starts_with_it():
    mgr = manager()
    serve(mgr, seq(0, 64))
    blocks = mgr.stats().cached_blocks
    serve(mgr, seq(0, 45))  # 45 tokens: block 1's first 13 tokens, already covered
    assert mgr.stats().cached_blocks == blocks == 2


def test_partial_reuse_copies_into_an_own_page():
    mgr = manager()
    serve(mgr, seq(0, 64))
    cache = mgr.create_kv_cache(seq(0, 40) + seq(900, 24))
    assert cache.num_reused_tokens == 40
    assert cache.resize(64)
    shared = mgr.create_kv_cache(seq(0, 64))
    assert shared.resize(64)
    assert cache.block_table(0)[0] == shared.block_table(0)[0]  # block 0 shared
    assert cache.block_table(0)[1] != shared.block_table(0)[1]  # block 1 copied
    cache.close()
    shared.close()
    mgr.check_invariants()


# -- recurrent (hybrid) models -----------------------------------------------------------

@pytest.mark.parametrize("partial", [True, False])
def test_recurrent_needs_a_snapshot_at_the_end(partial):
    mgr = manager(FullAttention(), Recurrent(), partial=partial)
    serve(mgr, seq(0, 64), chunks=[32, 32])  # snapshots after 32 and after 64
    base = seq(0, 64)
    lookups = {32: base[:32], 48: base[:48], 96: base + seq(5000, 32)}
    results = {n: mgr.probe_reuse(tokens) for n, tokens in lookups.items()}
    assert {n: r.num_tokens for n, r in results.items()} == {32: 32, 48: 32, 96: 64}
    assert results[48].num_tokens_before_hybrid_pruning == (48 if partial else 32)
    assert results[96].num_tokens_before_hybrid_pruning == 64
    for n, probe in results.items():
        cache = mgr.create_kv_cache(lookups[n])
        assert cache.num_reused_tokens == probe.num_tokens
        assert cache.num_tokens_before_hybrid_pruning == probe.num_tokens_before_hybrid_pruning
        cache.close()


def test_recurrent_single_commit_keeps_only_its_end():
    mgr = manager(FullAttention(), Recurrent())
    serve(mgr, seq(0, 64), chunks=[64])
    assert mgr.probe_reuse(seq(0, 48)).num_tokens == 0
    assert mgr.probe_reuse(seq(0, 48)).num_tokens_before_hybrid_pruning == 48
    assert mgr.probe_reuse(seq(0, 64)).num_tokens == 64


def test_recurrent_snapshot_not_kept_off_boundary():
    mgr = manager(FullAttention(), Recurrent())
    serve(mgr, seq(0, 70), chunks=[40, 30])  # ends at 40 and 70: neither on a boundary
    assert mgr.probe_reuse(seq(0, 70)).num_tokens == 0
    assert mgr.stats().pools[1].cached_pages == 0


def test_recurrent_only_model():
    mgr = manager(Recurrent())
    serve(mgr, seq(0, 96), chunks=[32, 64])
    assert [mgr.probe_reuse(seq(0, n)).num_tokens for n in (31, 32, 64, 95, 96)] == \
        [0, 32, 32, 32, 96]
    mgr.check_invariants()


# -- sliding window ----------------------------------------------------------------------

def test_sliding_window_releases_pages_that_left_the_window():
    mgr = manager(SlidingWindow(window=64))
    cache = mgr.create_kv_cache([])
    assert cache.resize(128)
    cache.commit(seq(0, 128))
    assert cache.block_table(0)[:2] == [None, None]
    assert mgr.stats().pools[0].used_pages == 2
    cache.close()
    assert mgr.probe_reuse(seq(0, 96)).num_tokens == 0
    assert mgr.probe_reuse(seq(0, 128)).num_tokens == 128
    assert mgr.stats().pools[0].cached_pages == 2


def test_sliding_window_with_full_attention_and_sinks():
    mgr = manager(FullAttention(), SlidingWindow(window=64, sink_tokens=32))
    serve(mgr, seq(0, 160))
    # Block 0 is a sink and keeps its window page; blocks 1-2 left the window.
    assert [mgr.probe_reuse(seq(0, n)).num_tokens for n in (32, 64, 96, 128, 160)] == \
        [32, 32, 32, 32, 160]
    assert mgr.stats().pools == (
        PoolStats("full_attention", 256, 251, 0, 5, 0),
        PoolStats("sliding_window(64, sink=32)", 256, 253, 0, 3, 0),
    )


def test_sliding_window_pages_kept_while_another_cache_reads_them():
    mgr = manager(FullAttention(), SlidingWindow(window=64))
    first = mgr.create_kv_cache([])
    assert first.resize(96)
    first.commit(seq(0, 96))        # blocks 0-2; block 0 left the window
    second = mgr.create_kv_cache(seq(0, 96))
    assert second.num_reused_tokens == 96
    window_pages = first.block_table(1)
    assert window_pages[0] is None and second.block_table(1) == window_pages
    assert first.resize(192)
    first.commit(seq(96, 96))       # first's window moves on, second still reads 1-2
    assert first.block_table(1)[:4] == [None] * 4  # (193 - 64) // 32 = 4 blocks left
    assert second.block_table(1) == window_pages
    assert mgr.stats().pools[1].used_pages == 2 + 2   # second: blocks 1-2; first: 4-5
    second.close()  # blocks 1-2 keep their window pages: attached, and first holds the blocks
    assert mgr.stats().pools[1].used_pages == 4
    first.close()
    assert mgr.stats().pools[1].cached_pages == 4
    assert mgr.probe_reuse(seq(0, 96)).num_tokens == 96
    assert mgr.probe_reuse(seq(0, 128)).num_tokens == 96  # block 3's window page is gone
    mgr.check_invariants()


# -- probe == create, over random histories ----------------------------------------------

@pytest.mark.parametrize("life_cycles", [
    (FullAttention(),),
    (FullAttention(), SlidingWindow(window=48)),
    (SlidingWindow(window=80, sink_tokens=8),),
    (FullAttention(), Recurrent()),
    (FullAttention(), SlidingWindow(window=40), Recurrent()),
])
@pytest.mark.parametrize("partial", [True, False])
def test_probe_predicts_create_over_random_histories(life_cycles, partial):
    rng = random.Random(hash((life_cycles, partial)) & 0xFFFF)
    mgr = KVCacheManager(CacheConfig(tokens_per_block=8, num_pages=40,
                                     life_cycles=life_cycles, enable_partial_reuse=partial))
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
    open_caches = []
    reused_total = 0
    for _ in range(400):
        tokens = rng.choice(prefixes)[: rng.randrange(1, 60)] + \
            [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
        scope = ReuseScope(salt=rng.choice("ab"))
        probe = mgr.probe_reuse(tokens, scope=scope)
        assert probe.num_tokens <= probe.num_tokens_before_hybrid_pruning <= len(tokens)
        cache = mgr.create_kv_cache(tokens, scope=scope)
        assert (cache.num_reused_tokens, cache.num_tokens_before_hybrid_pruning) == \
            (probe.num_tokens, probe.num_tokens_before_hybrid_pruning)
        reused_total += probe.num_tokens
        if cache.resize(len(tokens) + 4):
            pos = cache.num_reused_tokens
            while pos < len(tokens):
                step = rng.choice([1, 8, 16, 64])
                cache.commit(tokens[pos:pos + step])
                pos += step
        open_caches.append(cache)
        while len(open_caches) > rng.randrange(1, 4):
            open_caches.pop(rng.randrange(len(open_caches))).close()
        mgr.check_invariants()
    for cache in open_caches:
        cache.close()
    mgr.check_invariants()
    stats = mgr.stats()
    assert stats.used_pages == 0 and stats.reuse_queries == 400
    assert stats.hit_tokens == reused_total > 0


def test_a_lookup_shorter_than_a_block_never_matches_as_a_full_block():
    mgr = manager()
    serve(mgr, seq(0, 20))                  # stores a 20-token partial block
    assert mgr.probe_reuse(seq(0, 20)).num_tokens == 20   # through partial matching
    assert mgr.probe_reuse(seq(0, 20) + [999] * 40).num_tokens == 20
    off = manager(partial=False)
    serve(off, seq(0, 20))
    assert off.probe_reuse(seq(0, 20)).num_tokens == 0
