"""The router's HTTP/1.1 server protocol (uvicorn's, with ``http_server.FrontDoorProtocol``'s
limits), without sockets: raw bytes into one connection, raw bytes out (as uvicorn's own
protocol tests drive it), over a table of hostile inputs.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from uvicorn.server import ServerState

from router import http_server
from router.asgi import ProxyASGI
from router.settings import RouterSettings


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:  # the server ended its side (it closes after lingering)
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name in ("peername", "sockname") else default


async def echo(headers, body, send) -> None:
    seen = json.dumps({"headers": [[k.decode(), v.decode()] for k, v in headers],
                       "body": body.decode("latin-1")}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(seen)).encode())]})
    await send({"type": "http.response.body", "body": seen})


async def not_found(scope, receive, send) -> None:
    body = b'{"error": {"message": "no route", "code": "not_found"}}'
    await send({"type": "http.response.start", "status": 404,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def exchange(*pieces: bytes) -> tuple[list[tuple[int, dict, bytes]], bool]:
    """Feed ``pieces`` to one connection; the responses it wrote and whether it closed."""
    async def main():
        config = http_server.config(ProxyASGI(not_found, {("POST", "/echo"): echo}),
                                    RouterSettings(max_body_bytes=1 << 20))
        config.load()
        conn = config.http_protocol_class(config=config, server_state=ServerState(),
                                          app_state={})
        transport = FakeTransport()
        conn.connection_made(transport)
        for piece in pieces:
            if transport.closed:
                break
            conn.data_received(piece)
            for _ in range(50):  # let the answering tasks run (bounded)
                await asyncio.sleep(0)
        if transport.closed:
            conn.connection_lost(None)
        return bytes(transport.out), transport.closed
    out, closed = asyncio.run(main())
    return parse_responses(out), closed


def parse_responses(data: bytes) -> list[tuple[int, dict, bytes]]:
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict((k.strip().lower(), v.strip()) for k, _, v in
                       (line.partition(":") for line in lines[1:]))
        n = int(headers.get("content-length", "0"))
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        data = rest[n:]
    return out


def post(extra: bytes, body: bytes = b"{}") -> bytes:
    return b"POST /echo HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n" + body


# name: (bytes sent, statuses answered, connection closed after)
HOSTILE = {
    "content-length and transfer-encoding": (
        post(b"content-length: 2\r\ntransfer-encoding: chunked\r\n", b"0\r\n\r\n"), [400], True),
    "two different content-lengths": (
        post(b"content-length: 2\r\ncontent-length: 3\r\n", b"{} "), [400], True),
    "chunk size overflow": (
        post(b"transfer-encoding: chunked\r\n", b"ffffffffffffffffff\r\nx\r\n0\r\n\r\n"),
        [400], True),
    "chunk size with 0x": (post(b"transfer-encoding: chunked\r\n", b"0x2\r\n{}\r\n0\r\n\r\n"),
                           [400], True),
    "chunk size with +": (post(b"transfer-encoding: chunked\r\n", b"+2\r\n{}\r\n0\r\n\r\n"),
                          [400], True),
    "chunk size with _": (post(b"transfer-encoding: chunked\r\n", b"1_0\r\n{}\r\n0\r\n\r\n"),
                          [400], True),
    "obs-fold header": (post(b"content-length: 2\r\nx-a: one\r\n two\r\n"), [400], True),
    "bare LF line ends": (b"POST /echo HTTP/1.1\nhost: x\ncontent-length: 2\n\n{}", [400],
                          True),
    "a 200 KB header": (post(b"x-big: " + b"a" * 200_000 + b"\r\ncontent-length: 2\r\n"),
                        [431], True),
    "pipelined, answered in order": (
        post(b"content-length: 2\r\n") + post(b"content-length: 3\r\n", b"{ }"), [200, 200],
        False),
    "HTTP/1.0 keep-alive is one request": (
        b"POST /echo HTTP/1.0\r\nhost: x\r\nconnection: keep-alive\r\ncontent-length: 2\r\n"
        b"\r\n{}" + post(b"content-length: 2\r\n"), [200], True),
    "garbage after a request": (post(b"content-length: 2\r\n") + b"\x00\x01garbage\r\n\r\n",
                                [200, 400], True),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input(name):
    data, statuses, closed = HOSTILE[name]
    responses, was_closed = exchange(data)
    assert [status for status, _, _ in responses] == statuses
    assert was_closed is closed
    for status, headers, body in responses:
        if status >= 400:
            assert json.loads(body)["error"]["message"]


@pytest.mark.parametrize("name", ["pipelined, answered in order", "two different "
                                  "content-lengths", "a 200 KB header"])
def test_the_same_bytes_one_at_a_time_get_the_same_answers(name):
    data, statuses, closed = HOSTILE[name]
    if len(data) > 2000:
        pieces = [data[i:i + 997] for i in range(0, len(data), 997)]
    else:
        pieces = [data[i:i + 1] for i in range(len(data))]
    responses, was_closed = exchange(*pieces)
    assert [status for status, _, _ in responses] == statuses and was_closed is closed


def test_pipelined_bodies_reach_their_own_requests():
    responses, _ = exchange(post(b"content-length: 2\r\n") + post(b"content-length: 3\r\n",
                                                                   b"{ }"))
    assert [json.loads(body)["body"] for _, _, body in responses] == ["{}", "{ }"]
