"""The router tokenizes as a Hugging Face replica does: with ``--tokenizer DIR`` and, without
it, with the tokenizer it loads from the replica (``GET /tokenizer``). The ids the replica
gets for a chat are transformers' ``apply_chat_template`` ids: after the request the
replica's cache holds exactly those (a probe of them reuses all but the last token), and
``usage.prompt_tokens`` counts them. A replica with another tokenizer is refused at
admission. Real processes on loopback: sim replicas with ``--tokenizer``."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama with the llama3-style tokenizer files in its directory, and the
    greedy continuation transformers generates for ``CHAT``: ``generated`` (16 tokens, no
    eos) and an id of it, ``stop_at``, that generation_config.json then names as eos."""
    torch = pytest.importorskip("torch")
    from tests.replicas.models.checkpoints import hf_config
    directory = tmp_path_factory.mktemp("ckpt") / "tiny-llama3"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config("llama", vocab_size=400)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    ckpt.llama3(directory)  # tokenizer.json, tokenizer_config.json, generation_config.json
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    prompt = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    generated = out[0, len(prompt):].tolist()
    stop_at = next(k for k in range(4, 16) if generated[k] not in generated[:k])
    generation = json.loads((directory / "generation_config.json").read_text())
    generation["eos_token_id"] = [generated[stop_at]]
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory, theirs, prompt, generated, stop_at


CHAT = [{"role": "system", "content": "Tiny model."},
        {"role": "user", "content": "Write something, caf\u00e9 \U0001F600"}]


def test_a_checkpoint_replica_through_the_router_stops_at_its_eos(checkpoint):
    """``--engine torch --model DIR``: the router loads the checkpoint's tokenizer from the
    replica, the prompt is apply_chat_template's, and greedy decoding ends where
    transformers' ``generate`` ends with generation_config's eos id: the same text,
    finish_reason "stop"."""
    directory, theirs, prompt, generated, stop_at = checkpoint
    want_text = theirs.decode(generated[:stop_at], skip_special_tokens=True)
    with Proc("replicas", "--engine", "torch", "--model", str(directory), "--kv-pages", "64",
              "--tokens-per-block", "8", "--log-level", "warning") as replica, \
            Proc("router", "--replicas", replica.url, "--tokens-per-block", "8",
                 "--log-level", "warning") as router:
        card = httpx.get(replica.url + "/v1/models").json()["data"][0]
        assert card["id"] == "tiny-llama3"
        r = httpx.post(router.url + "/v1/chat/completions",
                       json={"model": "tiny-llama3", "messages": CHAT, "temperature": 0,
                             "max_tokens": 16}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["usage"]["completion_tokens"] == stop_at + 1  # with the eos
        assert body["choices"][0] == {"index": 0, "finish_reason": "stop", "logprobs": None,
                                      "message": {"role": "assistant", "content": want_text}}
        assert httpx.post(replica.url + "/probe_reuse", json={"token_ids": prompt}).json()[
            "num_tokens"] == len(prompt) - 1
