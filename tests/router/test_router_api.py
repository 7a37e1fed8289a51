"""The router in front of live sim replicas, through the official openai client."""

import json

import httpx
import openai
import pytest

from tests.procs import Proc

from .cluster import cluster
from .relay import RecordingRelay

SYSTEM = "You route requests to the replica that answers first. " * 6


@pytest.fixture(scope="module")
def live():
    with cluster(2, ("--tokens-per-block", "16", "--sim-speedup", "20"),
                 ("--tokens-per-block", "16", "--seed", "1")) as (router, replicas):
        yield router, replicas


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[0].url + "/v1", api_key="client-key", max_retries=0)


def test_models_union_and_readiness(live, client):
    assert [m.id for m in client.models.list().data] == ["sim-byte-lm"]
    assert httpx.get(live[0].url + "/ready").status_code == 200


def test_completions_through_the_router_reuse_on_the_same_replica(live, client):
    urls = {r.url for r in live[1]}
    raw = client.completions.with_raw_response.create(
        model="sim-byte-lm", prompt=SYSTEM + "first?", max_tokens=4)
    first = raw.parse()
    assert raw.headers["x-replica"] in urls
    again = client.completions.with_raw_response.create(
        model="sim-byte-lm", prompt=SYSTEM + "first?", max_tokens=4)
    assert again.headers["x-replica"] == raw.headers["x-replica"]
    usage = again.parse().usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert first.usage.completion_tokens == 4 and len(first.choices[0].text) == 4


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="sim-byte-lm", messages=messages, max_tokens=5)
    assert whole.object == "chat.completion" and len(whole.choices[0].message.content) == 5
    assert whole.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="sim-byte-lm", messages=messages,
                                                 max_tokens=5, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) != ""
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # usage only when asked for
    with_usage = list(client.chat.completions.create(
        model="sim-byte-lm", messages=messages, max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert with_usage[-1].usage.completion_tokens == 5
    assert with_usage[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_streaming_completions(client):
    chunks = list(client.completions.create(model="sim-byte-lm", prompt="stream", max_tokens=6,
                                            stream=True))
    assert len("".join(c.choices[0].text for c in chunks)) == 6


def test_request_id_travels(live):
    r = httpx.post(live[0].url + "/v1/completions", json={"prompt": "id", "max_tokens": 1},
                   headers={"x-request-id": "req-123"})
    assert r.headers["x-request-id"] == "req-123"
    assert r.json()["id"] == "cmpl-req-123"  # the replica saw the same id


def test_one_decision_log_line_per_routed_request_carries_its_id():
    with cluster(2, router_args=("--log-level", "info")) as (router, replicas):
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "log", "max_tokens": 1},
                       headers={"x-request-id": "req-logged"})
        assert r.status_code == 200
        lines = [line.split(" INFO router.decisions ", 1)[1]
                 for line in router.log().splitlines() if " INFO router.decisions " in line]
    mine = [entry for entry in map(json.loads, lines) if entry["request_id"] == "req-logged"]
    assert len(mine) == 1
    entry = mine[0]
    assert (entry["event"], entry["chosen"]) == ("route", r.headers["x-replica"])
    assert entry["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] == 4  # BOS + 3 bytes
    assert entry["reason"].startswith("lowest expected TTFT") and entry["probe_ms"] >= 0
    assert sorted(c["replica"] for c in entry["candidates"]) == sorted(x.url for x in replicas)
    assert all(c["reuse"] is not None and c["note"] == "" for c in entry["candidates"])


@pytest.mark.parametrize("body, status, fragment", [
    ({"prompt": "x", "max_tokens": 0}, 400, "greater than or equal to 1"),
    ({"prompt": "x", "model": "other"}, 404, "not served here"),
    ({"prompt": [1, 999]}, 400, "outside the vocabulary"),
    ({"prompt": "x", "n": 3}, 400, "only n=1"),
    ({"max_tokens": 3}, 400, "prompt is required"),
    ({"prompt": "x" * 40000, "max_tokens": 1}, 400, "maximum context length"),
    ({"prompt": "a\ud800b"}, 400, "prompt: text has an unpaired surrogate U+D800"),
])
def test_bad_input_gets_openai_errors(live, body, status, fragment):
    # json.dumps escapes what is not ASCII (httpx's json= cannot send an unpaired surrogate)
    r = httpx.post(live[0].url + "/v1/completions", content=json.dumps(body).encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert r.headers["x-should-retry"] == "false"


def test_malformed_json(live):
    r = httpx.post(live[0].url + "/v1/chat/completions", content=b"{oops",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_stats_and_metrics_name_replicas_as_configured(live, client):
    client.completions.create(model="sim-byte-lm", prompt=SYSTEM + "stats", max_tokens=2)
    stats = httpx.get(live[0].url + "/stats").json()
    urls = [r.url for r in live[1]]
    assert [r["url"] for r in stats["replicas"]] == urls
    assert stats["totals"]["requests"] >= 1
    d = stats["decisions"][0]
    assert d["chosen"] in urls and {c["replica"] for c in d["candidates"]} == set(urls)
    assert all(c["reuse"] is not None and c["note"] == "" for c in d["candidates"])
    metrics = httpx.get(live[0].url + "/metrics").text
    assert "router_probe_failures_total{" not in metrics  # no probe has failed
    assert "router_probe_latency_seconds_count{" in metrics
    for url in urls:
        assert f'router_replica_healthy{{replica="{url}"}} 1.0' in metrics
    assert "router_overhead_seconds_count" in metrics


def test_internal_fields_from_clients_are_ignored(live):
    r = httpx.post(live[0].url + "/v1/completions", json={
        "prompt": "abc", "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 1})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == 4  # BOS + "abc": the router tokenized


def test_unknown_fields_pass_through():
    """What the replica receives keeps the client's unknown fields, as sent, next to the
    fields the router sets (the token ids in place of the prompt)."""
    with Proc("replicas", "--engine", "sim", "--log-level", "warning") as replica:
        relay = RecordingRelay(replica.port)
        try:
            with Proc("router", "--replicas", relay.url, "--log-level", "warning") as router:
                vendor = {"x": [1, {"y": None}], "s": "\u00e9"}
                r = httpx.post(router.url + "/v1/completions", json={
                    "prompt": "abc", "max_tokens": 1, "ignore_eos": True, "vendor": vendor})
                assert r.status_code == 200, r.text
        finally:
            relay.close()
    [got] = relay.bodies(b"/v1/completions")
    assert (got.get("vendor"), got.get("ignore_eos")) == (vendor, True)
    assert "prompt" not in got and got["prompt_token_ids_b64"]  # the router tokenized
    assert (got["max_tokens"], got["stream"]) == (1, True)


@pytest.mark.parametrize("path", ["/v1/chat%2Fcompletions", "/v1%2Fcompletions"])
def test_an_encoded_slash_is_another_path_not_the_endpoint(live, path):
    """Raw bytes over a socket (a client library would normalise the path): the router's
    native routes match the raw path, its app the decoded one, where the proxy endpoints
    are only documented; the encoded form is no route (it was a 500)."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(live[0].url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 2\r\nConnection: close\r\n\r\n{{}}".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 404 Not Found"
    assert json.loads(body)["error"]["code"] == "not_found"
