"""Tenant isolation through the router: with a tenant secret, the salt sent to replicas is
HMAC(secret, API key) [+ "/" + the client's cache_salt], so no tenant can reach another's
KV blocks; replicas refuse probes without the internal token."""

from __future__ import annotations

import contextlib
import hashlib
import hmac

import httpx
import pytest

from tests.procs import Proc
from tests.router.cluster import WAIT_FOR_PROBES, cluster

SECRET = "tenant-secret-1"
OTHER_SECRET = "tenant-secret-2"
TOKEN = "internal-token-xyz"
TPB = "16"


@pytest.fixture(scope="module")
def live():
    """One replica (so a miss cannot be explained by routing to another replica), three
    routers in front of it: two with the same tenant secret, one with another."""
    common = ("--tokens-per-block", TPB, "--internal-token", TOKEN, *WAIT_FOR_PROBES)
    with cluster(1, ("--tokens-per-block", TPB, "--sim-speedup", "20",
                     "--internal-token", TOKEN),
                 (*common, "--tenant-secret", SECRET)) as (router, replicas):
        with contextlib.ExitStack() as stack:
            url = replicas[0].url
            twin = stack.enter_context(Proc("router", "--replicas", url, "--log-level", "warning",
                                            *common, "--tenant-secret", SECRET))
            other = stack.enter_context(Proc("router", "--replicas", url, "--log-level",
                                             "warning", *common, "--tenant-secret",
                                             OTHER_SECRET))
            yield {"router": router, "twin": twin, "other": other, "replica": replicas[0]}


def prompt(tag: str) -> str:
    return f"[{tag}] " + "A long shared system prompt for tenant isolation checks. " * 5


# Each test uses its own API keys: partial reuse is token-granular, so a tenant's earlier
# prompts (even other ones: BOS and a first character) would give small legitimate hits.


def complete(router: Proc, text: str, key: str | None = None, salt: str | None = None,
             auth: str | None = None) -> tuple[int, int]:
    headers = {}
    if auth is not None:
        headers["authorization"] = auth
    elif key is not None:
        headers["authorization"] = f"Bearer {key}"
    body = {"prompt": text, "max_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def derived_salt(secret: str, key: str) -> str:
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()[:32]


def test_same_tenant_reuses_other_tenant_does_not(live):
    ka, kb = "key-a-pair", "key-b-pair"  # fresh tenants for this test
    r, p = live["router"], prompt("pair")
    n, cached = complete(r, p, ka)
    assert cached == 0
    assert complete(r, p, ka) == (n, n - 1)  # A reuses its own prefix
    assert complete(r, p, kb) == (n, 0)  # B, same prompt, same replica: nothing
    assert complete(r, p, ka) == (n, n - 1)  # A's blocks are still there


def test_client_salt_cannot_reach_another_tenant(live):
    ka, kb = "key-a-reach", "key-b-reach"  # fresh tenants for this test
    r, p = live["router"], prompt("reach")
    n, _ = complete(r, p, ka)
    assert complete(r, p, ka)[1] == n - 1
    assert complete(r, p, kb, salt=ka)[1] == 0  # A's key as B's salt
    assert complete(r, p, kb, salt=derived_salt(SECRET, ka))[1] == 0  # A's salt
    assert complete(r, p, kb, auth="Bearer " + kb, salt="")[1] == 0


def test_client_salt_narrows_sharing_within_a_tenant(live):
    ka, kb = "key-a-narrow", "key-b-narrow"  # fresh tenants for this test
    r, p = live["router"], prompt("narrow")
    n, _ = complete(r, p, ka)
    assert complete(r, p, ka)[1] == n - 1
    assert complete(r, p, ka, salt="x")[1] == 0  # not A's unsalted blocks
    assert complete(r, p, ka, salt="x")[1] == n - 1  # but its own "x" blocks
    assert complete(r, p, ka, salt="y")[1] == 0
    assert complete(r, p, kb, salt="x")[1] == 0  # B's "x" is not A's "x"


def test_no_api_key_is_its_own_tenant(live):
    ka = "key-a-anon"  # a fresh tenant for this test
    r, p = live["router"], prompt("anon")
    n, _ = complete(r, p, ka)
    assert complete(r, p, ka)[1] == n - 1
    assert complete(r, p)[1] == 0  # no Authorization at all
    assert complete(r, p)[1] == n - 1  # anonymous clients share among themselves
    assert complete(r, p, auth="Basic a2V5LWE6")[1] == n - 1  # not a bearer: anonymous
    assert complete(r, p, auth="Bearer " + ka)[1] == n - 1


def test_routers_with_the_same_secret_share_tenant_salts(live):
    ka, kb = "key-a-twin", "key-b-twin"  # fresh tenants for this test
    p = prompt("twin")
    n, _ = complete(live["router"], p, ka)
    assert complete(live["twin"], p, ka) == (n, n - 1)
    assert complete(live["twin"], p, kb)[1] == 0
    assert complete(live["other"], p, ka)[1] == 0  # another secret: another tenant


def test_router_never_exposes_salts_or_keys(live):
    ka = "key-a-expose"  # a fresh tenant for this test
    r = live["router"]
    complete(r, prompt("expose"), ka, salt="client-salt-7")
    salt = derived_salt(SECRET, ka)
    texts = [httpx.get(r.url + path).text for path in ("/stats", "/metrics")]
    stats = httpx.get(r.url + "/stats").json()
    assert stats["decisions"] and stats["decisions"][0]["candidates"][0]["reuse"] is not None
    texts.append(r.log())
    for text in texts:
        for secret in (salt, SECRET, ka, "client-salt-7", TOKEN):
            assert secret not in text


def test_replica_probe_requires_internal_token_and_respects_scope(live):
    ka, kb = "key-a-probe", "key-b-probe"  # fresh tenants for this test
    rep, p = live["replica"], prompt("probe")
    n, _ = complete(live["router"], p, ka)
    url = rep.url + "/probe_reuse"
    assert httpx.post(url, json={"prompt": p}).status_code == 401
    bad = httpx.post(url, json={"prompt": p}, headers={"authorization": "Bearer wrong"})
    assert bad.status_code == 401
    assert bad.json()["error"]["type"] == "authentication_error"
    assert httpx.get(rep.url + "/stats").status_code == 401
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(rep.url + "/stats", headers=auth).status_code == 200

    def probe(salt):
        r = httpx.post(url, json={"prompt": p, "cache_salt": salt}, headers=auth)
        assert r.status_code == 200, r.text
        return r.json()["num_tokens"]

    for salt in (None, "", "x", ka, derived_salt(SECRET, kb),
                 derived_salt(OTHER_SECRET, ka)):
        assert probe(salt) == 0, salt
    assert probe(derived_salt(SECRET, ka)) == n - 1  # the tenant's own scope: a hit
