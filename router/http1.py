"""The router's HTTP/1.1 client for everything it sends to replicas.

The router's hot path is HTTP to its replicas: up to one probe per replica and one forwarded
request for every request it routes. General clients (aiohttp, httpx) spend most of their
time per request on machinery this traffic never needs (cookies, redirects, tracing hooks,
multipart, per-request objects by the dozen); measured here, that was most of the router's
CPU per request (BENCHMARKS.md, "router"). This client writes each request as one buffer
and parses the answer on an ``asyncio.Protocol`` as it arrives:

- keep-alive connections pooled per (scheme, host, port); a connection goes back to the pool
  as soon as its answer has been read in full, one that was abandoned half-way (a deadline, a
  client that left) is closed, which is also how a replica learns that nobody is listening
  (a caller may instead ``release`` an answer it knows is nearly over: the connection is
  pooled when it ends, as ``Upstream`` does with a late probe);
- bodies framed by ``Content-Length``, ``Transfer-Encoding: chunked`` (how uvicorn streams
  SSE) or the end of the connection; TLS through the event loop's own support;
- at most ``max_idle_per_host`` idle connections are kept per server (the newest), idle
  ones are dropped after ``keepalive_s`` (below the server's own keep-alive: the router
  passes 60 s for its replicas, 4 s for other servers, below uvicorn's 5 s), and a request
  that is safe to repeat (GET, HEAD, or one the caller marks ``repeatable``, as the router's
  probes)
  whose reused connection turns out to have been closed by the server before any byte of
  the answer came back is sent once more on a fresh connection; any other request fails
  with ``UpstreamClosed`` (the server may have read it: a completion must not run twice);
- a reader that falls behind pauses reading from the socket (``max_buffer`` bytes), so a
  slow client never makes the router buffer a whole answer.

Errors: ``OSError`` from connecting, ``UpstreamClosed`` (a ``ConnectionError``) when the
connection ends before the answer does, ``ProtocolError`` (also a ``ConnectionError``) for an
answer that is not HTTP/1.x; timeouts are the caller's (``asyncio.timeout``).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
_REPEATABLE = frozenset({"GET", "HEAD"})
MAX_CHUNK_LINE = 1024

# body framing
_LENGTH, _CHUNKED, _UNTIL_CLOSE, _NONE = range(4)
# the header fields that frame the body, read from the lower-cased header lines
_FRAMING_FIELDS = re.compile(r"^(content-length|transfer-encoding|connection)[ \t]*:[ \t]*"
                             r"(.*?)[ \t]*\r?$", re.M)
# chunked-body parser states
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


def _plain_length(fields: bytes) -> int | None:
    """The Content-Length of lower-cased header lines that frame their body with exactly one
    ``content-length: DIGITS`` line and name neither Transfer-Encoding nor Connection; None
    for anything else (which the general parse, ``_FRAMING_FIELDS``, then reads)."""
    if b"transfer-encoding" in fields or b"connection" in fields or \
            fields.count(b"content-length") != 1:
        return None
    start = fields.find(b"content-length: ")
    if start < 0 or (start and fields[start - 2:start] != b"\r\n"):
        return None
    end = fields.find(b"\r\n", start)
    value = fields[start + 16:] if end < 0 else fields[start + 16:end]
    return int(value) if value.isdigit() else None


class UpstreamClosed(ConnectionError):
    """The connection ended before the answer did."""


class ProtocolError(ConnectionError):
    """The server's answer is not HTTP/1.x as this client reads it."""


class Response:
    """One answer, read as it arrives. ``status`` and ``headers`` (lower-case names) are set
    once ``Client.request`` returns; the body is read with ``chunk``, ``read`` or
    ``readline``."""

    __slots__ = ("status", "_fields", "_headers", "complete", "_conn", "_method", "_head",
                 "_framing", "_left", "_chunk_state", "_raw", "_pieces", "_buffered", "_error",
                 "_head_waiter", "_body_waiter", "_paused", "got_bytes",
                 "_keep_alive", "done_at", "_lines", "_line_rest", "on_done")

    def __init__(self, conn: _Connection, method: str) -> None:
        self.status = 0
        self._fields = ""  # the header lines, unparsed
        self._headers: dict[str, str] | None = None
        self.complete = False
        self.got_bytes = False
        self.done_at = 0.0  # time.perf_counter() when the answer was complete
        self._conn: _Connection | None = conn
        self._method = method
        self._head = True  # still reading the status line and headers
        self._framing = _NONE
        self._left = 0  # Content-Length left, or bytes left in the current chunk
        self._chunk_state = _SIZE
        self._raw = b""  # bytes received but not parsed yet
        self._pieces: list[bytes] = []  # body bytes not read yet
        self._buffered = 0
        self._error: Exception | None = None
        self._head_waiter: asyncio.Future | None = None
        self._body_waiter: asyncio.Future | None = None
        self._paused = False
        self._keep_alive = True
        self._lines: deque[bytes] = deque()  # complete body lines not read yet (readline)
        self._line_rest = b""  # the start of an incomplete line
        # called (with this response) once the answer is complete or failed
        self.on_done: Callable[[Response], None] | None = None

    # -- the reader's side ---------------------------------------------------------------

    async def chunk(self, idle_timeout: float | None = None) -> bytes:
        """The body bytes that arrived since the last call (waiting up to ``idle_timeout``
        for some); ``b""`` once the body is complete."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            if self._conn is None:
                raise UpstreamClosed("the answer was closed before it was read")
            self._body_waiter = waiter = self._conn.loop.create_future()
            if idle_timeout is None:
                await waiter
            else:
                async with asyncio.timeout(idle_timeout):
                    await waiter
        pieces = self._pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._buffered = 0
        if self._paused and self._conn is not None:
            self._paused = False
            self._conn.resume()
        return data

    async def read(self, idle_timeout: float | None = None) -> bytes:
        """The rest of the body."""
        parts = []
        while data := await self.chunk(idle_timeout):
            parts.append(data)
        return b"".join(parts)

    async def readline(self, idle_timeout: float | None = None) -> bytes | None:
        """The next line of the body, without its line end (a last line without one too);
        None at the end of the body."""
        lines = self._lines
        while not lines:
            data = await self.chunk(idle_timeout)
            if not data:
                rest, self._line_rest = self._line_rest, b""
                return rest or None
            if self._line_rest:
                data = self._line_rest + data
            parts = data.split(b"\n")
            self._line_rest = parts.pop()
            lines.extend(parts)
        line = lines.popleft()
        return line[:-1] if line.endswith(b"\r") else line

    @property
    def error(self) -> Exception | None:
        """What ended the answer early (None while it is fine)."""
        return self._error

    def body_now(self) -> bytes:
        """The body of a complete answer, without waiting."""
        data = b"".join(self._pieces)
        self._pieces.clear()
        return data

    def close(self) -> None:
        """Done with this answer: an unfinished one closes its connection (the server sees
        the client leave); a finished one's connection is already back in the pool."""
        if not self.complete and self._conn is not None:
            self._conn.abort()
        self._conn = None

    def release(self, grace_s: float = 1.0) -> None:
        """Done with this answer, which the caller knows is over (say an SSE stream's last
        event came) though the end of its framing may not have arrived yet: the connection
        goes back to the pool when it does, and is closed if it has not within ``grace_s``."""
        if not self.complete and self._conn is not None:
            asyncio.get_running_loop().call_later(grace_s, self._give_up)

    def _give_up(self) -> None:
        if not self.complete and self._conn is not None:
            self._fail(UpstreamClosed("the answer did not end after its last event"))

    # -- the connection's side -------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self.got_bytes = True
        if self._head and not self._raw and data.startswith(b"HTTP/1.1 200 OK\r\n") and \
                self._method != "HEAD" and self._whole(data):
            return
        if self._head:
            data = self._raw + data if self._raw else data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > MAX_HEAD_BYTES:
                    return self._fail(ProtocolError(
                        f"response head longer than {MAX_HEAD_BYTES} bytes"))
                self._raw = data
                return
            self._raw = b""
            try:
                self._parse_head(data[:end])
            except ValueError as exc:
                return self._fail(ProtocolError(str(exc)))
            data = data[end + 4:]
            if self._head:  # an interim 1xx answer: the real head follows
                if data:
                    self._feed(data)
                return
            if self._head_waiter is not None and not self._head_waiter.done():
                self._head_waiter.set_result(None)
            if self._framing == _NONE or (self._framing == _LENGTH and self._left == 0):
                return self._finish(extra=bool(data))
            if not data:
                return
        framing = self._framing
        if framing == _LENGTH:
            if len(data) >= self._left:
                extra = len(data) > self._left
                self._push(data[:self._left] if extra else data)
                self._left = 0
                return self._finish(extra)
            self._left -= len(data)
            self._push(data)
        elif framing == _CHUNKED:
            self._feed_chunked(self._raw + data if self._raw else data)
        else:
            self._push(data)

    def _whole(self, data: bytes) -> bool:
        """The common answer in one piece (a probe's): ``200 OK``, framed by one plain
        Content-Length, nothing after its body. Taken without the general parse; False
        (nothing done) for anything else."""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return False
        fields = data[17:end]
        length = _plain_length(fields.lower())
        if length is None or len(data) != end + 4 + length:
            return False
        self.status, self._fields, self._head = 200, fields.decode("latin-1"), False
        self._framing = _LENGTH
        if length:
            self._pieces.append(data[end + 4:])
            self._buffered = length
        self._finish()  # wakes whoever waits for the head or the body
        return True

    def _parse_head(self, head: bytes) -> None:
        text = head.decode("latin-1")
        status_line, _, fields = text.partition("\r\n")
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit() or \
                rest[3:4] not in ("", " "):
            raise ValueError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status = int(code)
        if 100 <= status < 200 and status != 101:
            return  # interim: stay in the head
        # Only the framing fields are read now; the rest on demand (``headers``).
        framing = {}
        for name, value in _FRAMING_FIELDS.findall(fields.lower()):
            framing[name] = f"{framing[name]}, {value}" if name in framing else value
        self.status, self._fields, self._head = status, fields, False
        connection = framing.get("connection", "")
        if version == "HTTP/1.0":
            self._keep_alive = "keep-alive" in connection
        elif "close" in connection:
            self._keep_alive = False
        if self._method == "HEAD" or status in (204, 304):
            self._framing = _NONE
        elif "chunked" in framing.get("transfer-encoding", ""):
            self._framing = _CHUNKED
        elif "content-length" in framing:
            length = framing["content-length"]
            if not length.isdigit():
                raise ValueError(f"bad Content-Length {length!r}")
            self._framing, self._left = _LENGTH, int(length)
        else:
            self._framing, self._keep_alive = _UNTIL_CLOSE, False

    @property
    def headers(self) -> dict[str, str]:
        """The answer's headers, names in lower case (repeated ones joined with ", ")."""
        if self._headers is None:
            headers: dict[str, str] = {}
            for line in self._fields.split("\r\n"):
                name, sep, value = line.partition(":")
                if sep:
                    key, value = name.strip().lower(), value.strip()
                    headers[key] = f"{headers[key]}, {value}" if key in headers else value
            self._headers = headers
        return self._headers

    def _feed_chunked(self, data: bytes) -> None:
        pos, end = 0, len(data)
        while pos < end:
            state = self._chunk_state
            if state == _DATA:
                n = min(self._left, end - pos)
                self._push(data[pos:pos + n])
                pos += n
                self._left -= n
                if self._left == 0:
                    self._chunk_state = _DATA_END
            elif state == _DATA_END:
                if end - pos < 2:
                    break
                if data[pos:pos + 2] != b"\r\n":
                    return self._fail(ProtocolError("chunk data not followed by CRLF"))
                pos += 2
                self._chunk_state = _SIZE
            else:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > MAX_CHUNK_LINE:
                        return self._fail(ProtocolError("chunk size line too long"))
                    break
                line = data[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    if not line:  # the empty line after the trailers: the body is complete
                        self._raw = b""
                        return self._finish(extra=pos < end)
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    return self._fail(ProtocolError(f"bad chunk size line {line[:40]!r}"))
                if size < 0:
                    return self._fail(ProtocolError(f"bad chunk size line {line[:40]!r}"))
                if size == 0:
                    self._chunk_state = _TRAILER
                else:
                    self._chunk_state, self._left = _DATA, size
        self._raw = data[pos:] if pos < end else b""

    def _push(self, data: bytes) -> None:
        if not data:
            return
        self._pieces.append(data)
        self._buffered += len(data)
        waiter = self._body_waiter
        if waiter is not None:
            self._body_waiter = None
            if not waiter.done():
                waiter.set_result(None)
        if not self._paused and self._conn is not None and \
                self._buffered > self._conn.client.max_buffer:
            self._paused = True
            self._conn.pause()

    def _finish(self, extra: bool = False) -> None:
        self.complete = True
        self.done_at = time.perf_counter()
        conn, self._conn = self._conn, None
        self._wake(None)
        if conn is not None:
            if self._paused:
                conn.resume()
            conn.release(reusable=self._keep_alive and not extra)

    def _fail(self, exc: Exception) -> None:
        if self.complete or self._error is not None:
            return
        self._error = exc
        conn, self._conn = self._conn, None
        self._wake(exc)
        if conn is not None:
            conn.abort()

    def _eof(self, exc: Exception | None) -> None:
        """The connection ended."""
        if self.complete:
            return
        if not self._head and self._framing == _UNTIL_CLOSE and exc is None:
            self._conn = None
            self.complete = True
            self.done_at = time.perf_counter()
            self._wake(None)
            return
        where = "after part of the answer" if self.got_bytes else "before any answer"
        self._fail(UpstreamClosed(f"connection closed {where}" + (f": {exc}" if exc else "")))

    def _wake(self, exc: Exception | None) -> None:
        for waiter in (self._head_waiter, self._body_waiter):
            if waiter is not None and not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)
        self._body_waiter = None
        if self.on_done is not None:
            self.on_done(self)


class _Connection(asyncio.Protocol):
    def __init__(self, client: Client, key: tuple[str, str, int]) -> None:
        self.client = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        # (asyncio.get_running_loop() is a getpid() system call each time on Python 3.11)
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing was asked: the server is not speaking HTTP/1.1
            self.abort()
            return
        response._feed(data)

    def eof_received(self) -> bool:
        self.closed = True
        if self.response is not None:
            self.response._eof(None)
        return False  # let the transport close

    def connection_lost(self, exc) -> None:
        self.closed = True
        response, self.response = self.response, None
        if response is not None:
            response._eof(exc)

    def send(self, method: str, data: bytes | tuple[bytes, ...]) -> Response:
        self.response = response = Response(self, method)
        if type(data) is tuple:  # parts: written together without joining them first
            self.transport.writelines(data)
        else:
            self.transport.write(data)
        return response

    def release(self, reusable: bool) -> None:
        self.response = None
        if reusable and not self.closed:
            self.client._pool(self)
        else:
            self.abort()

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        self.response = None
        if self.transport is not None:
            self.transport.abort()


class Client:
    """Pooled HTTP/1.1 requests to base URLs (``http://host:port`` or ``https://...``)."""

    def __init__(self, connect_timeout: float = 1.0, keepalive_s: float = 4.0,
                 max_buffer: int = 1 << 20, ssl_context: ssl.SSLContext | None = None,
                 max_idle_per_host: int = 256) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.max_idle_per_host = max_idle_per_host
        self.max_buffer = max_buffer
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self.opened: dict[tuple[str, str, int], int] = {}  # connections opened, per server
        self._targets: dict[str, tuple[tuple[str, str, int], str, str]] = {}

    # -- requests ----------------------------------------------------------------------

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None,
                      repeatable: bool | None = None) -> Response:
        """Send a request and wait for the head of its answer (status and headers).

        ``repeatable``: whether the request may be sent once more on a fresh connection
        when its pooled connection closes before any byte of the answer (the server may
        have read it: a completion would run twice). Default: GET and HEAD only."""
        if repeatable is None:
            repeatable = method in _REPEATABLE
        data = self.encode(method, base_url, path, body, headers)
        for attempt in (0, 1):
            response = self.start(method, base_url, data) if attempt == 0 else None
            if response is None:
                conn = await self._connect(self._target(base_url)[0])
                response = conn.send(method, data)
            reused = response._conn.reused
            try:
                await self._head(response)
                return response
            except UpstreamClosed:
                if attempt == 0 and reused and not response.got_bytes and repeatable:
                    continue  # the server closed the idle connection as we sent: again, fresh
                raise
            except BaseException:
                response.close()
                raise
        raise AssertionError("unreachable")

    def start(self, method: str, base_url: str, data: bytes | tuple[bytes, ...]
              ) -> Response | None:
        """Send ``data`` (from ``encode``, or its parts in a tuple) on a pooled connection,
        without waiting; None when no pooled connection is ready (then use ``request``)."""
        conn = self._pooled(self._target(base_url)[0])
        return conn.send(method, data) if conn is not None else None

    async def fetch(self, method: str, base_url: str, path: str, body: bytes = b"",
                    headers: dict[str, str] | None = None,
                    repeatable: bool | None = None) -> tuple[int, bytes]:
        """A whole answer: (status, body)."""
        response = await self.request(method, base_url, path, body, headers, repeatable)
        try:
            return response.status, await response.read()
        finally:
            response.close()

    def encode(self, method: str, base_url: str, path: str, body: bytes = b"",
               headers: dict[str, str] | None = None) -> bytes:
        """The request's bytes: request line, headers, body."""
        return (self.head(method, base_url, path, headers)
                + b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def head(self, method: str, base_url: str, path: str,
             headers: dict[str, str] | None = None) -> bytes:
        """The request line and headers, all but ``Content-Length`` and the blank line that
        ends them (a caller sending many bodies to one place keeps this)."""
        _, host, prefix = self._target(base_url)
        head = f"{method} {prefix}{path} HTTP/1.1\r\nHost: {host}\r\n"
        if headers:
            for name, value in headers.items():
                if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                    raise ValueError(f"header {name!r} contains a line break")
                head += f"{name}: {value}\r\n"
        return head.encode("latin-1")

    async def _head(self, response: Response) -> None:
        if not response._head:
            return
        if response._error is not None:
            raise response._error
        response._head_waiter = response._conn.loop.create_future()
        await response._head_waiter

    # -- connections -------------------------------------------------------------------

    def _target(self, base_url: str) -> tuple[tuple[str, str, int], str, str]:
        """(pool key, Host header, path prefix) of a base URL."""
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https"):
                raise ValueError(f"not an http:// or https:// URL: {base_url}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            host = parts.hostname or "127.0.0.1"
            key = (parts.scheme, host, port)
            target = (key, parts.netloc, parts.path.rstrip("/"))
            self._targets[base_url] = target
        return target

    def _pooled(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        cutoff = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if conn.idle_since < cutoff:
                conn.abort()
                continue
            conn.reused = True
            return conn
        return None

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        context = None
        if scheme == "https":
            context = self._ssl or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(lambda: _Connection(self, key), host, port,
                                                   ssl=context,
                                                   server_hostname=host if context else None)
        self.opened[key] = self.opened.get(key, 0) + 1
        return conn

    def _pool(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = []
        elif len(idle) >= self.max_idle_per_host:  # after a burst: keep the newest
            idle[:] = [c for c in idle if not c.closed]
            while len(idle) >= self.max_idle_per_host:
                idle.pop(0).abort()
        idle.append(conn)

    async def warm(self, base_url: str, n: int) -> int:
        """Open connections to ``base_url`` until ``n`` idle ones are ready in its pool (a
        burst of requests then sends at once instead of connecting first); returns how many
        were opened. A connection that cannot be opened is skipped (the next call tries
        again)."""
        key = self._target(base_url)[0]
        cutoff = time.monotonic() - self.keepalive_s
        idle = self._idle.get(key, ())
        ready = sum(1 for c in idle if not c.closed and c.idle_since >= cutoff)
        if ready >= n:
            return 0
        opened = await asyncio.gather(*(self._connect(key) for _ in range(n - ready)),
                                      return_exceptions=True)
        count = 0
        for conn in opened:
            if isinstance(conn, _Connection):
                self._pool(conn)
                count += 1
        return count

    def opened_to(self, base_url: str) -> int:
        """Connections opened to ``base_url`` so far."""
        return self.opened.get(self._target(base_url)[0], 0)

    def idle_connections(self) -> int:
        return sum(1 for conns in self._idle.values() for c in conns if not c.closed)

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
