"""The router's own counters and histograms expose what prometheus_client's would."""

import random

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router import metrics

BUCKETS = (0.001, 0.005, 0.01, 0.1, 1.0)


def exposition(registry) -> list[str]:
    return sorted(line for line in generate_latest(registry).decode().splitlines()
                  if "_created" not in line)


def test_same_exposition_as_prometheus_client():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    made = []
    for module, registry in ((metrics, ours), (prometheus_client, theirs)):
        made.append((
            module.Counter("t_requests", "Requests.", ["replica", "outcome"], registry=registry),
            module.Counter("t_retries", "Retries.", registry=registry),
            module.Histogram("t_latency_seconds", "Latency.", ["replica"], buckets=BUCKETS,
                             registry=registry),
            module.Histogram("t_overhead_seconds", "Overhead.", buckets=BUCKETS,
                             registry=registry),
        ))
    rng = random.Random(0)
    values = [rng.choice([0.001, 0.005, 1.0, 5.0, 0.0]) if i % 4 == 0 else rng.expovariate(50)
              for i in range(500)]  # bucket edges exactly, beyond the last, zero
    for i, value in enumerate(values):
        replica = f"http://r{i % 3}"
        for counter, retries, latency, overhead in made:
            counter.labels(replica, "ok" if i % 5 else "broken").inc()
            counter.labels(replica, "tokens").inc(i)
            latency.labels(replica).observe(value)
            overhead.observe(value / 2)
            if i % 7 == 0:
                retries.inc()
    assert exposition(ours) == exposition(theirs)
    assert any('le="0.005"' in line for line in exposition(ours))


def test_misuse_is_refused():
    counter = metrics.Counter("t_c", "C.", ["replica"])
    with pytest.raises(ValueError, match="counters only go up"):
        counter.labels("a").inc(-1)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("a", "b")
    with pytest.raises(ValueError, match="use labels"):
        counter.inc()
