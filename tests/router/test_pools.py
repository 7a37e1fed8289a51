"""router/pools.py: the router's ``/stats`` shows each replica's KV pools as the replica's
own ``/stats`` has them. In-process against answers of every kind (a failed fetch keeps the
last figures); then live: a full-attention sim replica (one pool) and a hybrid torch replica
(full attention, sliding window, recurrent) behind one router, after traffic to both."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.pools import PoolWatcher
from router.registry import Health, Registry
from router.settings import RouterSettings
from tests.procs import Proc
from tests.waiting import until

SYSTEM = "You answer questions about the KV cache of a hybrid model, briefly. " * 3


POOL = {"life_cycle": "sliding_window(64, sink=32)", "num_pages": 64, "free_pages": 10,
        "used_pages": 20, "cached_pages": 34, "evicted_pages": 7, "block_pages": 40,
        "layers": 5, "page_bytes": 65536}


class Answers:
    """An Upstream whose ``get_json`` answers from a table (an exception is raised)."""

    def __init__(self, answers: dict) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def get_json(self, url: str, timeout: float):
        self.asked.append(url)
        answer = self.answers[url.removesuffix("/stats")]
        if isinstance(answer, Exception):
            raise answer
        return answer


def watcher_of(answers: dict, health: dict) -> tuple[PoolWatcher, Registry, Answers]:
    registry = Registry(failure_threshold=3, open_seconds=5.0)
    for url, state in health.items():
        registry.add(url).health = state
    upstream = Answers(answers)
    return PoolWatcher(registry, upstream, RouterSettings()), registry, upstream


@pytest.mark.parametrize("answer", [
    (503, None),
    (200, None),
    (200, {"kv_cache": []}),
    (200, {"kv_cache": {"pools": None}}),
    (200, {"kv_cache": {"pools": [{"life_cycle": "full_attention"}]}}),  # fields missing
    (200, {"kv_cache": {"pools": [{**POOL, "free_pages": "many"}]}}),
    TimeoutError(),
    ConnectionRefusedError(111, "Connection refused"),
    ValueError("bad chunked body"),
])
def test_an_unusable_answer_keeps_the_last_pools(answer):
    url = "http://r1"
    watcher, registry, _ = watcher_of({url: (200, {"kv_cache": {"pools": [POOL]}})},
                                      {url: Health.HEALTHY})
    replica = registry.get(url)
    asyncio.run(watcher.refresh())
    assert [p.model_dump() for p in replica.kv_pools] == [POOL]
    first_at = replica.kv_pools_at
    watcher.upstream.answers[url] = answer
    asyncio.run(watcher.refresh())
    assert [p.model_dump() for p in replica.kv_pools] == [POOL]
    assert replica.kv_pools_at == first_at


def test_only_healthy_replicas_are_asked():
    health = {"http://ok": Health.HEALTHY, "http://down": Health.UNHEALTHY,
              "http://refused": Health.REFUSED, "http://new": Health.UNKNOWN}
    full = {**POOL, "life_cycle": "full_attention", "evicted_pages": 0}  # two pools told apart
    answers = {url: (200, {"kv_cache": {"pools": [full, POOL]}}) for url in health}
    watcher, registry, upstream = watcher_of(answers, health)
    asyncio.run(watcher.refresh())
    assert upstream.asked == ["http://ok/stats"]
    pools = [registry.get(u).kv_pools for u in health]
    assert [p.model_dump() for p in pools[0]] == [full, POOL]  # as answered, in order
    assert pools[1:] == [None, None, None]


@pytest.fixture(scope="module")
def live():
    common = ("--tokens-per-block", "16", "--log-level", "warning")
    with Proc("replicas", "--engine", "sim", "--kv-pages", "16", "--sim-speedup", "20",
              *common) as sim, \
            Proc("replicas", "--engine", "torch", "--preset", "tiny-hybrid",
                 "--kv-pages", "32", *common) as hybrid, \
            Proc("router", "--replicas", f"{sim.url},{hybrid.url}",
                 "--kv-pools-interval-s", "0.1", *common) as router:
        yield router, sim, hybrid


def complete(router: Proc, model: str, prompt: str) -> str:
    r = httpx.post(router.url + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": prompt, "max_tokens": 3})
    assert r.status_code == 200, r.text
    return r.headers["x-replica"]


def own_pools(replica: Proc) -> list[dict]:
    return httpx.get(replica.url + "/stats").json()["kv_cache"]["pools"]


def settled(router: Proc, replicas: list[Proc], timeout: float = 30.0) -> list[dict]:
    """Wait until the router shows every replica's current pools (the replicas are idle, so
    theirs stop changing); returns the router's replica views then."""
    last = {}

    def shown_as_own():
        last["own"] = [own_pools(r) for r in replicas]
        last["shown"] = httpx.get(router.url + "/stats").json()["replicas"]
        return [r["kv_pools"] for r in last["shown"]] == last["own"] and last["shown"]

    return until(shown_as_own, lambda: f"the router's pools "
                 f"{[r['kv_pools'] for r in last['shown']]} became {last['own']}",
                 tries=int(timeout / 0.05), every=0.05)


def test_router_stats_show_each_replicas_pools(live):
    router, sim, hybrid = live
    before = settled(router, [sim, hybrid])  # the first round runs at start-up
    assert [r["url"] for r in before] == [sim.url, hybrid.url]

    # 8 different 7-block prompts through 16 pages: the sim replica must evict.
    for i in range(8):
        assert complete(router, "sim-byte-lm", f"{i} " * 50) == sim.url
    for i in range(3):
        assert complete(router, "torch-byte-lm", SYSTEM + f"Question {i}?") == hybrid.url

    shown = settled(router, [sim, hybrid])
    assert [r["url"] for r in shown] == [sim.url, hybrid.url]
    # settled() waited for the router to show exactly each replica's own pools; what they
    # are, by the replicas' configuration and the traffic:
    sim_pools, hybrid_pools = shown[0]["kv_pools"], shown[1]["kv_pools"]
    assert [p["life_cycle"] for p in sim_pools] == ["full_attention"]
    assert [p["life_cycle"] for p in hybrid_pools] == [
        "full_attention", "sliding_window(24)", "recurrent"]
    assert [p["num_pages"] for p in sim_pools + hybrid_pools] == [16, 32, 32, 32]
    for p in sim_pools + hybrid_pools:  # idle: nothing held, every page free or cached
        assert p["used_pages"] == 0
        assert p["free_pages"] + p["cached_pages"] == p["num_pages"]
    assert sim_pools[0]["evicted_pages"] > 0 and sim_pools[0]["cached_pages"] > 0
    assert hybrid_pools[0]["cached_pages"] > 0  # the shared system prompt stayed cached
    assert sim_pools != before[0]["kv_pools"] and hybrid_pools != before[1]["kv_pools"]
    assert all(r["kv_pools_age_s"] >= 0 for r in shown)
