"""``GET /metrics`` of a replica: the per-pool KV page gauges and eviction counters.

The replica runs in-process (its app over a ReplicaService), so the test sets its
manager's state itself and reads the scrape against it.
"""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvcache import (CacheConfig, FullAttention, KVCacheManager, ManagerStats, PoolStats,
                     Recurrent, SlidingWindow)
from replicas.app import create_app
from replicas.engines import SimEngine
from replicas.service import ReplicaService
from replicas.settings import ReplicaSettings

HYBRID = (FullAttention(), SlidingWindow(window=32), Recurrent())
LIFE_CYCLES = ["full_attention", "sliding_window(32)", "recurrent"]


class HybridSim(SimEngine):
    """The sim engine with a hybrid model's three pools."""

    def cache_config(self, num_pages: int, tokens_per_block: int,
                     enable_partial_reuse: bool) -> CacheConfig:
        return CacheConfig(tokens_per_block=tokens_per_block, num_pages=num_pages,
                           life_cycles=HYBRID, enable_partial_reuse=enable_partial_reuse)


def scrape(client: TestClient) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value."""
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def pool_samples(samples: dict[tuple, float]) -> dict[tuple, float]:
    """{(pool, life_cycle, what): value} of the per-pool families; what is a page state or
    "evicted"."""
    out = {}
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if name == "replica_kv_cache_pool_pages":
            out[(lab["pool"], lab["life_cycle"], lab["state"])] = value
        elif name == "replica_kv_cache_pool_evicted_pages_total":
            out[(lab["pool"], lab["life_cycle"], "evicted")] = value
    return out


def expected(pools) -> dict[tuple, float]:
    out = {}
    for i, p in enumerate(pools):
        for what, n in (("free", p.free_pages), ("used", p.used_pages),
                        ("cached", p.cached_pages), ("evicted", p.evicted_pages)):
            out[(str(i), p.life_cycle, what)] = n
    return out


@pytest.fixture
def hybrid():
    settings = ReplicaSettings(kv_pages=8, tokens_per_block=16, served_model_name="hybrid-test")
    service = ReplicaService(settings, engine=HybridSim())
    return service, TestClient(create_app(settings, service))  # no lifespan: no scheduler


def serve(mgr: KVCacheManager, tokens: list[int]) -> None:
    """Cache ``tokens`` the way a finished request does: resize, commit, close."""
    cache = mgr.create_kv_cache(tokens)
    assert cache.resize(len(tokens))
    cache.commit(tokens[cache.num_reused_tokens:])
    cache.close()


def test_per_pool_metrics_follow_the_manager(hybrid):
    service, client = hybrid
    mgr = service.manager
    fresh = pool_samples(scrape(client))
    assert fresh == {(str(i), lc, what): (8 if what == "free" else 0)
                     for i, lc in enumerate(LIFE_CYCLES)
                     for what in ("free", "used", "cached", "evicted")}

    serve(mgr, list(range(64)))           # 4 blocks: 4 of the 8 full-attention pages
    serve(mgr, [1000 + i for i in range(96)])  # 6 blocks: 2 full-attention pages evicted
    samples = scrape(client)
    pools = mgr.stats().pools
    assert [p.life_cycle for p in pools] == LIFE_CYCLES
    got = pool_samples(samples)
    assert got == expected(pools)
    # Full attention, by the contract: the second sequence's 6 pages are cached, and the 2
    # evicted pages made room for them next to the 4 free ones; no page is held.
    assert [got[("0", "full_attention", w)] for w in ("free", "used", "cached", "evicted")] \
        == [0, 0, 8, 2]
    for i, lc in enumerate(LIFE_CYCLES):
        assert sum(got[(str(i), lc, s)] for s in ("free", "used", "cached")) == 8
        assert got[(str(i), lc, "used")] == 0

    # /stats reports the same pools, and the totals metrics stay the sums over pools.
    assert client.get("/stats").json()["kv_cache"]["pools"] == [
        {**dataclasses.asdict(p), "layers": None, "page_bytes": None} for p in pools]
    on_blocks = {dict(labels)["pool"]: value for (name, labels), value in samples.items()
                 if name == "replica_kv_cache_pool_block_pages"}
    assert on_blocks == {str(i): p.block_pages for i, p in enumerate(pools)}
    label = (("model_name", "hybrid-test"),)
    for state in ("free", "used", "cached"):
        total = samples[("replica_kv_cache_pages", label + (("state", state),))]
        assert total == sum(got[(str(i), lc, state)] for i, lc in enumerate(LIFE_CYCLES))


def test_per_pool_metrics_carry_every_field_of_the_pool_stats():
    """Exact values from a fixed ManagerStats (distinct numbers: a swapped field shows)."""
    pools = (PoolStats("full_attention", 100, 11, 22, 67, 5),
             PoolStats("sliding_window(64, sink=32)", 50, 13, 7, 30, 9))

    class Manager:
        config = CacheConfig(tokens_per_block=16, num_pages=100)

        @staticmethod
        def stats() -> ManagerStats:
            return ManagerStats(num_pages=150, free_pages=24, used_pages=29, cached_pages=97,
                                pools=pools, open_caches=1, cached_blocks=40,
                                reuse_queries=3, query_tokens=300, hit_tokens=120,
                                hit_tokens_before_hybrid_pruning=150, evicted_blocks=4)

    service = ReplicaService(ReplicaSettings(served_model_name="fixed"))
    service.scheduler.manager = Manager()
    got = pool_samples(scrape(TestClient(create_app(service.settings, service))))
    assert got == {
        ("0", "full_attention", "free"): 11, ("0", "full_attention", "used"): 22,
        ("0", "full_attention", "cached"): 67, ("0", "full_attention", "evicted"): 5,
        ("1", "sliding_window(64, sink=32)", "free"): 13,
        ("1", "sliding_window(64, sink=32)", "used"): 7,
        ("1", "sliding_window(64, sink=32)", "cached"): 30,
        ("1", "sliding_window(64, sink=32)", "evicted"): 9,
    }


def test_a_models_pools_name_their_layers_and_page_sizes():
    """tiny-hybrid (full, sliding(24), recurrent: one layer each) at 16 tokens a block: full
    and sliding pages of 1 layer x K/V x 16 tokens x 2 heads x 16 floats, a recurrent page
    of 64 floats. A 40-token request keeps 2 snapshots (its prefill at 32 and its end)."""
    settings = ReplicaSettings(engine="torch", preset="tiny-hybrid", kv_pages=8,
                               tokens_per_block=16, served_model_name="tiny")
    service = ReplicaService(settings)
    client = TestClient(create_app(settings, service))
    cache = service.manager.create_kv_cache(list(range(40)))
    assert cache.resize(41)
    cache.commit(list(range(32)))
    cache.commit(list(range(32, 40)))
    cache.close()
    stats = client.get("/stats").json()
    pools = stats["kv_cache"]["pools"]
    # the cache was created with nothing to reuse: nothing lost to pruning yet
    assert stats["reuse"]["tokens_lost_to_hybrid_pruning"] == 0
    again = service.manager.create_kv_cache(list(range(36)))  # snapshot at 32, not 36
    assert (again.num_reused_tokens, again.num_tokens_before_hybrid_pruning) == (32, 36)
    again.close()
    assert client.get("/stats").json()["reuse"]["tokens_lost_to_hybrid_pruning"] == 4
    assert [(p["life_cycle"], p["layers"], p["page_bytes"], p["block_pages"]) for p in pools] == [
        ("full_attention", 1, 2 * 16 * 2 * 16 * 4, 3),
        ("sliding_window(24)", 1, 2 * 16 * 2 * 16 * 4, 3),
        ("recurrent", 1, 64 * 4, 2)]
    layers = {dict(labels)["life_cycle"]: value for (name, labels), value in scrape(client).items()
              if name == "replica_kv_cache_pool_layers"}
    assert layers == {"full_attention": 1, "sliding_window(24)": 1, "recurrent": 1}
