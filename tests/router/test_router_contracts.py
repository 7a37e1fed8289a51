"""Promises of the router no other test checks end to end (issue 16): the probed reuse is
the reuse the replica then reports, the client's credentials never reach a replica,
--max-attempts bounds the retries, and a client that leaves during the probes or while
queued at a replica costs that replica nothing."""

import threading

import httpx
import pytest

from bench._common import metric_sum
from tests.procs import Proc
from tests.waiting import until

from .cluster import cluster
from .relay import RecordingRelay


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (with these label values) in ``url``/metrics."""
    return metric_sum(httpx.get(url + "/metrics", timeout=10).text, name, **labels)


def test_the_chosen_replicas_probed_reuse_is_the_answers_cached_tokens():
    with cluster(2, ("--tokens-per-block", "16"), ("--tokens-per-block", "16")) as (router, _):
        prompt = "the shared part of a prompt, long enough for a few blocks " * 4
        seen = []
        for i, tail in enumerate(["", " first", " second", " first"]):
            r = httpx.post(router.url + "/v1/completions", timeout=30,
                           json={"prompt": prompt + tail, "max_tokens": 2})
            assert r.status_code == 200
            seen.append((r.headers["x-request-id"], r.headers["x-replica"],
                         r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        decisions = {d["request_id"]: d for d in
                     httpx.get(router.url + "/stats", timeout=10).json()["decisions"]}
        for request_id, replica, cached in seen:
            d = decisions[request_id]
            assert d["chosen"] == replica
            chosen = next(c for c in d["candidates"] if c["replica"] == replica)
            assert chosen["reuse"] == cached, (d, cached)
        assert [cached for _, _, cached in seen][0] == 0
        assert all(cached > 0 for _, _, cached in seen[1:])  # the shared blocks were reused


def test_the_clients_authorization_never_reaches_a_replica():
    replica = Proc("replicas", "--engine", "sim", "--log-level", "warning")
    relay = router = None
    try:
        relay = RecordingRelay(replica.port)
        router = Proc("router", "--replicas", relay.url, "--log-level", "warning")
        secret = "sk-client-secret-9c1d"
        for stream in (False, True):
            r = httpx.post(router.url + "/v1/chat/completions", timeout=30,
                           headers={"authorization": f"Bearer {secret}",
                                    "x-api-key": secret},
                           json={"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2, "stream": stream})
            assert r.status_code == 200
        heads = [head for head, _ in relay.requests]
        forwarded = [h for h in heads if h.startswith(b"POST /v1/chat/completions ")]
        probes = [h for h in heads if h.startswith(b"POST /probe_reuse ")]
        assert len(forwarded) == 2 and len(probes) == 2  # what the relay saw is the traffic
        for head in heads:
            assert secret.encode() not in head
            assert b"\r\nauthorization:" not in head.lower()
    finally:
        if router is not None:
            router.stop()
        if relay is not None:
            relay.close()
        replica.stop()


@pytest.mark.parametrize("max_attempts, failed, retries", [(1, 2, 0), (2, 0, 2)])
def test_max_attempts_bounds_the_retries(max_attempts, failed, retries):
    """Round robin over a replica that answers 500 and a healthy one: with one attempt the
    requests routed to the bad one fail; with two they are retried once each."""
    with cluster(2, router_args=("--policy", "round_robin", "--max-attempts",
                                 str(max_attempts), "--failure-threshold", "100",
                                 "--retry-budget-ratio", "10"),
                 per_replica_args={0: ("--fault-error-rate", "1")}) as (router, reps):
        statuses = [httpx.post(router.url + "/v1/completions", timeout=30,
                               json={"prompt": f"r{i}", "max_tokens": 2}).status_code
                    for i in range(4)]
        assert statuses.count(200) == 4 - failed
        assert _metric(router.url, "router_retries_total") == retries
        # the healthy replica answered every request that succeeded, once
        assert _metric(reps[1].url, "replica_request_success_total") == 4 - failed


def test_a_client_that_leaves_during_the_probes_is_never_forwarded():
    """Probes that take 1 s (the deadline 3 s): a client that gives up at 0.2 s leaves
    during the probe phase; the replica never generates for it."""
    with cluster(1, ("--fault-probe-delay-s", "1"), ("--probe-deadline-ms", "3000")
                 ) as (router, reps):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", timeout=0.2,
                       json={"prompt": "left early", "max_tokens": 2})
        # a request after it waits for its own probes (1 s), longer than the first one's
        # would have taken to be forwarded had it not been cancelled
        r = httpx.post(router.url + "/v1/completions", timeout=30,
                       json={"prompt": "stayed", "max_tokens": 2})
        assert r.status_code == 200
        assert _metric(reps[0].url, "replica_request_success_total") == 1
        assert _metric(reps[0].url, "replica_prompt_tokens_total") == \
            r.json()["usage"]["prompt_tokens"]


def test_a_client_that_leaves_while_queued_at_the_replica_frees_its_place():
    """One sequence at a time on the replica: a second request queues behind a long
    stream; its client leaves; it is dropped from the queue and never generates."""
    with cluster(1, ("--max-num-seqs", "1", "--sim-step-overhead-s", "0.02")
                 ) as (router, reps):
        stats = lambda: httpx.get(reps[0].url + "/stats", timeout=10).json()
        with httpx.stream("POST", router.url + "/v1/completions", timeout=30,
                          json={"prompt": "long one", "max_tokens": 300,
                                "stream": True}) as long:
            lines = long.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it runs
            queued = threading.Thread(target=lambda: _gives_up(router.url), daemon=True)
            queued.start()
            until(lambda: stats()["load"]["waiting"] == 1, "the second request queued")
            queued.join(30)
            until(lambda: stats()["load"]["waiting"] == 0, "the queue emptied")
            assert stats()["load"]["running"] == 1  # the long stream still runs
        until(lambda: stats()["load"]["running"] == 0, "the long stream ended")
        until(lambda: stats()["kv_cache"]["used_pages"] == 0, "its pages freed")
        # neither finished normally: the stream was left too, the queued one never ran
        assert _metric(reps[0].url, "replica_request_success_total",
                       finished_reason="length") == 0
        assert _metric(reps[0].url, "replica_generation_tokens_total") < 300


def _gives_up(url: str) -> None:
    """Waits 2 s, then leaves: time enough to be seen queued on a loaded machine, and the
    long stream (300 steps of 20 ms) still runs 4 s after."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", timeout=2.0,
                   json={"prompt": "queued", "max_tokens": 2})
