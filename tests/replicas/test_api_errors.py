"""Every bad input gets a 4xx with an OpenAI-style error body; the replica stays healthy."""

import httpx
import pytest

CASES = [
    # (path, raw body or json, status, param, message fragment)
    ("/v1/completions", b'{"prompt": "x", ', 400, None, "not valid JSON"),
    ("/v1/completions", b'[1, 2]', 400, None, "valid dictionary"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model", "not served here"),
    ("/v1/completions", {"max_tokens": 4}, 400, None, "prompt is required"),
    ("/v1/completions", {"prompt": ""}, 400, None, "must not be empty"),
    ("/v1/completions", {"prompt": []}, 400, None, "must not be empty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, None, "batched prompts"),
    ("/v1/completions", {"prompt": [1, 2, 260]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt_token_ids": [5, 99999]}, 400, "prompt_token_ids", "outside"),
    ("/v1/completions", {"prompt": "x" * 1100}, 400, "prompt", "maximum context length"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2000}, 400, "max_tokens", "exceeds"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "only n=1"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, 400, "logprobs", "not supported"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "not supported"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "not supported"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "at most 4"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", "Input should be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url"}]}]}, 400, "messages", "not supported"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages", "valid list"),
    # JSON can escape an unpaired surrogate; no text holds one (was a 500)
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt",
     "prompt: text has an unpaired surrogate U+D800 at character 1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "ok"}, '
     b'{"role": "user", "content": "\\udfff"}]}', 400, "messages",
     "message 1: text has an unpaired surrogate U+DFFF at character 0"),
    ("/probe_reuse", b'{"prompt": "\\ud800"}', 400, None, "unexpected end of hex escape"),
    ("/probe_reuse", {}, 400, None, "exactly one of"),
    ("/probe_reuse", {"prompt": "a", "token_ids": [1]}, 400, None, "exactly one of"),
    ("/probe_reuse", {"token_ids_b64": "!!!"}, 400, "token_ids_b64", "not valid base64"),
    ("/probe_reuse", {"token_ids_b64": "AAA="}, 400, "token_ids_b64", "multiple of 4"),
    ("/probe_reuse", {"token_ids": [1000]}, 400, "token_ids", "outside the vocabulary"),
]


@pytest.mark.parametrize("path, body, status, param, fragment", CASES,
                         ids=[f"{c[0]}:{c[4]}:{i}" for i, c in enumerate(CASES)])
def test_bad_input(replica, path, body, status, param, fragment):
    if isinstance(body, bytes):
        r = httpx.post(replica.url + path, content=body,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(replica.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"]
    assert error["param"] == param
    assert error["type"] == ("invalid_request_error")
    assert r.headers["x-should-retry"] == "false"
    assert httpx.get(replica.url + "/health").status_code == 200


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"),
                                         ("/probe_reuse", "prompt")])
def test_body_over_the_limit_is_413(replica, path, field):
    r = httpx.post(replica.url + path, json={field: "x" * 70000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert r.headers["x-should-retry"] == "false"
    assert httpx.get(replica.url + "/health").status_code == 200


def test_unknown_fields_are_ignored(replica):
    r = httpx.post(replica.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "no_stop_trim": True, "ignore_eos": False,
        "return_hidden_states": False, "skip_special_tokens": True})
    assert r.status_code == 200, r.text


def test_unknown_route_is_an_openai_404(replica):
    r = httpx.get(replica.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
