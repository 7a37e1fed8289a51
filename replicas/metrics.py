"""Prometheus metrics of a replica, named after vLLM's (``vllm:x`` -> ``replica_x``).

Counters that the KV-cache manager already keeps (prefix cache queries and hits, pages,
evictions) are read from it at scrape time by a collector, so they cannot drift.
``replica_kv_cache_pages`` and ``replica_kv_evicted_blocks`` are totals over the manager's
pools; ``replica_kv_cache_pool_*`` give the same per pool (one per life cycle: a hybrid
model has a full-attention, a sliding-window and a recurrent pool), labelled ``pool`` (its
index) and ``life_cycle`` (``full_attention``, ``sliding_window(W)``, ``recurrent``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .scheduler import Scheduler, SchedulerObserver
from .sequence import Sequence

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0)


class ReplicaMetrics(SchedulerObserver):
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("replica_time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(model)
        self.itl = Histogram("replica_inter_token_latency_seconds", "Time between tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model)
        self.e2e = Histogram("replica_e2e_request_latency_seconds", "Arrival to finish.",
                             labels, buckets=_E2E_BUCKETS, registry=r).labels(model)
        self.prompt_tokens = Counter("replica_prompt_tokens", "Prompt tokens of finished "
                                     "requests.", labels, registry=r).labels(model)
        self.generation_tokens = Counter("replica_generation_tokens", "Generated tokens.",
                                         labels, registry=r).labels(model)
        self.success = Counter("replica_request_success", "Finished requests by reason.",
                               labels + ["finished_reason"], registry=r)
        self.rejected = Counter("replica_request_rejected", "Requests refused before "
                                "admission, by reason.", labels + ["reason"], registry=r)

    def bind(self, scheduler: Scheduler) -> None:
        self.registry.register(_StateCollector(self.model, scheduler))

    def first_token(self, seq: Sequence, now: float) -> None:
        self.ttft.observe(now - seq.arrival)

    def next_token(self, seq: Sequence, now: float) -> None:
        self.itl.observe(now - seq.last_token_at)

    def finished(self, seq: Sequence, now: float) -> None:
        self.e2e.observe(now - seq.arrival)
        self.prompt_tokens.inc(len(seq.prompt))
        self.generation_tokens.inc(len(seq.output))
        self.success.labels(self.model, seq.finish_reason or "abort").inc()


class _StateCollector:
    """Gauges and manager counters read at scrape time."""

    def __init__(self, model: str, scheduler: Scheduler) -> None:
        self.model = model
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler.manager.stats()
        m = [self.model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("replica_num_requests_running", "Requests in the running batch.",
                    len(self.scheduler.running))
        yield gauge("replica_num_requests_waiting", "Requests waiting for admission.",
                    len(self.scheduler.waiting))
        yield gauge("replica_kv_cache_usage_perc", "Share of KV pages held by open requests "
                    "(0-1).", s.used_pages / s.num_pages)
        pages = GaugeMetricFamily("replica_kv_cache_pages", "KV pages by state.",
                                  labels=["model_name", "state"])
        for state, value in (("free", s.free_pages), ("used", s.used_pages),
                             ("cached", s.cached_pages)):
            pages.add_metric([self.model, state], value)
        yield pages
        yield from _pool_families(self.model, s.pools,
                                  getattr(self.scheduler.engine, "pool_layers", None))
        yield counter("replica_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache.", s.query_tokens)
        yield counter("replica_prefix_cache_hits", "Prompt tokens reused from the prefix "
                      "cache.", s.hit_tokens)
        yield counter("replica_prefix_cache_hits_before_hybrid_pruning", "Reusable tokens by "
                      "the attention layers alone.", s.hit_tokens_before_hybrid_pruning)
        yield counter("replica_kv_evicted_blocks", "Cached blocks evicted.", s.evicted_blocks)
        yield counter("replica_num_preemptions", "Sequences preempted for KV pages.",
                      self.scheduler.preemptions)


def _pool_families(model: str, pools, pool_layers=None):
    """Per-pool pages by state, pages on blocks (gauges) and evicted pages (counter), one
    series per pool; with ``pool_layers`` (the engine's), the model layers of each pool."""
    labels = ["model_name", "pool", "life_cycle"]
    pages = GaugeMetricFamily("replica_kv_cache_pool_pages", "KV pages of one pool (one "
                              "life cycle) by state.", labels=labels + ["state"])
    evicted = CounterMetricFamily("replica_kv_cache_pool_evicted_pages", "Cached pages of "
                                  "one pool freed to make room (recurrent: snapshots "
                                  "evicted).", labels=labels)
    on_blocks = GaugeMetricFamily("replica_kv_cache_pool_block_pages", "Pages of one pool "
                                  "attached to cached blocks, in use or not (recurrent: "
                                  "snapshots kept).", labels=labels)
    for i, p in enumerate(pools):
        values = [model, str(i), p.life_cycle]
        for state, n in (("free", p.free_pages), ("used", p.used_pages),
                         ("cached", p.cached_pages)):
            pages.add_metric(values + [state], n)
        evicted.add_metric(values, p.evicted_pages)
        on_blocks.add_metric(values, p.block_pages)
    families = [pages, evicted, on_blocks]
    if pool_layers:
        layers = GaugeMetricFamily("replica_kv_cache_pool_layers", "Model layers whose cache "
                                   "lives in the pool.", labels=labels)
        for i, p in enumerate(pools):
            layers.add_metric([model, str(i), p.life_cycle], len(pool_layers[i]))
        families.append(layers)
    return families
