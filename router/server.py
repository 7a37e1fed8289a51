"""The router's HTTP/1.1 server: the proxy endpoints answered natively, the rest over ASGI.

The router's CPU per request is its cost in production (it serves every request of the
cluster), and under uvicorn a routed request paid for a general ASGI server twice over: the
request/response cycle (scope, message events, a task, flow control, keep-alive timers) and,
on top of it, a second task per request watching ``receive()`` for a disconnect so that a
client that leaves cancels its upstream request. Here the proxy endpoints (``routes``) are
called directly from the connection: one task per request, the whole body, the client's
headers, and an ASGI-style ``send``; losing the connection cancels that task, so no watcher
is needed. Every other path (``/stats``, ``/metrics``, the dashboard, the admin API,
``/docs``) goes to the FastAPI app through a small ASGI bridge. Measured in
BENCHMARKS.md ("router").

What it speaks: HTTP/1.1 and 1.0 over TCP; keep-alive (a connection idle for
``keepalive_s`` is closed); pipelined requests answered in order (reading pauses while one
waits); ``Expect: 100-continue``; request bodies framed by ``Content-Length`` or chunked,
refused with 413 over ``max_body_bytes`` (before reading them when announced); request heads
over ``MAX_HEAD_BYTES`` refused with 431; responses framed by ``Content-Length`` or chunked;
back-pressure from slow readers (a streamed body waits while the socket's buffer is full);
graceful shutdown on SIGINT/SIGTERM (stop accepting, finish what runs for up to
``grace_s``, a second signal stops at once). Not spoken: TLS (terminate it in front),
HTTP/2, protocol upgrades such as WebSocket (400).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
import signal
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import httptools

from replicas.asgi import send_error
from replicas.errors import APIError, too_large

log = logging.getLogger("router.server")

Send = Callable[[dict], Awaitable[None]]
# ``handler(headers, body, send)``: the client's headers (names in lower case), its whole
# body, and an ASGI-style send (``http.response.start``, then ``http.response.body``).
Handler = Callable[[list[tuple[bytes, bytes]], bytes, Send], Awaitable[None]]

MAX_HEAD_BYTES = 64 * 1024  # request line and headers together
LINGER_S = 2.0  # after a refusal, how long the client's last bytes are read and dropped
_TOO_MANY_BODY = (b'{"error": {"message": "too many connections", "type": "server_error", '
                  b'"param": null, "code": "too_many_connections"}}')
_TOO_MANY_CONNECTIONS = (  # written as a connection past max_connections is accepted
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%b"
    % (len(_TOO_MANY_BODY), _TOO_MANY_BODY))
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a field name (RFC 9110 token)
_BAD_VALUE = re.compile(rb"[\r\n\x00]")
_NO_BODY = frozenset((204, 304)) | frozenset(range(100, 200))
_REASONS: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _REASONS.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _REASONS[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")
    return line


class _Refuse(Exception):
    """Raised from a parser callback: answer ``status`` and close the connection."""

    def __init__(self, err: APIError) -> None:
        self.err = err


class _Request:
    __slots__ = ("method", "url", "headers", "parts", "size", "keep_alive", "head_request",
                 "http10", "trailer_size", "begun", "progressed")

    def __init__(self) -> None:
        self.method: bytes | None = None  # set once the head is complete
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.parts: list[bytes] = []
        self.size = 0  # head bytes while the head is read, then body bytes
        self.trailer_size = 0


class HTTPServer:
    def __init__(self, app, routes: dict[tuple[str, str], Handler], max_body_bytes: int,
                 keepalive_s: float = 75.0, grace_s: float = 30.0, head_timeout_s: float = 10.0,
                 body_timeout_s: float = 30.0, max_connections: int = 10_000) -> None:
        """``app``: the ASGI app for every request ``routes`` (``(method, path)``) does not
        answer."""
        self.app = app
        self.routes = {(m.encode(), p.encode()): h for (m, p), h in routes.items()}
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        # Against clients that hold connections by sending slowly (each byte restarts the
        # idle timer): a request head must be complete this long after its first byte, a
        # body must make progress this often, and connections past the cap are refused.
        self.head_timeout_s = head_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_connections = max_connections
        self.grace_s = grace_s
        self.connections: set[_Connection] = set()
        self.stopping = False
        self.date_header = b""
        self._stop: asyncio.Future | None = None
        self._refresh_date()

    def _refresh_date(self) -> None:
        self.date_header = b"date: " + email.utils.formatdate(usegmt=True).encode() + b"\r\n"

    async def serve(self, host: str, port: int, sock=None) -> None:
        """Serve until ``stop()`` (or SIGINT/SIGTERM), then shut down gracefully."""
        loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        if sock is not None:
            server = await loop.create_server(lambda: _Connection(self), sock=sock,
                                              backlog=2048)
        else:
            server = await loop.create_server(lambda: _Connection(self), host, port,
                                              backlog=2048)
        signals = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal)
                signals.append(sig)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        for bound in (s.getsockname() for s in server.sockets):
            address = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
            log.info("router listening on http://%s:%d", address, bound[1])
        ticker = loop.create_task(self._tick())
        try:
            await self._stop
            server.close()
            await self._finish(self.grace_s)
        finally:
            server.close()
            for sig in signals:
                loop.remove_signal_handler(sig)
            ticker.cancel()

    def _on_signal(self) -> None:
        """SIGINT/SIGTERM: the first stops gracefully, another closes everything now."""
        if self._stop is not None and self._stop.done():
            log.info("signalled again: closing every connection now")
            self._abort_all()
        else:
            self.stop()

    def stop(self) -> None:
        """Begin a graceful shutdown: no new connections; running requests finish."""
        if self._stop is not None and not self._stop.done():
            log.info("shutting down: finishing %d busy connection(s), up to %.0f s",
                     sum(c.busy for c in self.connections), self.grace_s)
            self._stop.set_result(None)

    async def _finish(self, grace_s: float) -> None:
        self.stopping = True
        for conn in list(self.connections):
            if not conn.busy:
                conn.close()
        deadline = time.monotonic() + grace_s
        while any(c.busy for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._abort_all()

    def _abort_all(self) -> None:
        for conn in list(self.connections):
            conn.abort()

    async def _tick(self) -> None:
        """Once a second: the Date header, and closing connections idle too long."""
        while True:
            await asyncio.sleep(1.0)
            self._refresh_date()
            now = time.monotonic()
            cutoff = now - self.keepalive_s
            for conn in list(self.connections):
                if conn.req is not None:
                    conn.check_progress(now)
                elif not conn.busy and conn.last_active < cutoff:
                    conn.close()


class _Connection(asyncio.Protocol):
    """One client connection: parses requests and answers them one at a time, in order."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple | None = None
        self.local: tuple | None = None
        self.last_active = time.monotonic()
        self.closed = False
        self.refused = False  # an unreadable request was refused: nothing more is read
        self.last_request_read = False  # it said Connection: close (or was HTTP/1.0)
        self.req: _Request | None = None  # being read
        self.waiting: deque[_Request] = deque()  # read, behind the one being answered
        self.task: asyncio.Task | None = None  # answering a request
        self._native = False  # the task runs a route handler (cancelled if the client leaves)
        self._lost: asyncio.Future | None = None  # for the ASGI bridge's http.disconnect
        self._writable: asyncio.Future | None = None  # set while the socket buffer is full
        # the response being written
        self._head = b""  # status line and headers, sent with the first body bytes
        self._started = self._finished = self._chunked = self._keep_alive = False
        self._head_request = self._http10 = False

    @property
    def busy(self) -> bool:
        return self.task is not None

    # -- connection --------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.client = transport.get_extra_info("peername")
        self.local = transport.get_extra_info("sockname")
        if len(self.server.connections) >= self.server.max_connections:
            self.refused = True
            transport.write(_TOO_MANY_CONNECTIONS)
            self.linger()
            return
        self.server.connections.add(self)

    def check_progress(self, now: float) -> None:
        """A request being read: refuse it (408) if its head or body is too slow."""
        req, server = self.req, self.server
        if self.refused or self.closed:
            return
        if req.method is None and now - req.begun > server.head_timeout_s:
            self._refuse(APIError(408, f"request head not complete within "
                                       f"{server.head_timeout_s:g} s", code="request_timeout"))
        elif req.method is not None and now - req.progressed > server.body_timeout_s:
            self._refuse(APIError(408, f"request body made no progress for "
                                       f"{server.body_timeout_s:g} s", code="request_timeout"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.task is not None and self._native and not self._finished:
            self.task.cancel()  # the client left: its upstream request ends too
        for future in (self._lost, self._writable):
            if future is not None and not future.done():
                future.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None:
            if not self._writable.done():
                self._writable.set_result(None)
            self._writable = None

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if not self.closed and self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.refused or self.last_request_read:
            return  # read and dropped until the close
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if not isinstance(refused, _Refuse):
                raise
            self._refuse(refused.err)
        except httptools.HttpParserError as exc:
            if not self.last_request_read:  # else: bytes after the last request, dropped
                self._refuse(APIError(400, f"malformed HTTP request: {exc}"))

    def _refuse(self, err: APIError) -> None:
        """Answer an unreadable request and close: what follows it cannot be framed. Until
        the close, what arrives is read and dropped (left unread, it would make the close a
        reset, which can destroy the answer on its way to the client)."""
        self.refused = True
        self.transport.resume_reading()  # paused if requests were pipelined
        self.waiting.clear()  # pipelined behind the response being written: never answered
        if self.task is not None:  # the refusal follows the response being written
            self.task.add_done_callback(lambda _: self._send_refusal(err))
        else:
            self._send_refusal(err)

    def _send_refusal(self, err: APIError) -> None:
        if self.closed:
            return
        self._response_for(False, keep_alive=False)
        self.task = self.loop.create_task(send_error(self.send, err))
        self.task.add_done_callback(lambda _: self.linger())

    def linger(self) -> None:
        """Close after a refusal without losing it: end our side now (the answer, then a
        FIN), read and drop what the client still sends, and close once it closes too or
        after ``LINGER_S``. Closing at once would answer its next bytes with a reset, which
        can destroy the refusal before the client has read it."""
        if self.closed:
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.close)
        else:
            self.close()

    # -- parser callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.req = _Request()
        self.req.begun = self.req.progressed = self.last_active

    def on_url(self, url: bytes) -> None:
        req = self.req
        req.url += url
        req.size += len(url)
        if req.size > MAX_HEAD_BYTES:
            raise _Refuse(APIError(431, f"request head larger than {MAX_HEAD_BYTES} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self.req
        if req.method is not None:
            # A trailer field of a chunked body: dropped (RFC 9110 lets a recipient discard
            # trailers; taking them as headers would let a body smuggle them), bounded alone.
            req.trailer_size += len(name) + len(value)
            if req.trailer_size > MAX_HEAD_BYTES:
                raise _Refuse(APIError(431, f"request trailers larger than {MAX_HEAD_BYTES} "
                                            "bytes"))
            return
        req.headers.append((name.lower(), value))
        req.size += len(name) + len(value)
        if req.size > MAX_HEAD_BYTES:
            raise _Refuse(APIError(431, f"request head larger than {MAX_HEAD_BYTES} bytes"))

    def on_headers_complete(self) -> None:
        req, parser = self.req, self.parser
        if parser.should_upgrade():
            raise _Refuse(APIError(400, "protocol upgrades (WebSocket, h2c) are not supported"))
        req.method = parser.get_method()
        req.http10 = parser.get_http_version() != "1.1"
        # HTTP/1.0: one request per connection, a body without a length ends at the close
        req.keep_alive = parser.should_keep_alive() and not req.http10
        req.head_request = req.method == b"HEAD"
        req.progressed = self.last_active
        req.size = 0
        expect = False
        limit = self.server.max_body_bytes
        for name, value in req.headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise _Refuse(too_large(limit))
            if name == b"expect" and value.lower() == b"100-continue":
                expect = True
        # HTTP/1.0 has no 100 Continue: such a client sends its body anyway
        if expect and not req.http10 and self.task is None and not self.waiting:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        req = self.req
        req.progressed = self.last_active
        req.parts.append(body)
        req.size += len(body)
        if req.size > self.server.max_body_bytes:
            raise _Refuse(too_large(self.server.max_body_bytes))

    def on_message_complete(self) -> None:
        req, self.req = self.req, None
        # After a request that ends the connection (Connection: close, HTTP/1.0) nothing
        # more is a request: the parser would call it malformed and earn it a second answer.
        self.last_request_read = not req.keep_alive
        if self.task is None:
            self._answer(req)
        else:  # pipelined: answered when the one before it is; read no further till then
            self.waiting.append(req)
            self.transport.pause_reading()

    # -- answering ---------------------------------------------------------------------

    def _answer(self, req: _Request) -> None:
        path, _, query = req.url.partition(b"?")
        handler = self.server.routes.get((req.method, path))
        keep_alive = req.keep_alive and not self.server.stopping
        self._response_for(req.head_request, keep_alive, req.http10)
        body = req.parts[0] if len(req.parts) == 1 else b"".join(req.parts)
        if handler is not None:
            self._native = True
            self.task = self.loop.create_task(self._run(handler, req.headers, body, path))
        else:
            self._native = False
            self.task = self.loop.create_task(self._bridge(req, path, query, body))
        self.task.add_done_callback(self._answered)

    def _answered(self, _task) -> None:
        self.task = None
        self.last_active = time.monotonic()
        if self.closed or self.refused:  # a refusal (_send_refusal) follows, then the close
            return
        if not (self._finished and self._keep_alive) or self.server.stopping:
            self.close()
        elif self.waiting:
            self._answer(self.waiting.popleft())
            if not self.waiting:
                self.transport.resume_reading()
        else:
            self.transport.resume_reading()

    def _response_for(self, head_request: bool, keep_alive: bool, http10: bool = False) -> None:
        self._head = b""
        self._unsent: int | None = None  # body bytes the declared Content-Length still owes
        self._started = self._finished = self._chunked = False
        self._head_request, self._keep_alive, self._http10 = head_request, keep_alive, http10

    async def _internal_error(self) -> None:
        """The 500 for a request whose handler failed (or said nothing) before answering."""
        await send_error(self.send, APIError(500, "internal error", type="server_error"))

    async def _run(self, handler: Handler, headers, body: bytes, path: bytes) -> None:
        try:
            await handler(headers, body, self.send)
            if not self._started:
                log.error("the handler of %s returned no response", path.decode("latin-1"))
                await self._internal_error()
        except APIError as err:
            if not self._started:
                await send_error(self.send, err)
        except asyncio.CancelledError:
            if not self.closed:
                raise  # cancelled from elsewhere (the server stopping)
        except Exception:
            log.exception("unhandled error on %s", path.decode("latin-1"))
            if not self._started:
                await self._internal_error()

    async def _bridge(self, req: _Request, path: bytes, query: bytes, body: bytes) -> None:
        """One request to the ASGI app."""
        path_text = path.decode("latin-1")
        if "%" in path_text:
            path_text = urllib.parse.unquote(path_text)
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.0" if req.http10 else "1.1",
            "server": self.local, "client": self.client, "scheme": "http",
            "method": req.method.decode("ascii"), "root_path": "", "path": path_text,
            "raw_path": path, "query_string": query, "headers": req.headers,
        }
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            if not self.closed:  # the app waits for the client to leave
                if self._lost is None:
                    self._lost = self.loop.create_future()
                await self._lost
            return {"type": "http.disconnect"}

        try:
            await self.server.app(scope, receive, self.send)
        except Exception:
            log.exception("unhandled error on %s", path_text)
            if not self._started:
                await self._internal_error()
            return
        if not self._started:
            log.error("the app returned no response to %s %s", scope["method"], path_text)
            await self._internal_error()

    async def send(self, message: dict) -> None:
        """ASGI ``send`` for the response being written."""
        kind = message["type"]
        if kind == "http.response.body":
            if not self._started or self._finished:
                raise RuntimeError("http.response.body outside a response")
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if self._unsent is not None:  # framed by the Content-Length the app declared
                self._unsent -= len(body)
                if self._unsent < 0:
                    self._keep_alive = False
                    raise RuntimeError("response body longer than its Content-Length")
                if not more and self._unsent:
                    log.error("response body %d bytes short of its Content-Length: the "
                              "connection closes after it", self._unsent)
                    self._keep_alive = False
            if self._head_request:
                body = b""
            elif self._chunked:
                body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + \
                    (b"" if more else b"0\r\n\r\n")
            if self._head:
                body, self._head = self._head + body, b""
            if not more:
                self._finished = True
            if body and not self.closed:
                self.transport.write(body)
                if more and self._writable is not None:
                    await self._writable
        elif kind == "http.response.start":
            if self._started:
                raise RuntimeError("http.response.start sent twice")
            status = message["status"]
            head = [_status_line(status), self.server.date_header]
            length = False
            for name, value in message.get("headers", ()):
                if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
                    raise ValueError(f"response header {name!r}: {value!r} is not a valid "
                                     "field (a token name; a value without CR, LF or NUL)")
                low = name.lower()
                if low == b"content-length":
                    if not value.isdigit():
                        raise ValueError(f"response Content-Length {value!r} is not a number")
                    length = True
                    self._unsent = None if self._head_request else int(value)
                elif low in (b"connection", b"transfer-encoding"):
                    continue  # framing is this server's
                head += (name, b": ", value, b"\r\n")
            if not length and status not in _NO_BODY and not self._http10:
                self._chunked = True
                head.append(b"transfer-encoding: chunked\r\n")
            if not self._keep_alive:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            self._head = b"".join(head)
            self._started = True  # after the checks: a refused head leaves room for a 500
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
