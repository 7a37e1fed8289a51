"""The router tokenizes as a Hugging Face replica does: with ``--tokenizer DIR`` and, without
it, with the tokenizer it loads from the replica (``GET /tokenizer``). The ids the replica
gets for a chat are transformers' ``apply_chat_template`` ids: after the request the
replica's cache holds exactly those (a probe of them reuses all but the last token), and
``usage.prompt_tokens`` counts them. A replica with another tokenizer is refused at
admission. Real processes on loopback: sim replicas with ``--tokenizer``."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.procs import Proc
from tests.replicas import hf_checkpoints as ckpt

transformers = pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "You answer in one word. \u65e5\u672c\u8a9e ok."}


def conversation(tag: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": f"Question {tag}: caf\u00e9 \U0001F600?"},
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": [{"type": "text", "text": f"and {tag} "},
                                         {"type": "text", "text": "again"}]}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {"llama3": ckpt.llama3(root / "llama3"), "chatml": ckpt.chatml(root / "chatml")}


@pytest.fixture(scope="module")
def replica(dirs):
    with Proc("replicas", "--engine", "sim", "--tokenizer", str(dirs["llama3"]),
              "--tokens-per-block", "8", "--sim-speedup", "50", "--log-level", "warning") as r:
        yield r


def replica_reuse(replica, ids: list[int], salt: str) -> int:
    return httpx.post(replica.url + "/probe_reuse",
                      json={"token_ids": ids, "cache_salt": salt}).json()["num_tokens"]


@pytest.mark.parametrize("given", [True, False], ids=["--tokenizer", "from the replica"])
def test_chat_ids_reaching_the_replica_are_apply_chat_templates(dirs, replica, given):
    theirs = transformers.AutoTokenizer.from_pretrained(str(dirs["llama3"]))
    args = ("--tokenizer", str(dirs["llama3"])) if given else ()
    tag = "given" if given else "fetched"
    messages = conversation(tag)
    want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    assert replica_reuse(replica, want, tag) == 0  # nothing cached yet in this scope
    with Proc("router", "--replicas", replica.url, "--tokens-per-block", "8",
              "--log-level", "warning", *args) as router:
        r = httpx.post(router.url + "/v1/chat/completions",
                       json={"messages": messages, "max_tokens": 3, "model": "sim-llama3",
                             "cache_salt": tag})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        # all but the last prompt token, exactly: those ids, and no others, were sent
        assert replica_reuse(replica, want, tag) == len(want) - 1
        assert replica_reuse(replica, want[:-2] + [want[-2] + 1, want[-1]], tag) == len(want) - 2
        # a completion prompt: transformers' encode (BOS from tokenizer.json's processor)
        text = f"Complete this {tag}: caf\u00e9 \U0001F680"
        ids = theirs.encode(text)
        r = httpx.post(router.url + "/v1/completions", json={"prompt": text, "max_tokens": 2,
                                                              "cache_salt": tag})
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert replica_reuse(replica, ids, tag) == len(ids) - 1
        # the template's refusal reaches the client as the replica would give it
        r = httpx.post(router.url + "/v1/chat/completions", json={"messages": [
            {"role": "user", "content": [{"type": "input_audio"}]}]})
        assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]


def refused_problem(router, url: str, deadline_s: float = 30.0) -> str:
    """The router's reason for refusing ``url`` (polling /stats until it has decided)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        rows = {r["url"]: r for r in httpx.get(router.url + "/stats").json()["replicas"]}
        if rows[url]["health"] == "refused":
            return rows[url]["problem"]
        time.sleep(0.1)
    raise AssertionError(f"{url} not refused: {rows[url]}")


def test_a_replica_with_another_tokenizer_is_refused_at_admission(dirs, replica):
    with Proc("replicas", "--engine", "sim", "--tokenizer", str(dirs["chatml"]),
              "--tokens-per-block", "8", "--log-level", "warning") as other, \
            Proc("replicas", "--engine", "sim", "--tokens-per-block", "8",
                 "--log-level", "warning") as byte_level:
        # --tokenizer: a replica with another one is refused, the matching one admitted
        with Proc("router", "--replicas", f"{other.url},{replica.url}", "--tokenizer",
                  str(dirs["llama3"]), "--tokens-per-block", "8",
                  "--log-level", "warning") as router:
            assert "tokenizer fingerprint" in refused_problem(router, other.url)
            r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.headers["x-replica"] == replica.url
        # without it: the first replica's tokenizer is the router's; the byte-level one
        # after it would read ids differently
        with Proc("router", "--replicas", f"{other.url},{byte_level.url}",
                  "--tokens-per-block", "8", "--log-level", "warning") as router:
            assert "would read token ids differently" in refused_problem(router, byte_level.url)
            r = httpx.post(router.url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 1})
            assert r.status_code == 200 and r.headers["x-replica"] == other.url


def test_a_tokenizer_that_does_not_load_stops_the_router_at_start(tmp_path):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "router", "--replicas", "http://127.0.0.1:9",
                          "--tokenizer", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert f"{tmp_path / 'tokenizer.json'} not found" in out.stderr
