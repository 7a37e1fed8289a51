"""A live cluster for the dashboard tests: sim replicas, a hybrid torch replica (three KV
pools) and a router as real processes.

The router is also given one replica URL that nothing answers and whose text is HTML, so the
page must show an unhealthy replica and must show its name as text, never as markup.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.procs import Proc, free_port

# Prompt families: requests of one family share a long prefix, so repeats hit the cache.
FAMILIES = (
    "You are a support agent for ACME network routers. Answer briefly and politely. " * 4,
    "Summarise the following contract clause by clause, citing clause numbers. " * 4,
    "Translate the user's message into French, keeping a formal register throughout. " * 4,
    "You write SQL for an analytics warehouse; prefer window functions and CTEs. " * 4,
)


HYBRID_MODEL = "torch-byte-lm"


@dataclass
class Live:
    router: Proc
    replicas: list[Proc]  # sim replicas (model sim-byte-lm)
    hybrid: Proc  # the torch tiny-hybrid replica (model torch-byte-lm)
    bogus: str  # a replica URL nothing answers; its path is HTML

    def stats(self) -> dict:
        return httpx.get(self.router.url + "/stats", timeout=10).json()

    def settled(self, timeout: float = 30.0) -> dict:
        """The router's /stats once it shows every live replica's current KV pools (idle
        replicas' pools stop changing; the router fetches them every 0.2 s)."""
        for _ in range(int(timeout / 0.05)):  # a bounded wait on the router's state
            own = {r.url: httpx.get(r.url + "/stats", timeout=10).json()["kv_cache"]["pools"]
                   for r in (*self.replicas, self.hybrid)}
            stats = self.stats()
            shown = {r["url"]: r["kv_pools"] for r in stats["replicas"] if r["url"] in own}
            if shown == own:
                return stats
            time.sleep(0.05)
        raise AssertionError(f"router shows pools {shown}, not {own}")

    def traffic(self, n: int, start: int = 0, workers: int = 6) -> list[str]:
        """Send ``n`` completions (prompt families in turn); returns the x-replica of each."""
        def one(i: int) -> str:
            body = {"model": "sim-byte-lm", "max_tokens": 6,
                    "prompt": FAMILIES[i % len(FAMILIES)] + f"Question {i}?"}
            r = httpx.post(self.router.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.headers["x-replica"]
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, range(start, start + n)))


@pytest.fixture(scope="package")
def live():
    bogus = f"http://127.0.0.1:{free_port()}/<svg/onload=window.__xss=1>&amp;"
    replicas: list[Proc] = []
    router = None
    try:
        for _ in range(3):
            replicas.append(Proc("replicas", "--engine", "sim", "--log-level", "warning",
                                 "--tokens-per-block", "16", "--kv-pages", "96",
                                 "--sim-speedup", "20"))
        hybrid = Proc("replicas", "--engine", "torch", "--preset", "tiny-hybrid",
                      "--log-level", "warning", "--tokens-per-block", "16", "--kv-pages", "48")
        replicas.append(hybrid)  # stopped with the others
        urls = [r.url for r in replicas] + [bogus]
        router = Proc("router", "--replicas", ",".join(urls), "--tokens-per-block", "16",
                      "--seed", "7", "--kv-pools-interval-s", "0.2", "--log-level", "warning")
        yield Live(router, replicas[:-1], hybrid, bogus)
    finally:
        with contextlib.suppress(Exception):
            if router is not None:
                router.stop()
        for r in replicas:
            r.stop()
