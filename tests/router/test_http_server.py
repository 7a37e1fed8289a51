"""The router's HTTP server (uvicorn with ``http_server.FrontDoorProtocol``, serving
``asgi.ProxyASGI``), in process, over loopback sockets: what a client of the router sees."""

import asyncio
import contextlib
import json
import socket

import pytest
import uvicorn

from wire.errors import APIError
from router import http_server
from router.asgi import ProxyASGI
from router.http_server import MAX_HEAD_BYTES
from router.settings import RouterSettings
from tests.waiting import until_async

LIMIT = 1024  # max_body_bytes in these tests


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def whole(status: int, body: bytes, send, headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"),
                            (b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})


async def echo(headers, body, send) -> None:
    """A proxy route: answers with what it was given."""
    seen = json.dumps({"headers": [[k.decode(), v.decode()] for k, v in headers],
                       "body": body.decode()}).encode()
    await whole(200, seen, send)


async def asgi_app(scope, receive, send) -> None:
    """The app behind the proxy routes: answers with the scope's request line."""
    message = await receive()
    body = json.dumps({"method": scope["method"], "path": scope["path"],
                       "raw_path": scope["raw_path"].decode(),
                       "query": scope["query_string"].decode(),
                       "body": message["body"].decode()}).encode()
    await whole(200, body, send)


@contextlib.asynccontextmanager
async def serving(routes=None, app=asgi_app, **settings):
    """The router's server on a free loopback port; yields (server, port); stops it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings.setdefault("max_body_bytes", LIMIT)
    config = http_server.config(
        ProxyASGI(app, routes if routes is not None else {("POST", "/echo"): echo}),
        RouterSettings(log_level="warning", **settings))
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    await until_async(lambda: server.started or task.done(), "the server started")
    try:
        yield server, port
    finally:
        server.should_exit = True
        await task


def connections(server) -> int:
    return len(server.server_state.connections)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one response: content-length, chunked or to the close."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            parts.append((await reader.readexactly(size + 2))[:-2])
            if size == 0:
                break
        body = b"".join(parts)
    else:
        body = await reader.read()
    return status, headers, body


def request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n"
            f"{headers}\r\n").encode() + body


async def connect(port: int):
    return await asyncio.open_connection("127.0.0.1", port)


def until_close(data: bytes, routes=None, **settings) -> bytes:
    """Send ``data`` on one connection; everything the server writes before it closes."""
    async def main():
        async with serving(routes, **settings) as (_, port):
            reader, writer = await connect(port)
            writer.write(data)
            got = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return got
    return run(main())


# -- requests and answers ------------------------------------------------------------------

def test_a_route_gets_headers_and_body_and_the_connection_is_kept():
    async def main():
        async with serving() as (server, port):
            reader, writer = await connect(port)
            for i in range(3):
                writer.write(request("POST", "/echo", b"hello %d" % i, "X-Thing: A\r\n"))
                status, headers, body = await read_response(reader)
                assert status == 200
                seen = json.loads(body)
                assert seen["body"] == f"hello {i}"
                assert ["x-thing", "A"] in seen["headers"]  # names in lower case
                assert "connection" not in headers and headers["date"].endswith("GMT")
                assert "server" not in headers
            assert connections(server) == 1
            writer.close()
    run(main())


def test_pipelined_requests_are_answered_one_at_a_time_in_order():
    events = []
    gate = None

    async def slow(headers, body, send):
        events.append(f"start {body.decode()}")
        if body == b"1":
            await gate.wait()
        events.append(f"end {body.decode()}")
        await whole(200, body, send)

    async def main():
        nonlocal gate
        gate = asyncio.Event()
        async with serving({("POST", "/s"): slow}) as (_, port):
            reader, writer = await connect(port)
            writer.write(b"".join(request("POST", "/s", b"%d" % i) for i in (1, 2, 3)))
            await until_async(lambda: events, "the first request started")
            for _ in range(20):  # the others wait for it, however long it takes
                await asyncio.sleep(0)
            assert events == ["start 1"]
            gate.set()
            answers = [await read_response(reader) for _ in range(3)]
            assert [a[2] for a in answers] == [b"1", b"2", b"3"]
            writer.close()
    run(main())
    assert events == ["start 1", "end 1", "start 2", "end 2", "start 3", "end 3"]


def test_a_chunked_request_body_arrives_whole():
    async def main():
        async with serving() as (_, port):
            reader, writer = await connect(port)
            writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
            status, _, body = await read_response(reader)
            assert status == 200 and json.loads(body)["body"] == "hello world"
            writer.close()
    run(main())


def test_a_large_chunked_body_with_a_trailer_arrives_and_the_trailer_is_no_header():
    """A chunked body over 64 KiB, then a trailer: the body arrives whole, and the trailer
    field does not become a request header; trailers over 64 KiB are refused."""
    async def main():
        async with serving(max_body_bytes=1 << 20) as (_, port):
            reader, writer = await connect(port)
            part = b"x" * 40_000
            writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                         + b"%x\r\n%s\r\n" % (len(part), part) * 2
                         + b"0\r\nauthorization: Bearer smuggled\r\n\r\n")
            status, _, body = await read_response(reader)
            seen = json.loads(body)
            assert (status, len(seen["body"])) == (200, 80_000)
            assert "authorization" not in [name for name, _ in seen["headers"]]
            writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"1\r\nx\r\n0\r\n" + b"x-pad: %s\r\n" % (b"y" * 1000) * 70 + b"\r\n")
            status, _, body = await read_response(reader)
            assert (status, json.loads(body)["error"]["message"]) == \
                (431, f"request trailers over {MAX_HEAD_BYTES} bytes")
            writer.close()
    run(main())


def test_a_streamed_response_is_chunked_and_each_part_leaves_when_sent():
    release = None

    async def stream(headers, body, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main():
        nonlocal release
        release = asyncio.Event()
        async with serving({("POST", "/s"): stream, ("POST", "/echo"): echo}) as (_, port):
            reader, writer = await connect(port)
            writer.write(request("POST", "/s"))
            head = await reader.readuntil(b"\r\n\r\n")
            assert b"transfer-encoding: chunked\r\n" in head
            first = b"9\r\ndata: 1\n\n\r\n"
            assert await reader.readexactly(len(first)) == first  # before the second is sent
            release.set()
            assert await reader.readuntil(b"0\r\n\r\n") == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"
            writer.write(request("POST", "/echo", b"next"))  # the connection is still usable
            assert (await read_response(reader))[0] == 200
            writer.close()
    run(main())


def test_an_http10_request_is_answered_and_the_connection_closes():
    data = until_close(b"POST /echo HTTP/1.0\r\nhost: x\r\nconnection: keep-alive\r\n"
                       b"content-length: 2\r\n\r\nok")
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.count(b"HTTP/1.1 ") == 1
    assert json.loads(data.partition(b"\r\n\r\n")[2])["body"] == "ok"


def test_an_http10_client_gets_a_stream_delimited_by_the_close_not_chunked():
    async def stream(headers, body, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for event in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    data = until_close(b"POST /stream HTTP/1.0\r\nhost: x\r\ncontent-length: 2\r\n\r\nok",
                       {("POST", "/stream"): stream})
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding" not in head.lower() and b"content-length" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"  # the bytes, unframed


def test_an_http11_client_still_gets_a_stream_chunked():
    async def stream(headers, body, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ab", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    data = until_close(b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n"
                       b"connection: close\r\n\r\n", {("POST", "/stream"): stream})
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower() and body == b"2\r\nab\r\n0\r\n\r\n"


# -- refusals --------------------------------------------------------------------------------

def test_limits_refuse_with_an_openai_error_and_close():
    called = []

    async def route(headers, body, send):
        called.append(body)
        await whole(200, b"", send)

    cases = [
        (request("POST", "/r", b"x" * (LIMIT + 1)), 413, "request_too_large"),  # announced
        (b"POST /r HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
         + b"401\r\n" + b"x" * (LIMIT + 1) + b"\r\n0\r\n\r\n", 413, "request_too_large"),
        (b"GET /r HTTP/1.1\r\nx-big: " + b"y" * MAX_HEAD_BYTES + b"\r\n\r\n", 431,
         "header_too_large"),
        (b"NOT HTTP AT ALL\r\n\r\n", 400, None),
        (b"GET /r HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
         400, None),
    ]

    async def main():
        async with serving({("POST", "/r"): route}) as (_, port):
            for raw, status, code in cases:
                reader, writer = await connect(port)
                writer.write(raw)
                got, headers, body = await read_response(reader)
                error = json.loads(body)["error"]
                assert (got, error["code"]) == (status, code), (raw[:40], body)
                assert error["message"] and headers["connection"] == "close"
                assert headers["x-should-retry"] == "false"
                assert await reader.read() == b""
                writer.close()
    run(main())
    assert called == []


def test_garbage_pipelined_behind_a_request_is_refused_after_its_answer():
    calls = []
    gate = None

    async def slow(headers, body, send):
        calls.append(body)
        await gate.wait()
        await whole(200, b"answered", send)

    async def main():
        nonlocal gate
        gate = asyncio.Event()
        async with serving({("POST", "/s"): slow}) as (_, port):
            reader, writer = await connect(port)
            writer.write(request("POST", "/s", b"1"))
            await until_async(lambda: calls, "the first request is being answered")
            writer.write(b"GARBAGE\r\n\r\n" + request("POST", "/s", b"2"))
            for _ in range(20):
                await asyncio.sleep(0)
            gate.set()
            first = await read_response(reader)
            second = await read_response(reader)
            assert (first[0], first[2]) == (200, b"answered")
            assert second[0] == 400 and second[1]["connection"] == "close"
            assert json.loads(second[2])["error"]["message"].startswith("invalid HTTP request")
            assert await reader.read() == b""
    run(main())
    assert calls == [b"1"]


def test_expect_100_continue():
    async def main():
        async with serving() as (_, port):
            reader, writer = await connect(port)
            writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
                         b"expect: 100-continue\r\n\r\n")
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"ok")
            status, _, body = await read_response(reader)
            assert status == 200 and json.loads(body)["body"] == "ok"
            writer.close()
    run(main())


def test_an_http10_client_gets_no_100_continue():
    data = until_close(b"POST /echo HTTP/1.0\r\nhost: x\r\ncontent-length: 2\r\n"
                       b"expect: 100-continue\r\n\r\nok")  # HTTP/1.0: answer, then close
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"100 Continue" not in data


def test_bytes_after_a_connection_close_request_get_no_second_answer():
    data = until_close(request("POST", "/echo", b"{}", "connection: close\r\n")
                       + b"GET /garbage HTTP/1.1\r\nhost: x\r\n\r\n")
    assert data.count(b"HTTP/1.1 ") == 1 and data.startswith(b"HTTP/1.1 200 OK")


async def _declares(length: bytes, body: bytes, send, name: bytes = b"x-ok") -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", length), (name, b"v\x00" if name == b"x-nul"
                                                             else b"v")]})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("route, first", [
    # longer than its Content-Length: the declared bytes, then the connection closes
    (lambda h, b, send: _declares(b"3", b"toolong", send), b"HTTP/1.1 200 OK"),
    # shorter: sent, and the connection closes (the client sees it cut, not a desync)
    (lambda h, b, send: _declares(b"10", b"short", send), b"HTTP/1.1 200 OK"),
    # a header value with NUL, or a name that is no token: nothing sent (uvicorn refuses
    # the head), the connection closed; never a broken head
    (lambda h, b, send: _declares(b"2", b"ok", send, b"x-nul"), b""),
    (lambda h, b, send: _declares(b"2", b"ok", send, b"bad name"), b""),
])
def test_a_response_that_breaks_its_own_framing_is_never_sent_as_valid(route, first):
    # pipelined: a broken answer must not let bytes be read as the next answer
    data = until_close(request("POST", "/r") + request("POST", "/r", b"",
                                                       "connection: close\r\n"),
                       {("POST", "/r"): route})
    assert data.startswith(first)
    assert data.count(b"HTTP/1.1 ") == (first != b"")  # closed after it: nothing more
    assert b"toolong" not in data and b"\x00" not in data


async def _trickle(writer, reader, data: bytes) -> bytes:
    """Send ``data`` a byte at a time (20 ms apart) until the server answers or closes;
    bounded by ``data``'s length. Returns what the server sent."""
    for i in range(len(data)):
        writer.write(data[i:i + 1])
        try:
            got = await asyncio.wait_for(reader.read(65536), 0.02)
        except asyncio.TimeoutError:
            continue
        return got + await reader.read()
    return b""


@pytest.mark.parametrize("prefix, trickled, message", [
    (b"", b"POST /echo HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 400,
     b"request head not complete within 0.3 s"),
    (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 400\r\n\r\n", None,
     b"request body made no progress for 0.3 s"),
])
def test_slow_heads_and_stalled_bodies_get_a_408_and_the_close(prefix, trickled, message):
    """A head trickled a byte at a time (each byte restarts uvicorn's idle timer) is cut
    off at the head deadline; a body that stops is cut off at the body-progress one."""
    async def main():
        async with serving(head_timeout_s=0.3, body_timeout_s=0.3) as (_, port):
            reader, writer = await connect(port)
            writer.write(prefix)
            if trickled is not None:
                got = await _trickle(writer, reader, trickled)
            else:
                writer.write(b"abc")  # some body, then nothing
                got = await asyncio.wait_for(reader.read(), 30)  # the 408, then the close
            writer.close()
            return got
    got = run(main())
    assert got.startswith(b"HTTP/1.1 408 ") and message in got


def test_connections_past_the_cap_get_a_503_and_the_close():
    async def main():
        async with serving(max_connections=2) as (server, port):
            kept = [await connect(port) for _ in range(2)]
            for reader, writer in kept:  # both answered: they count
                writer.write(request("POST", "/echo", b"{}"))
                assert (await read_response(reader))[0] == 200
            reader, writer = await connect(port)
            refused = await asyncio.wait_for(reader.read(), 10)
            kept[0][1].close()
            await asyncio.wait_for(kept[0][0].read(), 10)
            await until_async(lambda: connections(server) == 1, "the server saw the close")
            again_r, again_w = await connect(port)
            again_w.write(request("POST", "/echo", b"{}"))
            status = (await read_response(again_r))[0]
            for _, w in [kept[1], (None, writer), (None, again_w)]:
                w.close()
            return refused, status
    refused, status = run(main())
    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head
    assert b"retry-after: 1" in head
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert status == 200  # a place freed up: served again


# -- clients that leave, errors, the app behind -----------------------------------------------

def test_a_client_that_leaves_cancels_its_route_and_the_app_hears_it():
    started = cancelled = disconnect = None

    async def forever(headers, body, send):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def waits_for_disconnect(scope, receive, send):
        await receive()  # the body
        started.set()
        disconnect.set_result((await receive())["type"])

    async def main():
        nonlocal started, cancelled, disconnect
        cancelled, disconnect = asyncio.Event(), asyncio.get_running_loop().create_future()
        async with serving({("POST", "/f"): forever}, app=waits_for_disconnect) as (srv, port):
            for raw in (request("POST", "/f"), request("GET", "/other")):
                started = asyncio.Event()
                _, writer = await connect(port)
                writer.write(raw)
                await started.wait()
                writer.close()
            await asyncio.wait_for(cancelled.wait(), 5)
            assert await asyncio.wait_for(disconnect, 5) == "http.disconnect"
            await until_async(lambda: not connections(srv), "both connections gone")
    run(main())


def test_route_errors_become_openai_error_bodies():
    async def refuses(headers, body, send):
        raise APIError(404, "no such thing", param="thing")

    async def breaks(headers, body, send):
        raise RuntimeError("bug")

    async def silent(headers, body, send):
        pass

    async def main():
        routes = {("POST", "/refuses"): refuses, ("POST", "/breaks"): breaks,
                  ("POST", "/silent"): silent}
        async with serving(routes) as (_, port):
            reader, writer = await connect(port)
            for raw, status, message in [
                (request("POST", "/refuses"), 404, "no such thing"),
                (request("POST", "/breaks"), 500, "internal error"),
                (request("POST", "/silent"), 500, "internal error"),
            ]:
                writer.write(raw)
                got, headers, body = await read_response(reader)
                assert got == status and json.loads(body)["error"]["message"] == message
            writer.close()
    run(main())


def test_the_app_gets_the_scope_and_encoded_paths_are_not_proxy_routes():
    async def main():
        async with serving() as (_, port):
            reader, writer = await connect(port)
            writer.write(request("PUT", "/a%20b/c?x=1&y=2", b"payload"))
            status, _, body = await read_response(reader)
            assert status == 200 and json.loads(body) == {
                "method": "PUT", "path": "/a b/c", "raw_path": "/a%20b/c",
                "query": "x=1&y=2", "body": "payload"}
            writer.write(request("POST", "/ech%6F", b"to the app"))  # decodes to /echo
            status, _, body = await read_response(reader)
            assert status == 200 and json.loads(body)["raw_path"] == "/ech%6F"
            writer.close()
    run(main())


def test_idle_connections_are_closed_after_keepalive_s():
    async def main():
        async with serving(keepalive_s=0.2) as (server, port):
            reader, writer = await connect(port)
            writer.write(request("POST", "/echo", b"x"))
            await read_response(reader)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
            await until_async(lambda: not connections(server), "the server dropped it")
    run(main())


def test_a_slow_reader_holds_a_stream_back():
    chunk = b"x" * 65536
    written = 0
    total = 512

    async def flood(headers, body, send):
        nonlocal written
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(total):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            written += 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main():
        async with serving({("POST", "/flood"): flood}) as (_, port):
            reader, writer = await connect(port)
            writer.write(request("POST", "/flood"))
            await until_async(lambda: written, "the stream started")
            last = -1
            while written != last:  # until the writer is held (the socket buffers full)
                last = written
                for _ in range(200):
                    await asyncio.sleep(0)
            held = written
            status, _, body = await read_response(reader)
            assert status == 200 and len(body) == total * len(chunk)
            writer.close()
            return held
    held = run(main())
    assert held < total // 2  # waited for the reader (socket buffers hold a few MiB)


# -- shutdown --------------------------------------------------------------------------------

def test_shutdown_finishes_running_requests_and_refuses_new_connections():
    started = gate = None

    async def slow(headers, body, send):
        started.set()
        await gate.wait()
        await whole(200, b"finished", send)

    async def main():
        nonlocal started, gate
        started, gate = asyncio.Event(), asyncio.Event()
        async with serving({("POST", "/slow"): slow}) as (server, port):
            busy_reader, busy_writer = await connect(port)
            idle_reader, idle_writer = await connect(port)
            busy_writer.write(request("POST", "/slow"))
            await started.wait()
            server.should_exit = True
            assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # idle: closed
            gate.set()
            status, headers, body = await read_response(busy_reader)
            assert (status, body) == (200, b"finished")
            assert await busy_reader.read() == b""
        try:
            await connect(port)
        except ConnectionRefusedError:
            return
        raise AssertionError("a connection was accepted after shutdown")
    run(main())


def test_shutdown_cancels_what_outlives_the_grace_period():
    started = cancelled = None

    async def hangs(headers, body, send):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        nonlocal started, cancelled
        started, cancelled = asyncio.Event(), asyncio.Event()
        async with serving({("POST", "/h"): hangs}, shutdown_grace_s=0.2) as (_, port):
            reader, writer = await connect(port)
            writer.write(request("POST", "/h"))
            await started.wait()
        await asyncio.wait_for(cancelled.wait(), 5)  # uvicorn cancels it as it stops
        status, headers, body = await read_response(reader)
        assert (status, json.loads(body)["error"]["code"]) == (503, "shutting_down")
        assert await reader.read() == b""
    run(main())
