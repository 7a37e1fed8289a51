"""``--backend openai``: other OpenAI-compatible servers, bodies forwarded unchanged."""

import subprocess
import sys

import httpx
import pytest

from tests.procs import Proc
from tests.waiting import until


@pytest.fixture(scope="module")
def fronted():
    with Proc("tests.router.fake_openai", ready_path="/health") as a, \
            Proc("tests.router.fake_openai", ready_path="/health") as b, \
            Proc("router", "--backend", "openai", "--policy", "approx_prefix",
                 "--replicas", f"{a.url},{b.url}", "--backend-api-key", "upstream-key",
                 "--health-interval-s", "0.2", "--kv-pools-interval-s", "0.05",
                 "--log-level", "warning") as router:
        yield router, a, b


def captured(server):
    return httpx.get(server.url + "/captured").json()


def test_body_forwarded_unchanged_without_the_clients_authorization(fronted):
    router, a, b = fronted
    body = {"model": "third-party", "prompt": "hello", "max_tokens": 3, "n": 2,
            "logprobs": 2, "vendor_field": {"x": 1}}
    r = httpx.post(router.url + "/v1/completions", json=body,
                   headers={"authorization": "Bearer client-secret"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    got = (captured(a) + captured(b))[-1]
    assert got["body"] == body  # n, logprobs and unknown fields untouched
    assert got["headers"]["authorization"] == "Bearer upstream-key"
    assert "client-secret" not in str(got["headers"])


def seen(server) -> list[str]:
    return httpx.get(server.url + "/seen").json()


def test_no_kv_pools_are_asked_of_other_servers(fronted):
    """Other servers have no /stats of ours: /stats shows no pools, and none is asked for
    (the pools' first round would run at start-up, before the health loop's first check)."""
    router, a, b = fronted
    start = {s.url: seen(s).count("GET /health") for s in (a, b)}
    until(lambda: all(seen(s).count("GET /health") >= start[s.url] + 2 for s in (a, b)),
          "two more health checks of each server (the health loop runs)", tries=400,
          every=0.05)
    for server in (a, b):
        assert "GET /stats" not in seen(server)
    shown = httpx.get(router.url + "/stats").json()["replicas"]
    assert [(r["url"], r["kv_pools"], r["kv_pools_age_s"]) for r in shown] == [
        (a.url, None, None), (b.url, None, None)]


def test_streaming_passes_through(fronted):
    router, _, _ = fronted
    with httpx.stream("POST", router.url + "/v1/completions",
                      json={"model": "third-party", "prompt": "s", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 3


def test_approx_prefix_keeps_a_long_prefix_on_one_server(fronted):
    router, a, b = fronted
    prefix = "shared system prompt " * 40
    replicas = {httpx.post(router.url + "/v1/completions",
                           json={"model": "third-party", "prompt": prefix + f"q{i}"}
                           ).headers["x-replica"] for i in range(6)}
    assert len(replicas) == 1


@pytest.mark.parametrize("args, message", [
    (["--backend", "openai", "--policy", "prefix"], "cannot answer; use approx_prefix"),
    (["--policy", "fastest"], "unknown policy 'fastest'; choose one of prefix, approx_prefix"),
    (["--replicas", "127.0.0.1:9001"], "must start with http:// or https://"),
])
def test_bad_command_lines_exit_2_with_a_reason(args, message):
    out = subprocess.run([sys.executable, "-m", "router", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr
