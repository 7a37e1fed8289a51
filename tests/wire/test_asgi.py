"""HotRoutes (plain-ASGI routes in front of FastAPI) and the write-coalescing transport,
driven directly: exact messages in, exact messages out."""

import asyncio
import json

from fastapi import FastAPI

from wire.asgi import HotRoutes, document, send_bytes
from replicas import coalesce
from replicas.coalesce import CoalescingTransport
from wire.errors import APIError


def call(app, method: str, path: str, body_parts: list[bytes], headers=()) -> list[dict]:
    """Run one request through ``app``; the ASGI messages it sent."""
    async def go():
        incoming = [{"type": "http.request", "body": part, "more_body": i < len(body_parts) - 1}
                    for i, part in enumerate(body_parts)]
        sent = []

        async def receive():
            if incoming:
                return incoming.pop(0)
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": method, "path": path, "headers": list(headers),
                 "query_string": b"", "root_path": "", "scheme": "http",
                 "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
        await app(scope, receive, send)
        return sent
    return asyncio.run(go())


def make_app() -> HotRoutes:
    api = FastAPI()

    @api.get("/plain")
    async def plain() -> dict:
        return {"via": "fastapi"}

    document(api, "POST", "/hot", responses={400: {"description": "bad"}})
    hot = HotRoutes(api, max_body_bytes=100)

    async def echo(scope, body, receive, send):
        if body == b"refuse":
            raise APIError(400, "refused", param="body", code="nope")
        if body == b"rate":
            raise APIError(429, "slow down", type="rate_limit_error",
                           headers={"Retry-After": "2"})
        if body == b"bug":
            raise RuntimeError("a bug")
        await send_bytes(send, 200, body, b"text/plain", {"x-len": str(len(body))})
    hot.add("POST", "/hot", echo)
    return hot


def answer(sent: list[dict]) -> tuple[int, dict, bytes]:
    start, body = sent
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body["body"]


def test_a_hot_route_reads_the_whole_body_and_answers():
    status, headers, body = answer(call(make_app(), "POST", "/hot", [b"ab", b"cd", b"e"]))
    assert (status, body) == (200, b"abcde")
    assert headers == {"content-type": "text/plain", "content-length": "5", "x-len": "5"}


def test_errors_become_openai_bodies():
    status, headers, body = answer(call(make_app(), "POST", "/hot", [b"refuse"]))
    assert status == 400 and headers["x-should-retry"] == "false"
    assert json.loads(body) == {"error": {"message": "refused", "type": "invalid_request_error",
                                          "param": "body", "code": "nope"}}
    status, headers, body = answer(call(make_app(), "POST", "/hot", [b"rate"]))
    assert status == 429 and headers["retry-after"] == "2" and "x-should-retry" not in headers
    status, headers, body = answer(call(make_app(), "POST", "/hot", [b"bug"]))
    assert status == 500 and json.loads(body)["error"]["type"] == "server_error"


def test_the_body_limit_holds_with_and_without_content_length():
    status, _, body = answer(call(make_app(), "POST", "/hot", [b"x"],
                                  headers=[(b"content-length", b"101")]))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    status, _, _ = answer(call(make_app(), "POST", "/hot", [b"x" * 60, b"y" * 60]))
    assert status == 413


def test_other_routes_and_methods_go_to_the_app():
    status, _, body = answer(call(make_app(), "GET", "/plain", [b""]))
    assert (status, json.loads(body)) == (200, {"via": "fastapi"})
    sent = call(make_app(), "GET", "/hot", [b""])
    assert sent[0]["status"] == 405  # the documented route is POST only
    doc = make_app().app.openapi()
    assert "post" in doc["paths"]["/hot"]


class Recorder:
    def __init__(self):
        self.writes, self.closed, self.aborted = [], False, False

    def write(self, data):
        self.writes.append(data)

    def is_closing(self):
        return self.closed or self.aborted

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = True

    def get_write_buffer_size(self):
        return 0

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 9) if name == "peername" else default


def test_writes_of_one_loop_step_leave_together():
    async def go():
        raw = Recorder()
        t = CoalescingTransport(raw, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"")
        t.write(b"body")
        pending = (list(raw.writes), t.get_write_buffer_size())
        await asyncio.sleep(0)
        first = list(raw.writes)
        t.writelines([b"a", b"b"])
        t.close()  # flushes what was written before closing
        after_close = (list(raw.writes), raw.closed)
        t.write(b"late")
        await asyncio.sleep(0)
        return pending, first, after_close, raw.writes, t.get_extra_info("peername")
    pending, first, after_close, final, peer = asyncio.run(go())
    assert pending == ([], 23)
    assert first == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    assert after_close == ([b"HTTP/1.1 200 OK\r\n\r\nbody", b"ab"], True)
    assert final == after_close[0] and peer == ("127.0.0.1", 9)  # nothing after close


def test_abort_drops_what_was_not_sent():
    async def go():
        raw = Recorder()
        t = CoalescingTransport(raw, asyncio.get_running_loop())
        t.write(b"x")
        t.abort()
        await asyncio.sleep(0)
        return raw.writes, raw.aborted
    assert asyncio.run(go()) == ([], True)


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n")


class _Handle:
    def __init__(self, callback, delay=None):
        self.callback, self.delay, self.cancelled = callback, delay, False

    def cancel(self):
        self.cancelled = True


class ManualLoop:
    """The transport's event loop, run by hand: ``step()`` runs what ``call_soon`` queued
    (the end of a loop step), ``fire()`` the ``call_later`` timers (their delay has passed),
    so the hold is checked without sleeping against a clock."""

    def __init__(self):
        self.soon, self.timers = [], []

    def call_soon(self, callback):
        self.soon.append(_Handle(callback))
        return self.soon[-1]

    def call_later(self, delay, callback):
        self.timers.append(_Handle(callback, delay))
        return self.timers[-1]

    def pending_timers(self) -> list[float]:
        return [h.delay for h in self.timers if not h.cancelled]

    def step(self):
        self._run("soon")

    def fire(self):
        self._run("timers")

    def _run(self, which):
        handles = getattr(self, which)
        setattr(self, which, [])
        for h in handles:
            if not h.cancelled:
                h.callback()


def test_a_stream_head_waits_for_its_first_event():
    loop, raw = ManualLoop(), Recorder()
    t = CoalescingTransport(raw, loop)
    t.write(STREAM_HEAD)
    loop.step()
    assert raw.writes == []  # a loop step later: still held, for HEAD_HOLD_S
    assert loop.pending_timers() == [coalesce.HEAD_HOLD_S]
    t.write(b"5\r\nhello\r\n")
    assert loop.pending_timers() == []  # the first event ends the hold
    loop.step()
    assert raw.writes == [STREAM_HEAD + b"5\r\nhello\r\n"]
    t.write(b"3\r\nbye\r\n")  # later events: at the end of their own step
    loop.step()
    assert raw.writes == [STREAM_HEAD + b"5\r\nhello\r\n", b"3\r\nbye\r\n"]


def test_a_stream_head_without_an_event_leaves_after_the_hold():
    loop, raw = ManualLoop(), Recorder()
    t = CoalescingTransport(raw, loop)
    t.write(STREAM_HEAD)
    loop.step()
    assert raw.writes == [] and loop.pending_timers() == [coalesce.HEAD_HOLD_S]
    loop.fire()  # HEAD_HOLD_S later
    assert raw.writes == [STREAM_HEAD]


def test_only_a_lone_stream_head_is_held():
    sized = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"

    async def go():
        out = []
        for first in (sized, b"HTTP/1.1 200 OK\r\nx-note: transfer-encoding: chunked\r\n\r\n",
                      STREAM_HEAD + b"5\r\nhello\r\n"):
            raw = Recorder()
            t = CoalescingTransport(raw, asyncio.get_running_loop())
            t.write(first)
            await asyncio.sleep(0)
            out.append(raw.writes)
        return out
    assert asyncio.run(go()) == [[sized],
                                 [b"HTTP/1.1 200 OK\r\nx-note: transfer-encoding: chunked\r\n\r\n"],
                                 [STREAM_HEAD + b"5\r\nhello\r\n"]]


def test_close_sends_a_held_head_and_abort_drops_it():
    closed, aborted = Recorder(), Recorder()
    for raw in (closed, aborted):
        loop = ManualLoop()
        t = CoalescingTransport(raw, loop)
        t.write(STREAM_HEAD)
        t.close() if raw is closed else t.abort()
        assert loop.pending_timers() == []  # the hold's timer is cancelled
        loop.step()
        loop.fire()  # nothing more is written
    assert (closed.writes, aborted.writes) == ([STREAM_HEAD], [])
