"""Failures the router must absorb: dead replicas, slow probes, broken streams."""

import asyncio
import json
import re
import signal
import time
from collections import Counter

import httpx
import pytest

from .cluster import cluster


def sse_events(lines):
    return [json.loads(line[6:]) for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"]


async def generating(client, url: str, tries: int = 1000) -> None:
    """Wait until the replica at ``url`` has a sequence running (a bounded poll)."""
    for _ in range(tries):
        if (await client.get(url + "/stats")).json()["scheduler"]["running"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{url} never ran a sequence")


def finish_reasons(url: str) -> Counter:
    """The replica's finished sequences by reason, from its /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return Counter({m[1]: float(m[2]) for m in re.finditer(
        r'^replica_request_success_total\{.*finished_reason="(\w+)".*\} (\S+)$', text, re.M)})


def next_finish(url: str, before: Counter, tries: int = 3000) -> str:
    """Wait until the replica finishes one more sequence than ``before`` (a bounded poll,
    longer than any generation here takes); the reason it finished with."""
    for _ in range(tries):
        grown = finish_reasons(url) - before
        if grown:
            assert sum(grown.values()) == 1, grown
            return next(iter(grown))
        time.sleep(0.01)
    raise AssertionError(f"{url} finished nothing more than {dict(before)}")


async def _one(client, i, stream, outcomes):
    body = {"prompt": f"request {i} " + "q" * 200, "max_tokens": 20, "stream": stream}
    try:
        if not stream:
            r = await client.post("/v1/completions", json=body)
            outcomes.append(("whole", r.status_code, r.status_code == 200 and
                             r.json()["usage"]["completion_tokens"] == 20))
            return
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line]
        events = sse_events(lines)
        complete = lines[-1] == "data: [DONE]" and not any("error" in e for e in events)
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        outcomes.append(("stream", r.status_code, complete and len(text) == 20,
                         any("error" in e for e in events), lines[-1] == "data: [DONE]",
                         r.headers["x-replica"]))
    except httpx.HTTPError as exc:
        outcomes.append(("lost", repr(exc)))


def test_replica_killed_under_load_loses_no_request_that_had_not_started_streaming():
    args = ("--sim-step-overhead-s", "0.01", "--tokens-per-block", "16")
    with cluster(3, args, ("--tokens-per-block", "16", "--policy", "round_robin",
                           "--health-interval-s", "0.2")) as (router, reps):
        victim = reps[0]

        async def run():
            outcomes = []
            async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
                tasks = [asyncio.create_task(_one(client, i, i % 2 == 0, outcomes))
                         for i in range(90)]
                await generating(client, victim.url)  # killed while it generates
                victim.proc.send_signal(signal.SIGKILL)
                await asyncio.gather(*tasks)
            return outcomes
        outcomes = asyncio.run(run())
    assert not [o for o in outcomes if o[0] == "lost"]
    whole = [o for o in outcomes if o[0] == "whole"]
    streams = [o for o in outcomes if o[0] == "stream"]
    assert len(whole) == len(streams) == 45
    assert all(o[1] == 200 and o[2] for o in whole)      # retried: none failed
    broken = [o for o in streams if not o[2]]
    # Only streams already flowing from the dead replica may fail, and they end cleanly.
    assert all(o[3] and o[4] for o in broken)
    assert {o[5] for o in broken} <= {victim.url}


def test_slow_probes_never_hold_a_request_past_the_deadline():
    # Replica 1 answers probes after 10 minutes: a request that waited for one would not be
    # answered within the client's 10 s.
    with cluster(2, ("--tokens-per-block", "16"), ("--tokens-per-block", "16",
                                                   "--probe-deadline-ms", "30"),
                 per_replica_args={1: ("--fault-probe-delay-s", "600")}) as (router, reps):
        for i in range(8):
            try:
                r = httpx.post(router.url + "/v1/completions",
                               json={"prompt": f"deadline {i}", "max_tokens": 1}, timeout=10)
            except httpx.ReadTimeout:
                raise AssertionError("a request waited for the slow probe") from None
            assert r.status_code == 200
        stats = httpx.get(router.url + "/stats").json()
        reps[1].proc.kill()  # a graceful stop would wait for its sleeping probes
    slow = [c for d in stats["decisions"] for c in d["candidates"] if c["replica"] == reps[1].url]
    assert slow and all(c["reuse"] is None for c in slow)  # "no reuse known", not waited for
    assert {c["note"] for c in slow} == {
        "probe failed: no answer within the deadline; reuse unknown"}


def test_a_retry_never_duplicates_a_streamed_answer():
    with cluster(2, ("--tokens-per-block", "16"), ("--tokens-per-block", "16",
                                                   "--policy", "round_robin"),
                 per_replica_args={0: ("--fault-cut-stream-after", "3")}) as (router, reps):
        cut_url = reps[0].url
        seen_cut = 0
        for i in range(6):
            with httpx.stream("POST", router.url + "/v1/completions", timeout=10,
                              json={"prompt": f"dup {i}", "max_tokens": 10, "stream": True}) as r:
                replica = r.headers["x-replica"]
                lines = [line for line in r.iter_lines() if line]
            events = sse_events(lines)
            text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            assert lines[-1] == "data: [DONE]"
            if replica == cut_url:
                seen_cut += 1
                assert len(text) == 3 and "error" in events[-1]  # 3 chunks, then an error
            else:
                assert len(text) == 10 and not any("error" in e for e in events)
        assert seen_cut >= 2
        # Not streaming: nothing was sent yet, so the router retries and answers once, whole.
        for i in range(6):
            r = httpx.post(router.url + "/v1/completions", timeout=10,
                           json={"prompt": f"whole {i}", "max_tokens": 10})
            assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 10
            assert r.headers["x-replica"] == reps[1].url


def test_replica_answering_500s_is_retried_and_its_circuit_opens():
    with cluster(2, ("--tokens-per-block", "16"), ("--tokens-per-block", "16",
                                                   "--policy", "round_robin",
                                                   "--failure-threshold", "2"),
                 per_replica_args={0: ("--fault-error-rate", "1")}) as (router, reps):
        for i in range(10):
            r = httpx.post(router.url + "/v1/completions",
                           json={"prompt": f"e{i}", "max_tokens": 2}, timeout=10)
            assert r.status_code == 200 and r.headers["x-replica"] == reps[1].url
        bad = next(x for x in httpx.get(router.url + "/stats").json()["replicas"]
                   if x["url"] == reps[0].url)
        assert bad["circuit"] == "open" and bad["failures"] == 2


def test_client_disconnect_cancels_the_upstream_request():
    # 500 tokens at 20 ms a step: a generation nobody cancels ends after 10 s, "length"
    with cluster(1, ("--sim-step-overhead-s", "0.02", "--tokens-per-block", "16"),
                 ("--tokens-per-block", "16")) as (router, reps):
        url = reps[0].url
        rep_stats = lambda: httpx.get(url + "/stats").json()
        before = finish_reasons(url)
        with httpx.stream("POST", router.url + "/v1/completions", timeout=10,
                          json={"prompt": "long", "max_tokens": 500, "stream": True}) as r:
            lines = r.iter_lines()
            [next(lines) for _ in range(4)]
            assert rep_stats()["scheduler"]["running"] == 1
        assert next_finish(url, before) == "abort"
        assert rep_stats()["kv_cache"]["used_pages"] == 0
        assert rep_stats()["scheduler"]["running"] == 0
        # Not streaming: the router watches for the disconnect too.
        before = finish_reasons(url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", timeout=0.3,
                       json={"prompt": "long again", "max_tokens": 500})
        assert next_finish(url, before) == "abort"
        assert rep_stats()["scheduler"]["running"] == 0


def test_total_timeout_ends_requests_cleanly():
    with cluster(1, ("--sim-step-overhead-s", "0.02",), ("--total-timeout-s", "0.5")
                 ) as (router, reps):
        r = httpx.post(router.url + "/v1/completions", timeout=10,
                       json={"prompt": "slow", "max_tokens": 200})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with httpx.stream("POST", router.url + "/v1/completions", timeout=10,
                          json={"prompt": "slow", "max_tokens": 200, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "timeout"
