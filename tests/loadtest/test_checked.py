"""loadtest.checked: a request is ok only when it got everything it asked for."""

import asyncio
import json

import httpx
import pytest

from loadtest.checked import checked_request


def sse(*events, done=True) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


TEXT = {"choices": [{"index": 0, "text": "a"}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
ERROR = {"error": {"message": "the replica failed while streaming"}}


def check(status, content, stream=True, max_tokens=2, disconnect_after=None):
    def answer(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent.get("stream_options") == ({"include_usage": True} if stream else None)
        return httpx.Response(status, content=content, headers={"x-replica": "r1"})

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer),
                                     base_url="http://router") as c:
            return await checked_request(c, "/v1/completions",
                                         {"prompt": "p", "max_tokens": max_tokens,
                                          "stream": stream}, disconnect_after)
    return asyncio.run(main())


@pytest.mark.parametrize("content, ok, started, error", [
    (sse(TEXT, TEXT, USAGE), True, True, None),
    (sse(TEXT, TEXT, USAGE, done=False), False, True, "the stream ended without data: [DONE]"),
    (sse(TEXT, ERROR), False, True, "error event: the replica failed while streaming"),
    (sse(ERROR), False, False, "error event: the replica failed while streaming"),
    (sse(TEXT, USAGE | {"usage": {"completion_tokens": 1}}), False, True,
     "usage says 1 tokens (asked 2)"),
    (sse(TEXT, TEXT), False, True, "usage says None tokens (asked 2)"),
])
def test_streams(content, ok, started, error):
    o = check(200, content)
    assert (o.ok, o.started, o.error, o.replica) == (ok, started, error, "r1")
    assert o.lost_before_start is (not ok and not started)


def test_a_client_that_leaves_on_purpose_is_ok_and_marked():
    o = check(200, sse(TEXT, TEXT, TEXT, USAGE, done=False), disconnect_after=2)
    assert (o.ok, o.disconnected, o.started, o.done) == (True, True, True, False)


def whole(tokens, finish="length"):
    return json.dumps({"choices": [{"text": "ab", "finish_reason": finish}],
                       "usage": {"completion_tokens": tokens}}).encode()


@pytest.mark.parametrize("status, content, ok, error", [
    (200, whole(2), True, None),
    (200, whole(1, "stop"), False, "1 tokens, finish_reason 'stop' (asked 2)"),
    (200, b"{not json", False, None),
    (502, b'{"error": {"message": "no replica"}}', False,
     'HTTP 502: {"error": {"message": "no replica"}}'),
])
def test_whole_answers(status, content, ok, error):
    o = check(status, content, stream=False)
    assert o.ok is ok and o.started is (status == 200 and content != b"{not json")
    if error is not None:
        assert o.error == error
    elif not ok:
        assert o.error.startswith("unreadable answer: ")
