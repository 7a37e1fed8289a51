import torch

from kvcache import CacheConfig, FullAttention, KVCacheManager, PageLayout, Recurrent

from .helpers import seq

TPB = 4


def manager(partial=True):
    cfg = CacheConfig(tokens_per_block=TPB, num_pages=8,
                      life_cycles=(FullAttention(), Recurrent()), enable_partial_reuse=partial)
    return KVCacheManager(cfg, layouts=[PageLayout((TPB, 2)), PageLayout((3,), "float64")])


def test_pools_own_tensors_of_the_layout():
    mgr = manager()
    assert mgr.page_storage(0).shape == (8, TPB, 2)
    assert mgr.page_storage(0).dtype == torch.float32
    assert mgr.page_storage(1).shape == (8, 3) and mgr.page_storage(1).dtype == torch.float64
    assert KVCacheManager(CacheConfig()).page_storage(0) is None


def test_partial_reuse_copies_the_source_page():
    mgr = manager()
    kv, state = mgr.page_storage(0), mgr.page_storage(1)
    first = mgr.create_kv_cache([])
    assert first.resize(8)
    for b, page in enumerate(first.block_table(0)):
        kv[page] = float(b + 1)
    first.commit(seq(0, 4))
    state[first.live_state_page(1)] = 7.0
    first.commit(seq(4, 4))             # snapshot of the live state at 8
    first.close()
    snap = [p for p in range(8) if state[p].eq(7.0).all() and p != first.live_state_page(1)]
    assert len(snap) == 1

    second = mgr.create_kv_cache(seq(0, 6) + [99, 99])  # diverges 2 tokens into block 1
    assert second.num_tokens_before_hybrid_pruning == 6
    assert second.num_reused_tokens == 4                # recurrent: snapshot at 4 only
    third = mgr.create_kv_cache(seq(0, 8))
    assert third.num_reused_tokens == 8
    assert mgr.snapshot_page(third) == snap[0]
    assert third.resize(12)
    assert state[third.live_state_page(1)].eq(7.0).all()   # restored from the snapshot
    assert second.resize(8)
    assert state[second.live_state_page(1)].eq(0.0).all()  # fresh state: zeros
    second.close()
    third.close()


def test_partial_copy_with_attention_only():
    cfg = CacheConfig(tokens_per_block=TPB, num_pages=8, life_cycles=(FullAttention(),))
    mgr = KVCacheManager(cfg, layouts=[PageLayout((TPB,))])
    kv = mgr.page_storage(0)
    first = mgr.create_kv_cache([])
    assert first.resize(8)
    src = first.block_table(0)[1]
    kv[src] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    first.commit(seq(0, 8))
    first.close()
    second = mgr.create_kv_cache(seq(0, 6) + [50, 51])
    assert second.num_reused_tokens == 6
    assert second.resize(8)
    own = second.block_table(0)[1]
    assert own != src and kv[own].tolist() == [1.0, 2.0, 3.0, 4.0]
    second.close()
    mgr.check_invariants()
