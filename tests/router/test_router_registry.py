"""Admission checks, model groups, admin endpoints."""

import httpx

from tests.procs import Proc

from .cluster import cluster


def stats(router):
    return {r["url"]: r for r in httpx.get(router.url + "/stats").json()["replicas"]}


def test_mismatched_block_size_is_refused_with_a_clear_message():
    with cluster(2, (), ("--tokens-per-block", "32"),
                 per_replica_args={1: ("--tokens-per-block", "16")}) as (router, reps):
        s = stats(router)
        assert s[reps[0].url]["health"] == "healthy"
        refused = s[reps[1].url]
        assert refused["health"] == "refused"
        assert "tokens_per_block 16 differs from the router's 32" in refused["problem"]
        for i in range(4):
            r = httpx.post(router.url + "/v1/completions", json={"prompt": f"{i}",
                                                                  "max_tokens": 1})
            assert r.headers["x-replica"] == reps[0].url


def test_requests_go_only_to_replicas_of_their_model():
    with cluster(3, (), (), per_replica_args={0: ("--served-model-name", "alpha"), 1: ("--served-model-name", "alpha"),
                                              2: ("--served-model-name", "beta")}) as (router, reps):
        models = httpx.get(router.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["alpha", "beta"]
        for i in range(6):
            r = httpx.post(router.url + "/v1/completions",
                           json={"model": "beta", "prompt": f"b{i}", "max_tokens": 1})
            assert r.headers["x-replica"] == reps[2].url
            r = httpx.post(router.url + "/v1/completions",
                           json={"model": "alpha", "prompt": f"a{i}", "max_tokens": 1})
            assert r.headers["x-replica"] in (reps[0].url, reps[1].url)
        r = httpx.post(router.url + "/v1/completions", json={"model": "gamma", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_admin_endpoints_add_drain_remove():
    with cluster(1, (), ("--admin-token", "adm")) as (router, reps), \
            Proc("replicas", "--engine", "sim", "--log-level", "warning") as extra, \
            Proc("replicas", "--engine", "sim", "--tokens-per-block", "8",
                 "--log-level", "warning") as wrong:
        auth = {"authorization": "Bearer adm"}
        url = router.url + "/admin/replicas"
        assert httpx.post(url, json={"url": extra.url}).status_code == 401
        r = httpx.post(url, json={"url": wrong.url}, headers=auth)
        assert r.status_code == 400 and "tokens_per_block 8 differs" in r.json()["error"]["message"]
        r = httpx.post(url, json={"url": extra.url}, headers=auth)
        assert r.status_code == 200 and r.json()["model"] == "sim-byte-lm"
        assert httpx.post(url, json={"url": extra.url}, headers=auth).status_code == 409
        assert set(stats(router)) == {reps[0].url, extra.url}
        r = httpx.post(url + "/drain", json={"url": reps[0].url}, headers=auth)
        assert r.status_code == 200
        for i in range(4):
            r = httpx.post(router.url + "/v1/completions", json={"prompt": f"{i}",
                                                                  "max_tokens": 1})
            assert r.headers["x-replica"] == extra.url
        r = httpx.request("DELETE", url, json={"url": reps[0].url}, headers=auth)
        assert r.status_code == 200 and set(stats(router)) == {extra.url}
        assert httpx.request("DELETE", url, json={"url": "http://nope:1"},
                             headers=auth).status_code == 404


def test_admin_endpoints_are_off_without_a_token():
    with cluster(1) as (router, reps):
        r = httpx.post(router.url + "/admin/replicas", json={"url": reps[0].url})
        assert r.status_code == 404


def test_no_eligible_replica_is_503_with_retry_after():
    with Proc("router", "--replicas", "http://127.0.0.1:9", "--log-level", "warning",
              ready_path="/health") as router:
        assert httpx.get(router.url + "/ready").status_code == 503
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_replica"
