"""vLLM's render API on a live replica (``POST /v1/completions/render``,
``POST /v1/chat/completions/render``): the prompt ids a completion of the same body computes,
in vLLM's answer shape (a list of one ``GenerateRequest`` for completions, one for chats),
refused as the completion would be. vLLM's router tokenizes through these
(tests/loadtest/test_vllm_router.py); transformers is the oracle for the ids in
test_hf_replica.py."""

import httpx
import pytest

SYSTEM = "You are a careful assistant. " * 8


def post(replica, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(replica.url + path, json=body, headers=headers, timeout=30)


def test_completion_render_is_a_list_of_one_with_the_prompt_ids(replica):
    prompt = SYSTEM + "Question?"
    r = post(replica, "/v1/completions/render",
             {"prompt": prompt, "max_tokens": 5, "temperature": 0, "cache_salt": "s1"},
             **{"x-request-id": "req-7"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == [{
        "request_id": "req-7", "token_ids": [256, *prompt.encode()], "features": None,
        "sampling_params": {"max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "seed": None,
                            "stop": []},
        "model": "sim-byte-lm", "stream": False, "cache_salt": "s1"}]
    done = post(replica, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == len(r.json()[0]["token_ids"])


def test_chat_render_is_the_rendered_template_and_the_default_output_limit(replica):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    rendered = post(replica, "/v1/chat/completions/render", {"messages": messages}).json()
    # what the replica probes for the same messages, and computes for a completion of them
    probe = post(replica, "/probe_reuse", {"messages": messages}).json()
    done = post(replica, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert len(rendered["token_ids"]) == probe["num_prompt_tokens"] == \
        done["usage"]["prompt_tokens"]
    assert post(replica, "/probe_reuse", {"token_ids": rendered["token_ids"]}).json()[
        "num_prompt_tokens"] == len(rendered["token_ids"])
    assert rendered["sampling_params"]["max_tokens"] == 256  # --default-chat-max-tokens
    assert len(rendered["request_id"]) > 0 and rendered["stream"] is False


@pytest.mark.parametrize("path, body, status, code", [
    ("/v1/completions/render", {"prompt": "x", "model": "other"}, 404, "model_not_found"),
    ("/v1/completions/render", {"prompt": "x" * 2000}, 400, "context_length_exceeded"),
    ("/v1/completions/render", {"prompt": ["a", "b"]}, 400, None),
    ("/v1/completions/render", {"prompt": ""}, 400, None),
    ("/v1/chat/completions/render", {"messages": []}, 400, None),
    ("/v1/chat/completions/render",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1024}, 400,
     "context_length_exceeded"),
])
def test_render_refuses_what_the_completion_would(replica, path, body, status, code):
    r = post(replica, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    generated = post(replica, path.removesuffix("/render"), body)
    assert generated.status_code == status  # the same refusal
