"""The SGLang model gateway (a peer router, installed in .peers/) in front of sim replicas.

The first run installs sglang-router into .peers/sglang (about 15-20 s with PyPI reachable).
"""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from loadtest import peers
from loadtest.peers import PeerInstallError, SGLangRouter, ensure_sglang_router
from loadtest.processes import ServerProcess

SYSTEM = "You are a careful assistant. " * 8  # 232 characters


@pytest.fixture(scope="module")
def sglang_router_exe():
    return ensure_sglang_router()


@pytest.fixture(scope="module")
def replicas():
    with ServerProcess("replicas", "--engine", "sim") as a, \
            ServerProcess("replicas", "--engine", "sim") as b:
        yield [a, b]


@pytest.fixture(scope="module")
def gateway(sglang_router_exe, replicas):
    with SGLangRouter([r.url for r in replicas], policy="cache_aware",
                      executable=sglang_router_exe) as gw:
        yield gw


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=30.0, trust_env=False) as c:
        yield c


def sse_events(client: httpx.Client, url: str, body: dict) -> list[dict]:
    """POST a streaming request; return the JSON events, checking the stream ends in [DONE]."""
    datas = []
    with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                datas.append(line[len("data: "):])
    assert datas and datas[-1] == "[DONE]", datas[-3:]
    return [json.loads(d) for d in datas[:-1]]


def check_usage(usage: dict, completion_tokens: int) -> None:
    assert usage["completion_tokens"] == completion_tokens
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def requests_served(replica: ServerProcess) -> int:
    text = httpx.get(replica.url + "/metrics", trust_env=False).text
    m = re.search(r"^replica_e2e_request_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    return int(float(m.group(1)))


def test_gateway_ready_with_both_replicas(gateway, replicas, client):
    assert gateway.model == "sim-byte-lm"  # read from a replica's /v1/models
    ready = client.get(gateway.url + "/readiness").json()
    assert ready == {"status": "ready", "healthy_workers": 2, "total_workers": 2}
    urls = sorted(w["url"] for w in gateway.workers()["workers"])
    assert urls == sorted(r.url for r in replicas)


def test_completion(gateway, client):
    r = client.post(gateway.url + "/v1/completions",
                    json={"model": gateway.model, "prompt": SYSTEM + "Q1?", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == gateway.model
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and len(choice["text"]) == 5
    assert choice["finish_reason"] == "length"
    check_usage(body["usage"], 5)


def test_completion_streaming(gateway, client):
    events = sse_events(client, gateway.url + "/v1/completions",
                        {"model": gateway.model, "prompt": SYSTEM + "Q2?", "max_tokens": 4,
                         "stream": True, "stream_options": {"include_usage": True}})
    assert {e["object"] for e in events} == {"text_completion"}
    assert len({e["id"] for e in events}) == 1
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert len(text) == 4
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert events[-1]["choices"] == []
    check_usage(events[-1]["usage"], 4)


def test_chat(gateway, client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    r = client.post(gateway.url + "/v1/chat/completions",
                    json={"model": gateway.model, "messages": messages, "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"]) == 6
    assert choice["finish_reason"] == "length"
    check_usage(body["usage"], 6)


def test_chat_streaming(gateway, client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    events = sse_events(client, gateway.url + "/v1/chat/completions",
                        {"model": gateway.model, "messages": messages, "max_tokens": 3,
                         "stream": True, "stream_options": {"include_usage": True}})
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert len("".join(d.get("content") or "" for d in deltas)) == 3
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    check_usage(events[-1]["usage"], 3)


def test_cache_aware_keeps_a_prefix_on_one_replica(gateway, client):
    prompt = "Shared document. " * 40 + "Question?"
    usages = []
    for _ in range(3):
        r = client.post(gateway.url + "/v1/completions",
                        json={"model": gateway.model, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    # Repeats go where the prefix went, so the replica reuses all but the last prompt token.
    for u in usages[1:]:
        assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] - 1
    # SGLang's gateway counts no prefix-routing outcomes (vLLM's router does): none to report
    assert gateway.prefix_decisions() == {}


def test_round_robin_uses_both_replicas(sglang_router_exe, replicas, client):
    before = [requests_served(r) for r in replicas]
    with SGLangRouter([r.url for r in replicas], policy="round_robin",
                      executable=sglang_router_exe) as gw:
        for i in range(4):
            r = client.post(gw.url + "/v1/completions",
                            json={"model": gw.model, "prompt": f"rr {i}", "max_tokens": 1})
            assert r.status_code == 200, r.text
    served = [requests_served(r) - b for r, b in zip(replicas, before)]
    assert min(served) >= 2 and sum(served) == 5, served  # + the readiness check's request
    assert gw.proc.returncode is not None


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        SGLangRouter(["http://127.0.0.1:9"], policy="prefix_magic")


def test_install_is_fast_once_done(sglang_router_exe, monkeypatch):
    """Once installed, a call runs nothing and waits for no lock: it reads the marker."""
    def refuse(what: str):
        def called(*args, **kwargs):
            raise AssertionError(f"{what} although sglang-router is installed: {args[:1]}")
        return called
    monkeypatch.setattr(peers, "_run", refuse("ran a command"))
    monkeypatch.setattr(peers.subprocess, "run", refuse("ran a command"))
    monkeypatch.setattr(peers.fcntl, "flock", refuse("took the install lock"))
    assert ensure_sglang_router() == sglang_router_exe


def test_install_failure_is_reported(tmp_path, monkeypatch):
    # No index and an empty find-links folder: pip finds nothing, as when offline.
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    with pytest.raises(PeerInstallError, match=r"pip install sglang-router==0\.3\.2") as err:
        ensure_sglang_router(venv_dir=tmp_path / "venv")
    assert "No matching distribution" in str(err.value) and "hint:" in str(err.value)
    assert not (tmp_path / "venv" / ".installed").exists()
