"""Limits through the router: body size (413), prompt length (400), a full replica queue
(429 with Retry-After, no x-should-retry), and a graceful drain of one replica."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.router.cluster import cluster

SLOW = ("--tokens-per-block", "16", "--sim-step-overhead-s", "0.02")


@pytest.fixture(scope="module")
def small():
    """One slow replica that runs one sequence and queues one more; a router with a small
    body limit and a prompt-token limit."""
    with cluster(1, (*SLOW, "--max-num-seqs", "1", "--max-waiting", "1"),
                 ("--tokens-per-block", "16", "--max-body-bytes", "2048",
                  "--max-prompt-tokens", "50")) as (router, replicas):
        yield router, replicas


def until(state, what: str, tries: int = 500):
    """Poll ``state()`` until it is true (bounded); returns it."""
    for _ in range(tries):
        if got := state():
            return got
        time.sleep(0.02)
    raise AssertionError(f"never {what}")


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


def test_body_over_the_limit_is_413(small):
    router, _ = small
    url = router.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "x" * 4000, "max_tokens": 1})
    err = assert_openai_error(r, 413, "request_too_large")
    assert err["type"] == "invalid_request_error" and "2048" in err["message"]
    assert r.headers["x-should-retry"] == "false"
    body = json.dumps({"prompt": "y" * 4000, "max_tokens": 1}).encode()

    def chunks():  # no content-length: the limit must hold on the bytes actually read
        for i in range(0, len(body), 512):
            yield body[i:i + 512]

    r = httpx.post(router.url + "/v1/chat/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "request_too_large")
    assert httpx.post(url, json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_prompt_over_the_token_limit_is_400(small):
    router, _ = small
    url = router.url + "/v1/completions"
    ok = httpx.post(url, json={"prompt": "a" * 49, "max_tokens": 1})  # BOS + 49 = 50
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == 50
    r = httpx.post(url, json={"prompt": "a" * 50, "max_tokens": 1})
    err = assert_openai_error(r, 400, "context_length_exceeded")
    assert err["param"] == "prompt" and "51" in err["message"] and "50" in err["message"]
    assert r.headers["x-should-retry"] == "false"
    r = httpx.post(router.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "b" * 60}], "max_tokens": 1})
    assert_openai_error(r, 400, "context_length_exceeded")
    r = httpx.post(url, json={"prompt": list(range(2, 60)), "max_tokens": 1})
    assert_openai_error(r, 400, "context_length_exceeded")


def test_a_burst_over_the_queue_gets_429_with_retry_after(small):
    router, (replica,) = small

    async def burst(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(
                router.url + "/v1/completions",
                json={"prompt": f"burst {i}", "max_tokens": 30}) for i in range(n)))

    answers = asyncio.run(burst(8))
    statuses = sorted(r.status_code for r in answers)
    assert set(statuses) <= {200, 429}, [r.text for r in answers]
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
    for r in answers:
        if r.status_code == 429:
            err = assert_openai_error(r, 429)
            assert err["type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1
            assert "x-should-retry" not in r.headers  # clients may retry a 429
        else:
            assert r.json()["usage"]["completion_tokens"] == 30
            assert "x-should-retry" not in r.headers
    def idle():
        sched = httpx.get(replica.url + "/stats").json()["scheduler"]
        return sched["running"] == sched["waiting"] == 0
    until(idle, "emptied the queue")  # then the next request is served
    assert httpx.post(router.url + "/v1/completions",
                      json={"prompt": "after", "max_tokens": 1}, timeout=30).status_code == 200


def test_drain_finishes_the_stream_and_moves_new_requests():
    with cluster(2, SLOW, ("--tokens-per-block", "16", "--health-interval-s", "0.2")) as (
            router, replicas):
        by_url = {r.url: r for r in replicas}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", router.url + "/v1/completions", json={
                    "prompt": "a long answer, please", "max_tokens": 60,
                    "stream": True}) as stream:
                assert stream.status_code == 200
                draining = stream.headers["x-replica"]
                other = next(u for u in by_url if u != draining)
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                by_url[draining].signal(signal.SIGTERM)

                def health(url):
                    return {r["url"]: r["health"] for r in
                            client.get(router.url + "/stats").json()["replicas"]}[url]
                # the router's health check has seen the drain: new requests go elsewhere
                until(lambda: health(draining) != "healthy", "saw the replica drain")
                moved = [client.post(router.url + "/v1/completions", json={
                    "prompt": f"new {i}", "max_tokens": 2}) for i in range(4)]
                rest = [line for line in lines if line.startswith("data: ")]
        events = [first, *rest]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert len("".join(c["choices"][0]["text"] for c in chunks if c["choices"])) == 60
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        for r in moved:
            assert r.status_code == 200, r.text
            assert r.headers["x-replica"] == other
        deadline = time.monotonic() + 10
        while by_url[draining].proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert by_url[draining].proc.returncode == 0  # drained, then exited cleanly
        stats = httpx.get(router.url + "/stats").json()
        view = {r["url"]: r for r in stats["replicas"]}
        assert view[draining]["health"] != "healthy" and view[other]["health"] == "healthy"
        assert httpx.post(router.url + "/v1/completions", json={
            "prompt": "later", "max_tokens": 2}).headers["x-replica"] == other
