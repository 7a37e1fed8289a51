"""The official openai client against a live replica process."""

import base64
import struct

import httpx
import openai
import pytest

SYSTEM = "You are a careful assistant. " * 8  # 232 characters: several 16-token blocks


@pytest.fixture(scope="module")
def client(replica):
    return openai.OpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_lists_fingerprint_and_block_size(replica):
    card = httpx.get(replica.url + "/v1/models").json()["data"][0]
    assert card["id"] == "sim-byte-lm"
    assert card["tokens_per_block"] == 16 and card["probe_reuse"] is True
    assert len(card["tokenizer_fingerprint"]) == 16


def test_completion_and_cached_tokens_per_salt(client, model):
    prompt = SYSTEM + "Question one?"
    first = client.completions.create(model=model, prompt=prompt, max_tokens=5,
                                      extra_body={"cache_salt": "s1"})
    assert first.choices[0].finish_reason == "length"
    assert len(first.choices[0].text) == 5
    assert first.usage.completion_tokens == 5
    assert first.usage.prompt_tokens == len(prompt.encode()) + 1  # + BOS
    again = client.completions.create(model=model, prompt=prompt, max_tokens=5,
                                      extra_body={"cache_salt": "s1"})
    # Everything but the last prompt token is reusable: the engine needs its logits.
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    other = client.completions.create(model=model, prompt=prompt, max_tokens=5,
                                      extra_body={"cache_salt": "s2"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_seeded_requests_repeat(client, model):
    a = client.completions.create(model=model, prompt="seeded", max_tokens=12, seed=7)
    b = client.completions.create(model=model, prompt="seeded", max_tokens=12, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_chat_streaming_and_not(client, model):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                           extra_body={"cache_salt": "chat"})
    assert whole.choices[0].message.role == "assistant"
    assert len(whole.choices[0].message.content) == 6
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"cache_salt": "chat"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_completion_streaming(client, model):
    chunks = list(client.completions.create(model=model, prompt="stream me", max_tokens=4,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) != ""
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_answer(client, model):
    # The sim engine writes lowercase letters and spaces; a space is a likely stop.
    out = client.completions.create(model=model, prompt="x", max_tokens=200, stop=[" "], seed=3)
    assert " " not in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 200


def _probe(url, **body):
    r = httpx.post(url + "/probe_reuse", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_probe_predicts_cached_tokens_for_every_input_form(replica, client, model):
    prompt = SYSTEM + "probe me"
    ids = [256] + list(prompt.encode())
    b64 = base64.b64encode(struct.pack(f"<{len(ids)}I", *ids)).decode()
    forms = [dict(prompt=prompt), dict(token_ids=ids), dict(token_ids_b64=b64)]
    before = [_probe(replica.url, cache_salt="probe", **f) for f in forms]
    assert {p["num_tokens"] for p in before} == {0}
    client.completions.create(model=model, prompt=prompt, max_tokens=2,
                              extra_body={"cache_salt": "probe"})
    after = [_probe(replica.url, cache_salt="probe", **f) for f in forms]
    predicted = after[0]["num_tokens"]
    assert {p["num_tokens"] for p in after} == {predicted}
    assert after[0]["num_prompt_tokens"] == len(ids)
    load = after[0]["load"]
    assert set(load) >= {"running", "waiting", "queued_prefill_tokens", "free_pages",
                         "total_pages", "prefill_tokens_per_s"}
    real = client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                     extra_body={"cache_salt": "probe"})
    assert real.usage.prompt_tokens_details.cached_tokens == predicted == len(ids) - 1


def test_probe_with_chat_messages_matches_chat_request(replica, client, model):
    messages = [{"role": "user", "content": SYSTEM + "chat probe"}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    predicted = _probe(replica.url, messages=messages)["num_tokens"]
    real = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert real.usage.prompt_tokens_details.cached_tokens == predicted > 0


def test_prompt_token_ids_field(replica, model):
    ids = [256] + list(b"token ids straight in")
    r = httpx.post(replica.url + "/v1/completions",
                   json={"model": model, "prompt_token_ids": ids, "max_tokens": 3})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_metrics_follow_the_traffic(replica, client, model):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        text = httpx.get(replica.url + "/metrics").text
        return {s.name + str(sorted(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    label = str(sorted({"model_name": model}.items()))
    before = scrape()
    client.completions.create(model=model, prompt=SYSTEM + "metrics", max_tokens=3)
    client.completions.create(model=model, prompt=SYSTEM + "metrics", max_tokens=3)
    after = scrape()
    assert after["replica_time_to_first_token_seconds_count" + label] == \
        before["replica_time_to_first_token_seconds_count" + label] + 2
    assert after["replica_generation_tokens_total" + label] == \
        before["replica_generation_tokens_total" + label] + 6
    hits = after["replica_prefix_cache_hits_total" + label] - \
        before["replica_prefix_cache_hits_total" + label]
    queries = after["replica_prefix_cache_queries_total" + label] - \
        before["replica_prefix_cache_queries_total" + label]
    prompt_len = len((SYSTEM + "metrics").encode()) + 1
    assert queries == 2 * (prompt_len - 1)
    assert hits >= prompt_len - 1  # the second request reuses everything it probes
    for name in ("replica_num_requests_running", "replica_num_requests_waiting",
                 "replica_kv_cache_usage_perc", "replica_inter_token_latency_seconds_count",
                 "replica_e2e_request_latency_seconds_count"):
        assert name + label in after
