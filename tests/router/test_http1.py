"""The router's HTTP/1.1 client against a real replica and against scripted servers."""

import asyncio
import binascii
import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from text import ByteTokenizer
from router.http1 import (_FRAMING_FIELDS, Client, ProtocolError, UpstreamClosed,
                          _Connection, _plain_length)
from tests.procs import Proc


def run(coro):
    return asyncio.run(coro)


async def until(state, what: str, tries: int = 500) -> None:
    """Wait until ``state()`` holds (a bounded poll of the event loop)."""
    for _ in range(tries):
        if state():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {what}")


class Scripted:
    """A loopback server that answers the n-th request on a connection with ``answers[n]``
    (bytes, sent in ``pieces`` writes with a pause between them; or a tuple of the pieces
    to write, each after the first only once ``proceed`` is set), then does ``after``:
    "keep" the connection open, "close" it, or "hang" without answering the next one."""

    def __init__(self, answers, pieces=1, after="keep"):
        self.answers, self.pieces, self.after = answers, pieces, after
        self.requests: list[bytes] = []
        self.connections = 0
        self.eof_seen = asyncio.Event()
        self.proceed = asyncio.Event()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        for answer in self.answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            self.requests.append(head + await reader.readexactly(length))
            if answer is None:  # read the request, close without answering
                writer.close()
                return
            if isinstance(answer, tuple):
                for i, piece in enumerate(answer):
                    if i:
                        await self.proceed.wait()
                    writer.write(piece)
                    await writer.drain()
                continue
            size = max(1, -(-len(answer) // self.pieces))
            for i in range(0, len(answer), size):
                writer.write(answer[i:i + size])
                await writer.drain()
                if self.pieces > 1:
                    await asyncio.sleep(0.005)
        if self.after == "close":
            writer.close()
            return
        if await reader.read(1) == b"":
            self.eof_seen.set()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def chunked(*parts: bytes, trailer: bytes = b"") -> bytes:
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\nx-a: 2\r\n\r\n"
            + body + b"0\r\n" + trailer + b"\r\n")


# -- against a real replica ------------------------------------------------------------

def test_probes_and_a_stream_against_a_replica_reuse_one_connection():
    ids = ByteTokenizer().encode_le32("x" * 999)
    probe = json.dumps({"token_ids_b64": binascii.b2a_base64(ids, newline=False).decode()})
    stream = json.dumps({"model": "sim-byte-lm", "prompt": "hello", "max_tokens": 3,
                         "stream": True, "stream_options": {"include_usage": True}})
    headers = {"content-type": "application/json"}
    with Proc("replicas", "--engine", "sim", "--log-level", "warning") as rep:
        async def go():
            client = Client()
            answers = [await client.fetch("POST", rep.url, "/probe_reuse", probe.encode(),
                                          headers) for _ in range(9)]
            # as the router probes: on the pooled connection, the request in parts
            head = client.head("POST", rep.url, "/probe_reuse", headers)
            parts = (head + b"Content-Length: %d\r\n\r\n" % len(probe), probe.encode())
            sent = client.start("POST", rep.url, parts)
            body = await sent.read(5.0)
            answers.append((sent.status, body))
            r = await client.request("POST", rep.url, "/v1/completions", stream.encode(),
                                     headers)
            lines = []
            while (line := await r.readline(5.0)) is not None:
                lines.append(line)
            r.close()
            bad = await client.fetch("POST", rep.url, "/probe_reuse", b"{}", headers)
            idle = client.idle_connections()
            client.close()
            return answers, r, lines, bad, idle
        answers, r, lines, bad, idle = run(go())
    assert {(s, json.loads(b)["num_prompt_tokens"]) for s, b in answers} == {(200, 1000)}
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in lines if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) >= 5
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3
    assert bad[0] == 400 and json.loads(bad[1])["error"]["type"] == "invalid_request_error"
    assert idle == 1  # one keep-alive connection served all twelve requests


# -- framing ---------------------------------------------------------------------------

@pytest.mark.parametrize("pieces", [1, 7])
def test_chunked_body_with_extensions_trailers_and_repeated_headers(pieces):
    answer = chunked(b"data: a\n\n", b"data: b\r\n\r\ndata: [DONE]\n\n", trailer=b"T: x\r\n")

    async def go():
        async with Scripted([answer, ok(b"second")], pieces=pieces) as srv:
            client = Client()
            r = await client.request("GET", srv.url, "/s")
            lines = []
            while (line := await r.readline(2.0)) is not None:
                lines.append(line)
            second = await client.fetch("GET", srv.url, "/t")
            return r, lines, second, srv.connections
    r, lines, second, connections = run(go())
    assert r.headers["x-a"] == "1, 2"
    assert lines == [b"data: a", b"", b"data: b", b"", b"data: [DONE]", b""]
    assert second == (200, b"second") and connections == 1  # reused after the trailer


def test_content_length_in_pieces_interim_answer_and_no_body_statuses():
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    answers = [interim + ok(b"x" * 5000), b"HTTP/1.1 204 No Content\r\n\r\n", ok(b"")]

    async def go():
        async with Scripted(answers, pieces=9) as srv:
            client = Client()
            return [await client.fetch("GET", srv.url, "/") for _ in answers], srv.connections
    got, connections = run(go())
    assert got == [(200, b"x" * 5000), (204, b""), (200, b"")] and connections == 1


def test_body_until_close_and_http10_are_not_pooled():
    answers = [b"HTTP/1.1 200 OK\r\n\r\nall of it", b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"]

    async def go():
        results = []
        for answer in answers:
            async with Scripted([answer], after="close") as srv:
                client = Client()
                results.append((await client.fetch("GET", srv.url, "/"),
                                client.idle_connections()))
        return results
    assert run(go()) == [((200, b"all of it"), 0), ((200, b"ok"), 0)]


def test_base_url_path_prefix_and_host_header():
    async def go():
        async with Scripted([ok(b"{}")]) as srv:
            await Client().fetch("POST", srv.url + "/api/", "/v1/completions", b"{}",
                                 {"x-request-id": "r1"})
            return srv.requests[0]
    request = run(go())
    assert request.startswith(b"POST /api/v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nx-request-id: r1\r\nContent-Length: 2\r\n\r\n{}" in request


def test_line_breaks_in_headers_are_refused():
    with pytest.raises(ValueError, match="line break"):
        Client().encode("POST", "http://127.0.0.1:1", "/", b"", {"x-id": "a\r\nx-evil: 1"})


# -- failures --------------------------------------------------------------------------

@pytest.mark.parametrize("answer, error, message", [
    (b"SSH-2.0-OpenSSH\r\n\r\n", ProtocolError, "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: x1\r\n\r\n", ProtocolError, "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", ProtocolError,
     "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", UpstreamClosed,
     "after part of the answer"),
])
def test_bad_or_cut_answers_are_connection_errors(answer, error, message):
    async def go():
        async with Scripted([answer], after="close") as srv:
            client = Client()
            with pytest.raises(error, match=message):
                await client.fetch("GET", srv.url, "/")
            return client.idle_connections()
    assert run(go()) == 0


def test_extra_bytes_after_the_body_retire_the_connection():
    async def go():
        async with Scripted([ok(b"ab") + b"junk", ok(b"cd")]) as srv:
            client = Client()
            first = await client.fetch("GET", srv.url, "/")
            return first, client.idle_connections()
    assert run(go()) == ((200, b"ab"), 0)


def test_a_pooled_connection_the_server_closed_is_retried_on_a_fresh_one():
    # The server answers once, then closes the connection when the next request comes in,
    # without answering (a keep-alive timeout racing the request): sent again, fresh.
    async def go():
        async with Scripted([ok(b"1"), None]) as srv:
            client = Client()
            first = await client.fetch("GET", srv.url, "/")
            second = await client.fetch("GET", srv.url, "/")
            return first, second, srv.connections, len(srv.requests)
    assert run(go()) == ((200, b"1"), (200, b"1"), 2, 3)


@pytest.mark.parametrize("repeatable, outcome", [(None, "error"), (True, "sent again")])
def test_a_post_on_a_pooled_connection_closed_unanswered_is_not_sent_twice(repeatable,
                                                                           outcome):
    """The server reads the second POST of a connection, then closes without answering: it
    may have run it, so the client must not send it again (a completion would run twice)
    unless the caller says the request is safe to repeat (a probe)."""
    async def go():
        async with Scripted([ok(b"1"), None]) as srv:
            client = Client()
            assert await client.fetch("POST", srv.url, "/v1/completions", b"{}") == (200, b"1")
            try:
                got = await client.fetch("POST", srv.url, "/v1/completions", b"{}",
                                         repeatable=repeatable)
            except UpstreamClosed:
                got = "error"
            posts = [r for r in srv.requests if r.startswith(b"POST /v1/completions")]
            return got, len(posts), srv.connections
    want = ("error", 2, 1) if outcome == "error" else ((200, b"1"), 3, 2)
    assert run(go()) == want


def test_a_fresh_connection_closed_without_an_answer_is_an_error():
    async def go():
        async with Scripted([None]) as srv:
            with pytest.raises(UpstreamClosed, match="before any answer"):
                await Client().fetch("GET", srv.url, "/")
            return srv.connections
    assert run(go()) == 1


def test_an_abandoned_request_closes_its_connection():
    async def go():
        async with Scripted([], after="keep") as srv:
            client = Client()
            srv.answers = [b""]  # read the request, answer nothing
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await client.fetch("GET", srv.url, "/")
            await asyncio.wait_for(srv.eof_seen.wait(), 2.0)
            return client.idle_connections()
    assert run(go()) == 0


def test_a_slow_reader_pauses_the_socket_and_loses_nothing():
    parts = [bytes([65 + i % 26]) * 65536 for i in range(64)]  # 4 MiB

    async def go():
        async with Scripted([chunked(*parts)]) as srv:
            client = Client(max_buffer=256 * 1024)
            r = await client.request("GET", srv.url, "/")
            # do not read: the server fills the buffer until the socket is paused
            await until(lambda: r._paused, "paused the socket")
            buffered = r._buffered
            got = bytearray()
            while data := await r.chunk(2.0):
                got += data
            return buffered, bytes(got), client.idle_connections()
    buffered, got, idle = run(go())
    # paused once past the limit, at most one socket read over it (asyncio's transports
    # read up to 256 KiB at a time): far below the 4 MiB answer
    assert 256 * 1024 < buffered <= 256 * 1024 + 256 * 1024
    assert got == b"".join(parts) and idle == 1


def test_release_waits_for_the_end_of_a_finished_stream():
    # The last event arrives before the terminating chunk: release() keeps the connection
    # until the terminator comes, then pools it; a stream that never ends is closed.
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    event = b"e\r\ndata: [DONE]\n\n\r\n"

    async def go():
        async with Scripted([head + event]) as srv:
            client = Client()
            r = await client.request("GET", srv.url, "/")
            assert await r.readline(1.0) == b"data: [DONE]"
            r.release(grace_s=0.2)
            await until(lambda: r.error is not None, "gave up on the stream")
            never_ended = (r.complete, client.idle_connections())
        async with Scripted([(head + event, b"0\r\n\r\n")]) as srv:
            client = Client()
            r = await client.request("GET", srv.url, "/")
            assert await r.readline(1.0) == b"data: [DONE]"
            r.release(grace_s=60.0)
            srv.proceed.set()  # only now the terminator: the connection waits, then is pooled
            await until(lambda: r.complete or r.error is not None, "ended the stream")
            ended = (r.complete, r.error, client.idle_connections())
        return never_ended, ended
    never_ended, ended = run(go())
    assert never_ended == (False, 0)
    assert ended == (True, None, 1)


def test_https_upstreams_are_verified(tmp_path):
    import shutil
    import ssl
    import subprocess
    if shutil.which("openssl") is None:  # Debian and the CI image have it
        pytest.fail("the openssl command is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def go():
        async def serve(reader, writer):
            try:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(ok(b"over tls"))
                await writer.drain()
                await reader.read(1)
            except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                pass
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        trusted = Client(ssl_context=ssl.create_default_context(cafile=str(cert)))
        answer = await trusted.fetch("GET", url, "/")
        with pytest.raises(ssl.SSLCertVerificationError):
            await Client().fetch("GET", url, "/")  # the system store does not know this CA
        before = os.environ.get("SSL_CERT_FILE")
        os.environ["SSL_CERT_FILE"] = str(cert)  # how an operator names a private CA
        try:
            by_env = await Client().fetch("GET", url, "/")
        finally:
            if before is None:
                del os.environ["SSL_CERT_FILE"]
            else:
                os.environ["SSL_CERT_FILE"] = before
        trusted.close()
        server.close()
        return answer, by_env
    assert run(go()) == ((200, b"over tls"), (200, b"over tls"))


def test_idle_connections_after_a_burst_are_capped_newest_first():
    async def go():
        async with Scripted([ok(b"x")] * 4) as srv:
            client = Client(max_idle_per_host=3)
            answers = await asyncio.gather(*(client.fetch("GET", srv.url, "/")
                                             for _ in range(8)))
            return answers, client.idle_connections(), srv.connections
    answers, idle, connections = run(go())
    assert answers == [(200, b"x")] * 8 and connections == 8 and idle == 3


@given(st.lists(st.tuples(
    st.sampled_from(["content-length", "Content-Length", "x-content-length", "connection",
                     "transfer-encoding", "content-type", "content-length ", "x-note"]),
    st.sampled_from(["12", " 7", "0", "12 ", "x1", "", "chunked", "close", "\u0663",
                     "content-length: 3", "application/json"]),
    st.sampled_from([": ", ":", " : "])), max_size=5))
def test_the_plain_content_length_shortcut_reads_what_the_full_parse_reads(lines):
    fields = "\r\n".join(f"{name}{sep}{value}" for name, value, sep in lines).lower()
    length = _plain_length(fields.encode())
    if length is not None:
        assert _FRAMING_FIELDS.findall(fields) == [("content-length", str(length))]


class _Transport:
    def write(self, data):
        pass

    def abort(self):
        pass


def _answer_fed(answer: bytes, piece: int):
    """A Response's (status, headers, body, complete, connection pooled) after ``answer``
    arrives in pieces of ``piece`` bytes."""
    return run(_feed_answer(answer, piece))


async def _feed_answer(answer: bytes, piece: int):
    client = Client()
    conn = _Connection(client, ("http", "h", 80))
    conn.connection_made(_Transport())
    response = conn.send("POST", b"")
    for i in range(0, len(answer), piece):
        conn.data_received(answer[i:i + piece])
    pooled = client.idle_connections() == 1
    return response.status, response.headers, response.body_now(), response.complete, pooled


@given(st.lists(st.sampled_from(["date: x", "content-type: application/json",
                                 "Content-Length: {n}", "content-length: {n}",
                                 "x-thing: content-length", "connection: close",
                                 "connection: keep-alive"]), max_size=4),
       st.binary(max_size=40), st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n\r\n"]))
def test_a_whole_answer_in_one_piece_reads_as_it_does_piece_by_piece(fields, body, after):
    head = "\r\n".join(["HTTP/1.1 200 OK"] + [f.format(n=len(body)) for f in fields])
    answer = head.encode() + b"\r\n\r\n" + body + after
    assert _answer_fed(answer, len(answer)) == _answer_fed(answer, 1)
