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


@pytest.mark.parametrize("partial", [True, False])
def test_recurrent_keeps_a_snapshot_where_the_history_ends(partial):
    """Commits end at 40 and 70, neither on a boundary: with partial reuse the closed cache
    leaves a snapshot at 70 (on its partial last block); without it, none (as before)."""
    mgr = manager(FullAttention(), Recurrent(), partial=partial)
    serve(mgr, seq(0, 70), chunks=[40, 30])
    probes = [mgr.probe_reuse(seq(0, n)).num_tokens for n in (32, 40, 64, 69, 70)]
    assert probes == ([0, 0, 0, 0, 70] if partial else [0, 0, 0, 0, 0])
    assert mgr.probe_reuse(seq(0, 70) + [7] * 10).num_tokens == (70 if partial else 0)
    assert mgr.stats().pools[1].cached_pages == (1 if partial else 0)
    mgr.check_invariants()


def _turn(mgr, prompt, decoded):
    """One chat turn as a replica serves it: a cache for prompt[:-1], the prompt's uncached
    tokens in one commit, then one commit per decoded token but the last (never fed back),
    close. Returns the reused tokens."""
    cache = mgr.create_kv_cache(prompt[:-1])
    reused = cache.num_reused_tokens
    assert cache.resize(len(prompt) + len(decoded))
    cache.commit(prompt[reused:])
    for token in decoded[:-1]:
        cache.commit([token])
    cache.close()
    return reused


@pytest.mark.parametrize("partial, expected", [
    (True, [0, 45, 87, 129, 171]),  # exactly where each turn ended
    # Without partial reuse only commits that end on a boundary leave snapshots: decoding
    # ends on 32, 128 and 160; the second turn's prompt commit runs 32..72, past 64.
    (False, [0, 32, 32, 128, 160]),
])
def test_multi_turn_hybrid_chat_resumes_where_each_turn_ended(partial, expected):
    mgr = manager(FullAttention(), SlidingWindow(window=64), Recurrent(), partial=partial)
    history, reused = seq(0, 30), []
    for turn in range(5):
        answer = seq(1000 + 100 * turn, 16)
        reused.append(_turn(mgr, history, answer))
        history = history + answer + seq(5000 + 100 * turn, 26)
        mgr.check_invariants()
    assert reused == expected
    # Turn ends: 30+15 = 45, then each turn adds 16 + 26 tokens: 87, 129, 171.


def test_recurrent_only_model():
    mgr = manager(Recurrent())
    serve(mgr, seq(0, 96), chunks=[32, 64])
    assert [mgr.probe_reuse(seq(0, n)).num_tokens for n in (31, 32, 64, 95, 96)] == \
        [0, 32, 32, 32, 96]
    mgr.check_invariants()


# -- sliding window ----------------------------------------------------------------------

@pytest.mark.parametrize("life_cycles", [(SlidingWindow(window=64),),
                                         (FullAttention(), SlidingWindow(window=64))])
def test_sliding_window_pages_that_left_the_window_stay_cached(life_cycles):
    mgr = manager(*life_cycles)
    w = len(life_cycles) - 1  # the window pool
    cache = mgr.create_kv_cache([])
    assert cache.resize(128)
    cache.commit(seq(0, 128))
    assert cache.block_table(w)[:2] == [None, None]  # (129 - 64) // 32 = 2 blocks left
    window = mgr.stats().pools[w]
    assert (window.used_pages, window.cached_pages) == (2, 2)
    cache.close()
    assert [mgr.probe_reuse(seq(0, n)).num_tokens for n in (32, 64, 96, 128)] == \
        [32, 64, 96, 128]
    assert mgr.stats().pools[w].cached_pages == 4
    mgr.check_invariants()


def test_a_shared_prompt_longer_than_the_window_is_reused():
    """256 shared tokens then 64 of each request's own, window 64: the next request reuses
    the 256 and holds only the two window pages its end point needs."""
    mgr = manager(FullAttention(), SlidingWindow(window=64))
    system = seq(0, 256)
    assert serve(mgr, system + seq(1000, 64)) == 0
    second = system + seq(2000, 64)
    assert mgr.probe_reuse(second).num_tokens == 256
    cache = mgr.create_kv_cache(second)
    assert cache.num_reused_tokens == 256
    table = cache.block_table(1)
    assert table[:6] == [None] * 6 and None not in table[6:] and len(table) == 8
    assert mgr.stats().pools[1].used_pages == 2  # (257 - 64) // 32 = 6: blocks 6 and 7
    assert mgr.stats().pools[0].used_pages == 8
    cache.close()
    mgr.check_invariants()


def test_sliding_window_with_full_attention_and_sinks():
    mgr = manager(FullAttention(), SlidingWindow(window=64, sink_tokens=32))
    serve(mgr, seq(0, 160))
    assert [mgr.probe_reuse(seq(0, n)).num_tokens for n in (32, 64, 96, 128, 160)] == \
        [32, 64, 96, 128, 160]
    assert mgr.stats().pools == (
        PoolStats("full_attention", 256, 251, 0, 5, 0, block_pages=5),
        PoolStats("sliding_window(64, sink=32)", 256, 251, 0, 5, 0, block_pages=5),
    )


def test_a_window_page_evicted_mid_sequence_cuts_exactly_the_end_points_that_needed_it():
    """Window 64, tpb 32, 5 pages, window pool only. One commit of 160 tokens releases the
    window pages of blocks 2, 1, 0 (deepest first), the close those of blocks 4, 3; so the
    next page anybody needs is block 2's, from the middle of the sequence."""
    mgr = manager(SlidingWindow(window=64), pages=5)
    serve(mgr, seq(0, 160))
    other = mgr.create_kv_cache(seq(9000, 4))
    assert other.resize(4)
    s = mgr.stats()
    assert (s.pools[0].evicted_pages, s.evicted_blocks, s.cached_blocks) == (1, 0, 5)
    # e needs blocks (e + 1 - 64) // 32 .. (e - 1) // 32; block 2 is in that range for
    # 65 <= e <= 158: those cut to 64; the rest are whole.
    lengths = (32, 64, 65, 96, 128, 158, 159, 160)
    assert [mgr.probe_reuse(seq(0, n)).num_tokens for n in lengths] == \
        [32, 64, 64, 64, 64, 64, 159, 160]
    other.close()
    mgr.check_invariants()


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
    pool = mgr.stats().pools[1]
    assert (pool.used_pages, pool.cached_pages) == (2 + 2, 2)  # second: 1-2; first: 4-5
    second.close()  # nobody reads blocks 1-2's window pages now: cached
    pool = mgr.stats().pools[1]
    assert (pool.used_pages, pool.cached_pages) == (2, 4)
    first.close()
    assert mgr.stats().pools[1].cached_pages == 6
    assert [mgr.probe_reuse(seq(0, n)).num_tokens for n in (96, 128, 192)] == [96, 128, 192]
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
