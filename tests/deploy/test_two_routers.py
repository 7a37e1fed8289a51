"""Several router pods in front of one replica pool (deploy/k8s) route as well as one: each
router probes the replicas, so what one router's requests left in the caches steers the
other's. That holds only when the pods share the tenant secret (the same salts), which the
manifests ensure; the control run with different secrets shows the test would notice."""

from __future__ import annotations

import concurrent.futures
import contextlib

import httpx

from loadtest.workloads import shared_prefix
from tests.procs import Proc

REPLICAS = 4
REPLICA_ARGS = ("--engine", "sim", "--sim-speedup", "20", "--kv-pages", "512",
                "--tokens-per-block", "32", "--log-level", "warning")
ROUTER_ARGS = ("--policy", "prefix", "--seed", "0", "--log-level", "warning")
# 8 groups x 8 prompts sharing 512-token system prompts (seeded, shuffled).
WORKLOAD = shared_prefix(groups=8, prompts_per_group=8, system_len=512, question_len=32,
                         output_len=4, seed=0)
API_KEY = "tenant-a-key"


def start_all(make, n):
    """Start ``n`` servers at once; if one fails, stop those that started."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(make, i) for i in range(n)]
        concurrent.futures.wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        stop_all(started)
        raise errors[0]
    return started


def stop_all(procs) -> None:
    with concurrent.futures.ThreadPoolExecutor(max(1, len(procs))) as pool:
        list(pool.map(lambda p: p.stop(), procs))


@contextlib.contextmanager
def pool(tenant_secrets: list[str]):
    """Fresh replicas and one router per tenant secret, every router in front of all."""
    replicas = start_all(lambda i: Proc("replicas", *REPLICA_ARGS), REPLICAS)
    routers = []
    try:
        urls = ",".join(r.url for r in replicas)
        routers = start_all(lambda i: Proc("router", "--replicas", urls, *ROUTER_ARGS,
                                           env={"ROUTER_TENANT_SECRET": tenant_secrets[i]}),
                            len(tenant_secrets))
        yield [r.url for r in routers], {r.url for r in replicas}
    finally:
        stop_all(routers)
        stop_all(replicas)


def hit_rate(router_urls: list[str], replica_urls: set[str]) -> float:
    """Send the workload one request at a time (deterministic: each answer is cached
    before the next probe), alternating between the routers; token hit rate from usage."""
    prompt = cached = 0
    clients = [httpx.Client(base_url=u, timeout=60,
                            headers={"authorization": f"Bearer {API_KEY}"})
               for u in router_urls]
    try:
        for i, req in enumerate(WORKLOAD):
            r = clients[i % len(clients)].post(req.path, json={
                "prompt": req.prompt, "max_tokens": req.max_tokens})
            assert r.status_code == 200, r.text
            assert r.headers["x-replica"] in replica_urls
            usage = r.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
    finally:
        for c in clients:
            c.close()
    return cached / prompt


def test_two_routers_reach_the_hit_rate_of_one():
    with pool(["shared-secret"]) as (routers, replicas):
        one = hit_rate(routers, replicas)
    # fresh replicas; two routers with the same secret, and two more for the control run
    with pool(["shared-secret", "shared-secret", "secret-1", "secret-2"]) as (routers, replicas):
        two = hit_rate(routers[:2], replicas)
        # control: router pods with different secrets salt the same API key differently, so
        # each group's prefix is computed once per router (and nothing cached above is
        # theirs) -- the test would notice pods that disagree
        split = hit_rate(routers[2:], replicas)
    # every group's first prompt is the only miss: 7/8 of the 513 shared tokens
    assert one > 0.7, one
    assert two >= 0.95 * one, (one, two)
    assert split < 0.95 * one, (one, split)
