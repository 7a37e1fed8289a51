"""--api-keys through a live router and sim replica (real processes on loopback): keys of one
tenant share its limits and its cache, tenants never share a cache, unknown keys get the
default, a client that leaves gives its concurrency slot back, and refused requests never
reach a replica. Exact Retry-After values are tests/router/test_tenants.py's (fake clock)."""

from __future__ import annotations

import hashlib

import httpx
import openai
import pytest

from bench._common import metric_sum
from router.tenants import tenant_salt
from tests.procs import Proc
from tests.waiting import until

from .cluster import cluster

MODEL = "sim-byte-lm"
KEYS = """\
tenants:
  acme:
    keys: [acme-key-1, "sha256:%s"]
    limits: {requests_per_minute: 3}
  beta:
    keys: [beta-key-1]
  solo:
    keys: [solo-key-1]
    limits: {concurrent_requests: 1}
  small:
    keys: [small-key-1]
    limits: {prompt_tokens_per_minute: 40}
default: reject
""" % hashlib.sha256(b"acme-key-2").hexdigest()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys.yaml"
    path.write_text(KEYS)
    # 10 ms a decode step: a long stream is still running while the test looks
    with cluster(1, ("--tokens-per-block", "16", "--sim-step-overhead-s", "0.01"),
                 ("--tokens-per-block", "16", "--api-keys", str(path))) as (router, reps):
        yield router, reps[0]


def post(router: Proc, key: str | None, prompt: str, max_tokens: int = 2,
         request_id: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if request_id:
        headers["x-request-id"] = request_id
    return httpx.post(router.url + "/v1/completions", timeout=30, headers=headers,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def reusable(replica: Proc, prompt: str, tenant: str) -> int:
    """What the replica holds for ``tenant``'s requests of ``prompt`` (the salt the router
    derives from the tenant's name: no --tenant-secret here)."""
    r = httpx.post(replica.url + "/probe_reuse", timeout=10,
                   json={"prompt": prompt, "cache_salt": tenant_salt(None, tenant)})
    assert r.status_code == 200, r.text
    return r.json()["num_tokens"]


def served(replica: Proc) -> float:
    """Requests the replica finished (any reason)."""
    return metric_sum(httpx.get(replica.url + "/metrics", timeout=10).text,
                      "replica_request_success_total")


def tenant_stats(router: Proc, name: str) -> dict:
    tenants = httpx.get(router.url + "/stats", timeout=10).json()["tenants"]["tenants"]
    return next(t for t in tenants if t["name"] == name)


def decided(router: Proc) -> set[str]:
    return {d["request_id"] for d in httpx.get(router.url + "/stats", timeout=10).json()
            ["decisions"]}


def test_two_keys_of_a_tenant_share_its_limit_and_its_cache(live):
    router, replica = live
    prompt = "Tenant acme's shared system prompt, long enough for a few blocks. " * 3
    before = served(replica)
    first = post(router, "acme-key-1", prompt)
    assert cached(first) == 0
    left = reusable(replica, prompt, "acme")
    assert left > 0
    second = post(router, "acme-key-2", prompt)  # the other key: the same cache
    assert cached(second) == left
    third = post(router, "acme-key-1", "something else entirely")
    assert third.status_code == 200

    # the 4th request within the minute, whichever key: 429 before any probe
    refused = post(router, "acme-key-2", prompt, request_id="refused-by-acme-limit")
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.json() == {"error": {
        "message": refused.json()["error"]["message"], "type": "rate_limit_error",
        "param": None, "code": "rate_limit_requests"}}
    assert "requests_per_minute" in refused.json()["error"]["message"]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="acme-key-1", max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert (info.value.status_code, info.value.code) == (429, "rate_limit_requests")
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 60

    assert served(replica) == before + 3  # the refused ones never reached it
    assert "refused-by-acme-limit" not in decided(router)  # nor were they probed or routed
    acme = tenant_stats(router, "acme")
    usages = [r.json()["usage"] for r in (first, second, third)]
    assert (acme["requests"], acme["rejected"], acme["rejected_by"]["rate_limit_requests"],
            acme["requests_last_minute"], acme["in_flight"]) == (3, 2, 2, 3, 0)
    assert acme["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert acme["cached_tokens"] == sum(u["prompt_tokens_details"]["cached_tokens"]
                                        for u in usages)


def test_tenants_never_share_a_cache(live):
    router, replica = live
    prompt = "A prompt both tenants send, word for word, long enough for blocks. " * 3
    assert cached(post(router, "solo-key-1", prompt)) == 0
    assert reusable(replica, prompt, "solo") > 0
    assert reusable(replica, prompt, "beta") == 0
    assert cached(post(router, "beta-key-1", prompt)) == 0  # solo's blocks are not beta's
    left = reusable(replica, prompt, "beta")
    assert left > 0 and cached(post(router, "beta-key-1", prompt)) == left  # its own are


def test_an_unknown_or_missing_key_is_refused_401_before_anything(live):
    router, replica = live
    before, routed = served(replica), decided(router)
    for key in ("not-a-key", None):
        r = post(router, key, "hello")
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert served(replica) == before and decided(router) == routed
    stats = httpx.get(router.url + "/stats", timeout=10).json()["tenants"]
    assert stats["default"] == "reject" and stats["unauthenticated"] == 3
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    assert metric_sum(metrics, "router_tenant_rejected_total", reason="unauthenticated") == 3


def test_a_client_that_leaves_mid_stream_frees_its_slot(live):
    router, _ = live
    headers = {"authorization": "Bearer solo-key-1"}
    answered = tenant_stats(router, "solo")["prompt_tokens"]  # of answers complete so far
    with httpx.stream("POST", router.url + "/v1/completions", timeout=30, headers=headers,
                      json={"model": MODEL, "prompt": "a long answer", "max_tokens": 2000,
                            "stream": True}) as long:
        lines = long.iter_lines()  # kept: a dropped line iterator closes the response
        next(line for line in lines if line.startswith("data: {"))  # it is streaming
        assert tenant_stats(router, "solo")["in_flight"] == 1
        busy = post(router, "solo-key-1", "meanwhile")
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "concurrency_limit"
    # the client left: the router's handler is cancelled and gives the slot back
    until(lambda: tenant_stats(router, "solo")["in_flight"] == 0, "solo's slot freed")
    assert tenant_stats(router, "solo")["prompt_tokens"] == answered  # it never completed
    assert post(router, "solo-key-1", "now it passes").status_code == 200
    assert post(router, "solo-key-1", "and once done, again").status_code == 200
    solo = tenant_stats(router, "solo")
    assert (solo["in_flight"], solo["rejected_by"]["concurrency_limit"]) == (0, 1)


def test_the_token_limit_counts_the_tokenized_prompt(live):
    router, replica = live
    first = post(router, "small-key-1", "twenty-five characters..")
    n = first.json()["usage"]["prompt_tokens"]
    assert 20 < n <= 40 and cached(first) == 0
    assert tenant_stats(router, "small")["prompt_tokens_last_minute"] == n
    before = served(replica)
    again = post(router, "small-key-1", "twenty-five characters..")  # 2n > 40 in the minute
    assert again.status_code == 429 and again.json()["error"]["code"] == "rate_limit_tokens"
    assert 1 <= int(again.headers["retry-after"]) <= 60
    never = post(router, "small-key-1", "x" * 60)  # alone over the limit: can never pass
    assert never.status_code == 400 and never.headers["x-should-retry"] == "false"
    assert never.json()["error"]["code"] == "prompt_over_token_limit"
    assert served(replica) == before
    small = tenant_stats(router, "small")
    assert (small["requests"], small["rejected_by"]["rate_limit_tokens"],
            small["rejected_by"]["prompt_over_token_limit"],
            small["prompt_tokens_last_minute"]) == (1, 1, 1, n)


def test_unknown_keys_get_the_default_tenant_and_its_limits(live, tmp_path):
    _, replica = live
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n  acme: {keys: [acme-key-1]}\n"
                    "default: {limits: {requests_per_minute: 2}}\n")
    router = Proc("router", "--replicas", replica.url, "--tokens-per-block", "16",
                  "--api-keys", str(path), "--log-level", "warning")
    try:
        prompt = "Anonymous callers share the default tenant and its cache, always. " * 3
        assert cached(post(router, "some-unknown-key", prompt)) == 0
        left = reusable(replica, prompt, "default")
        assert left > 0 and cached(post(router, None, prompt)) == left  # one tenant
        third = post(router, "another-unknown-key", prompt)
        assert third.status_code == 429 and third.json()["error"]["code"] == \
            "rate_limit_requests"
        assert post(router, "acme-key-1", prompt).status_code == 200  # its own tenant
        stats = httpx.get(router.url + "/stats", timeout=10).json()["tenants"]
        assert stats["default"] == "default" and stats["unauthenticated"] == 0
        default = next(t for t in stats["tenants"] if t["name"] == "default")
        assert (default["requests"], default["rejected"]) == (2, 1)
    finally:
        router.stop()
