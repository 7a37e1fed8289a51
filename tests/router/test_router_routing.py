"""Routing quality on a shared-prefix workload: prefix policy against round robin."""

import asyncio
import random

import httpx

from .cluster import cluster

GROUPS, PER_GROUP, REPLICAS = 24, 8, 6
# Replica caches: 88 pages of 32 tokens hold about 5 of the 24 system prompts (16 pages
# each), so no replica can keep every group, but each can keep its share (24 / 6 = 4).
REPLICA_ARGS = ("--kv-pages", "88", "--tokens-per-block", "32")
# Six replicas, the router and 8 clients share CI's two cores: a probe can miss the default
# 25 ms deadline there, and a missed probe reads as no reuse (what late probes cost
# the hit rate is bench.probe_misses' subject, not this test's). Probes are waited for.
ROUTER_ARGS = ("--seed", "3", "--probe-deadline-ms", "2000")


def workload(seed=0):
    rng = random.Random(seed)
    systems = [f"[group {g:02d}] " + "".join(rng.choice("abcdefghij ") for _ in range(497))
               for g in range(GROUPS)]
    requests = [(g, systems[g] + f" question {q}: " + "x" * 6)
                for g in range(GROUPS) for q in range(PER_GROUP)]
    rng.shuffle(requests)
    return requests


async def drive(url, requests, concurrency=8):
    sem = asyncio.Semaphore(concurrency)
    results = []

    async def one(client, prompt):
        async with sem:
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            results.append((r.headers["x-replica"], usage["prompt_tokens"],
                            usage["prompt_tokens_details"]["cached_tokens"]))

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.gather(*(one(client, p) for _, p in requests))
    return results


def run_policy(policy):
    with cluster(REPLICAS, REPLICA_ARGS, ("--policy", policy, *ROUTER_ARGS)) as (router, reps):
        results = asyncio.run(drive(router.url, workload()))
        urls = [r.url for r in reps]
    hit = sum(c for _, _, c in results) / sum(p for _, p, _ in results)
    share = {u: sum(1 for rep, _, _ in results if rep == u) for u in urls}
    return hit, share


def test_prefix_policy_beats_round_robin_without_starving_anyone():
    prefix_hit, prefix_share = run_policy("prefix")
    rr_hit, _ = run_policy("round_robin")
    fair = GROUPS * PER_GROUP / REPLICAS
    print(f"hit rate prefix {prefix_hit:.3f} round_robin {rr_hit:.3f}; shares {prefix_share}")
    assert prefix_hit >= 2.5 * rr_hit
    assert min(prefix_share.values()) >= fair / 3
