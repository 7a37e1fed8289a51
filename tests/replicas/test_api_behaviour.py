"""Back pressure, cancellation, limits, auth and drain of a live replica process."""

import asyncio
import re
import signal
import time
from collections import Counter

import httpx

from tests.procs import Proc

SLOW = ("--engine", "sim", "--kv-pages", "64", "--tokens-per-block", "16",
        "--sim-step-overhead-s", "0.02")


def stats(url):
    return httpx.get(url + "/stats").json()


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def finish_reasons(url) -> Counter:
    """The replica's finished sequences by reason, from its /metrics."""
    text = httpx.get(url + "/metrics").text
    return Counter({m[1]: float(m[2]) for m in re.finditer(
        r'^replica_request_success_total\{.*finished_reason="(\w+)".*\} (\S+)$', text, re.M)})


async def until_scheduled(c: httpx.AsyncClient, running: int, waiting: int, tries=1000):
    """Wait (a bounded poll) until the replica runs and queues exactly these many."""
    for _ in range(tries):
        s = (await c.get("/stats")).json()["scheduler"]
        if (s["running"], s["waiting"]) == (running, waiting):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the replica never ran {running} and queued {waiting}: {s}")


def test_disconnect_mid_stream_frees_pages_at_once():
    with Proc("replicas", *SLOW) as rep:
        body = {"prompt": "y" * 100, "max_tokens": 500, "stream": True}
        with httpx.stream("POST", rep.url + "/v1/completions", json=body, timeout=10) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            s = stats(rep.url)
            assert s["scheduler"]["running"] == 1 and s["kv_cache"]["used_pages"] > 0
        # 500 tokens at 20 ms a step would end after 10 s, "length"; the disconnect ends the
        # sequence as "abort", and its pages go back with it.
        assert wait_for(lambda: finish_reasons(rep.url), timeout=30.0)
        assert finish_reasons(rep.url) == Counter(abort=1)
        s = stats(rep.url)
        assert (s["kv_cache"]["used_pages"], s["scheduler"]["running"]) == (0, 0)


def test_full_queue_answers_429_with_retry_after():
    with Proc("replicas", *SLOW, "--max-num-seqs", "1", "--max-waiting", "1") as rep:
        async def run():
            async with httpx.AsyncClient(base_url=rep.url, timeout=30) as c:
                body = {"prompt": "z", "max_tokens": 150}  # 3 s each: the third comes
                # while the first runs and the second waits, on a loaded machine too
                first = asyncio.create_task(c.post("/v1/completions", json=body))
                await until_scheduled(c, running=1, waiting=0)
                second = asyncio.create_task(c.post("/v1/completions", json=body))
                await until_scheduled(c, running=1, waiting=1)
                third = await c.post("/v1/completions", json=body)
                return third, await first, await second
        third, first, second = asyncio.run(run())
        assert third.status_code == 429
        assert third.headers["retry-after"] == "1"
        assert "x-should-retry" not in third.headers
        assert third.json()["error"]["type"] == "rate_limit_error"
        assert (first.status_code, second.status_code) == (200, 200)


def test_burst_larger_than_the_kv_pool_completes_without_leak(replica):
    # 64 pages x 16 tokens = 1024 tokens of KV; 16 requests of ~320 tokens need 5x that.
    async def run():
        async with httpx.AsyncClient(base_url=replica.url, timeout=60) as c:
            reqs = [c.post("/v1/completions", json={"prompt": f"{i:03d}" + "w" * 296,
                                                    "max_tokens": 20}) for i in range(16)]
            return await asyncio.gather(*reqs)
    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 16
    assert all(a.json()["usage"]["completion_tokens"] == 20 for a in answers)
    s = stats(replica.url)
    assert s["kv_cache"]["used_pages"] == 0
    assert s["scheduler"]["running"] == s["scheduler"]["waiting"] == 0
    assert s["kv_cache"]["free_pages"] + s["kv_cache"]["cached_pages"] == 64


def test_internal_token_guards_probe_and_stats():
    with Proc("replicas", "--engine", "sim", "--internal-token", "s3cret") as rep:
        assert httpx.post(rep.url + "/probe_reuse", json={"prompt": "a"}).status_code == 401
        bad = httpx.post(rep.url + "/probe_reuse", json={"prompt": "a"},
                         headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(rep.url + "/probe_reuse", json={"prompt": "a"},
                        headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(rep.url + "/stats").status_code == 401
        public = httpx.post(rep.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert public.status_code == 200


def test_sigterm_drains_then_exits():
    rep = Proc("replicas", *SLOW, "--drain-timeout-s", "20")
    try:
        body = {"prompt": "drain", "max_tokens": 150, "stream": True}  # runs 3 s: the
        # late request comes while it drains
        with httpx.stream("POST", rep.url + "/v1/completions", json=body, timeout=20) as r:
            lines = r.iter_lines()
            next(lines)
            rep.signal(signal.SIGTERM)
            assert wait_for(lambda: httpx.get(rep.url + "/ready").status_code == 503, 2.0)
            refused = httpx.post(rep.url + "/v1/completions", json={"prompt": "late"})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "draining"
            rest = list(lines)
        assert "data: [DONE]" in rest
        assert rep.proc.wait(10) == 0
    finally:
        rep.stop()
