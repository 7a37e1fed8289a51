"""A replica serving a Hugging Face tokenizer (``--tokenizer DIR`` over the sim engine's
timing; the engine here answers a script of token ids): chat prompts are exactly
transformers' ``apply_chat_template`` ids, generation stops at the model's eos ids and at
``stop`` strings (finish_reason "stop"), template refusals are 400s, and ``GET /tokenizer``
hands out what builds the same tokenizer."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from replicas.app import create_app
from replicas.engines import SimEngine, SimTiming, text_alphabet
from replicas.engines.sim import CHARACTERS
from replicas.service import ReplicaService
from replicas.settings import ReplicaSettings, load_settings
from text import HFTokenizer, tokenizer_from_wire
from text import ByteTokenizer

from . import hf_checkpoints as ckpt

transformers = pytest.importorskip("transformers")

REPLY = "Hello \u65e5\u672c\u8a9e\U0001F600 world. More text after."


class Scripted(SimEngine):
    """The sim engine (no sleeping) answering ``script`` token by token, then letters."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(SimTiming(step_overhead_s=0, per_seq_prefill_s=0, decode_per_seq_s=0,
                                   prefill_tokens_per_s=1e12))
        self.script = script

    async def step(self, items):
        out = []
        for it in items:
            if it.sample is None:
                out.append(None)
                continue
            n = it.state.get("n", 0)
            it.state["n"] = n + 1
            out.append(self.script[n] if n < len(self.script) else ord("a"))
        return out


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    path = ckpt.llama3(tmp_path_factory.mktemp("ckpt") / "tiny-llama3")
    return path, HFTokenizer.from_path(path), transformers.AutoTokenizer.from_pretrained(str(path))


def client_for(path, script: list[int]) -> TestClient:
    settings = ReplicaSettings(tokenizer=str(path), kv_pages=64, tokens_per_block=16)
    service = ReplicaService(settings, engine=Scripted(script))
    return TestClient(create_app(settings, service))


MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Say hello in "},
                                         {"type": "text", "text": "\u65e5\u672c\u8a9e"}]}]


def test_chat_prompt_is_apply_chat_template_and_eos_stops(llama3):
    path, ours, theirs = llama3
    eot = theirs.convert_tokens_to_ids("<|eot_id|>")
    reply_ids = ours._encode(REPLY, add_special_tokens=False)
    want = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    with client_for(path, reply_ids + [eot, 5, 6]) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "sim-tiny-llama3"
        probe = client.post("/probe_reuse", json={"messages": MESSAGES}).json()
        assert probe["num_prompt_tokens"] == len(want)
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 100})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == REPLY
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["prompt_tokens"] == len(want)
        assert body["usage"]["completion_tokens"] == len(reply_ids) + 1  # the eos counts
        # the same ids, sent as the router sends them, give the same usage
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES,
                                                      "prompt_token_ids": want})
        assert r.json()["usage"]["prompt_tokens"] == len(want)


def test_the_other_eos_id_of_generation_config_stops_a_stream(llama3):
    path, ours, theirs = llama3
    end = theirs.convert_tokens_to_ids("<|end_of_text|>")
    reply_ids = ours._encode(REPLY, add_special_tokens=False)
    with client_for(path, reply_ids + [end]) as client:
        with client.stream("POST", "/v1/chat/completions",
                           json={"messages": MESSAGES, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events]
    assert "".join(deltas) == REPLY
    assert all("\ufffd" not in d for d in deltas)
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_completion(llama3, stream):
    path, ours, _ = llama3
    reply_ids = ours._encode(REPLY, add_special_tokens=False)
    with client_for(path, reply_ids) as client:
        body = {"prompt": "Say hello", "max_tokens": 200, "stop": ["world."], "stream": stream}
        if not stream:
            r = client.post("/v1/completions", json=body).json()
            text, finish = r["choices"][0]["text"], r["choices"][0]["finish_reason"]
            assert r["usage"]["prompt_tokens"] == len(ours.encode("Say hello"))
        else:
            with client.stream("POST", "/v1/completions", json=body) as resp:
                events = [json.loads(line[6:]) for line in resp.iter_lines()
                          if line.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events)
            finish = events[-1]["choices"][0]["finish_reason"]
    assert (text, finish) == ("Hello \u65e5\u672c\u8a9e\U0001F600 ", "stop")


def test_completion_prompt_ids_are_transformers_encode(llama3):
    path, _, theirs = llama3
    with client_for(path, []) as client:
        probe = client.post("/probe_reuse", json={"prompt": "Caf\u00e9 \U0001F680"}).json()
    assert probe["num_prompt_tokens"] == len(theirs.encode("Caf\u00e9 \U0001F680"))


def test_template_refusals_and_unsupported_content_are_400s(tmp_path):
    path = ckpt.mistral(tmp_path / "mistral")
    with client_for(path, []) as client:
        r = client.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "the chat template refused the messages: Conversation roles must "
                       "alternate user/assistant/user/...",
            "type": "invalid_request_error", "param": "messages", "code": None}
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
        assert r.status_code == 400
        assert "content parts of type 'image_url' are not supported" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]})
        assert r.status_code == 400
        assert "tools are not supported" in r.json()["error"]["message"]
        r = client.post("/probe_reuse", json={"messages": [{"role": "system", "content": "a"}]})
        assert r.status_code == 400


def test_get_tokenizer_builds_the_same_tokenizer(llama3, tmp_path):
    path, ours, _ = llama3
    with client_for(path, []) as client:
        wire = client.get("/tokenizer").json()
        card = client.get("/v1/models").json()["data"][0]
    assert wire["kind"] == "hf"
    assert wire["fingerprint"] == card["tokenizer_fingerprint"] == ours.fingerprint
    assert tokenizer_from_wire(wire).fingerprint == ours.fingerprint
    assert wire["tokenizer_json"] == (path / "tokenizer.json").read_text()
    with TestClient(create_app(ReplicaSettings())) as client:
        assert client.get("/tokenizer").json() == {
            "kind": "byte-level", "fingerprint": client.get("/v1/models").json()[
                "data"][0]["tokenizer_fingerprint"], "tokenizer_json": None,
            "tokenizer_config": None, "generation_config": None, "chat_template": None}


def test_settings_refuse_a_tokenizer_for_a_seeded_preset(tmp_path):
    with pytest.raises(ValueError, match="the presets have the byte-level vocabulary"):
        load_settings({"engine": "torch", "tokenizer": str(tmp_path)})
    assert load_settings({"tokenizer": str(tmp_path)}).tokenizer == str(tmp_path)


def test_the_model_id_is_the_checkpoint_directorys_name(tmp_path):
    from replicas.service import _default_model_id
    assert _default_model_id(ReplicaSettings(engine="torch", model="/m/Qwen3-8B/"),
                             "torch") == "Qwen3-8B"
    assert _default_model_id(ReplicaSettings(tokenizer=str(tmp_path / "tok")), "sim") == "sim-tok"
    assert _default_model_id(ReplicaSettings(), "sim") == "sim-byte-lm"


def test_render_gives_transformers_ids_as_vllm_answers_them(llama3):
    """``/v1/chat/completions/render`` and ``/v1/completions/render`` (vLLM's render API, what
    vLLM's router tokenizes through): the prompt ids are transformers' own."""
    path, _, theirs = llama3
    want_chat = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    with client_for(path, [5]) as client:
        chat = client.post("/v1/chat/completions/render",
                           json={"messages": MESSAGES, "max_tokens": 7, "seed": 3})
        completion = client.post("/v1/completions/render",
                                 json={"prompt": REPLY, "stream": True, "stop": ["."]})
    assert (chat.status_code, completion.status_code) == (200, 200), (chat.text,
                                                                      completion.text)
    rendered = chat.json()
    assert rendered["token_ids"] == want_chat
    assert rendered["sampling_params"] == {"max_tokens": 7, "temperature": 1.0, "top_p": 1.0,
                                           "seed": 3, "stop": []}
    (one,) = completion.json()
    assert one["token_ids"] == theirs(REPLY)["input_ids"]  # with the bos, as transformers
    assert (one["stream"], one["sampling_params"]["stop"], one["model"]) == (
        True, ["."], "sim-tiny-llama3")


def test_the_sim_engine_writes_text_in_the_replicas_tokenizer(llama3):
    """Over a Hugging Face tokenizer the sim engine samples the ids of a-z and space in that
    vocabulary (byte ids there are other tokens: lone high bytes, held back as incomplete
    UTF-8), so a stream has one content chunk per token and the text is those letters."""
    path, ours, theirs = llama3
    alphabet = text_alphabet(ours)
    assert [theirs.decode([i]) for i in alphabet] == list(CHARACTERS)
    assert text_alphabet(ByteTokenizer()) == [ord(c) for c in CHARACTERS]
    settings = ReplicaSettings(tokenizer=str(path), kv_pages=64, tokens_per_block=16,
                               sim_speedup=100)
    with TestClient(create_app(settings)) as client:
        whole = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 24,
                                                     "seed": 5}).json()
        stream = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 24,
                                                      "seed": 5, "stream": True}).text
    text = whole["choices"][0]["text"]
    assert len(text) == 24 and set(text) <= set(CHARACTERS)
    assert whole["usage"]["completion_tokens"] == 24
    pieces = [json.loads(line[6:])["choices"][0]["text"] for line in stream.splitlines()
              if line.startswith("data: {")]
    assert "".join(pieces) == text and sum(1 for p in pieces if p) == 24
