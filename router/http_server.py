"""The router's HTTP server: uvicorn (httptools) with the limits a front door needs.

uvicorn parses and frames HTTP/1.1 (keep-alive, pipelining, chunked bodies, ``Expect:
100-continue``, graceful shutdown, back-pressure); the router's endpoints are one raw ASGI
app (``router/asgi.py``). Until issue 15 the router had an HTTP server of its own; the
interleaved A/B that retired it (router CPU per request at k = 8: own 1.27 ms, uvicorn
1.20 ms, granian 1.39 ms) is in BENCHMARKS.md ("router").

What ``FrontDoorProtocol`` adds to uvicorn's protocol, each answered with an OpenAI-style
error body and ``connection: close``, after which the connection lingers (the client's
last bytes are read and dropped for ``LINGER_S``, so that a client still sending gets the
answer instead of a reset):

- a request head must be complete ``head_timeout_s`` after its first byte (408): a head
  trickled in a byte at a time no longer holds a connection for ever;
- a request body must make progress every ``body_timeout_s`` (408), unless the router
  itself stopped reading (back-pressure, a pipelined request waiting its turn);
- heads over ``MAX_HEAD_BYTES`` (431) and bodies over ``max_body_bytes`` (413, before
  reading when announced) on every path;
- connections past ``max_connections`` get a 503 as they are accepted;
- request trailers are read and dropped (bounded by ``MAX_HEAD_BYTES``), never added to the
  headers the app already has; an HTTP/1.0 client gets no ``100 Continue``, and an answer
  of unknown length (a stream) delimited by the close, not chunked; a protocol
  upgrade (WebSocket) is refused (400) and a request the parser rejects gets a 400 with a
  JSON body instead of uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from wire.errors import APIError, error_headers, too_large
from wire.http10 import close_delimited

MAX_HEAD_BYTES = 64 * 1024  # request line and header fields together; trailers alike
LINGER_S = 2.0  # after a refusal, how long the client's last bytes are read and dropped


class _Refuse(Exception):
    """Raised from a parser callback: answer ``err`` and close the connection."""

    def __init__(self, err: APIError) -> None:
        self.err = err


class FrontDoorProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (``protocol_class`` sets them)."""

    head_timeout_s = 10.0
    body_timeout_s = 30.0
    max_connections = 10_000
    max_body_bytes = 16 * 1024 * 1024

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None  # the head or body deadline
        self._in_head = False
        self._head_bytes = 0  # of the head being read, or of the trailers
        self._body_bytes = 0
        self._progress_at = 0.0  # when the body last moved
        self._lingering = False
        self._refusal: APIError | None = None  # to answer once the running answer is out

    # -- connection ----------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(APIError(503, "too many connections", type="server_error",
                                  code="too_many_connections", headers={"Retry-After": "1"}))

    def connection_lost(self, exc) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the last bytes of a client that was refused: dropped
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__ if isinstance(exc.__context__, _Refuse) else None
            self._refuse(refusal.err if refusal else APIError(400, "invalid HTTP request"))
        except httptools.HttpParserUpgrade:
            self._refuse(APIError(400, "protocol upgrades (WebSocket) are not served here"))
        except httptools.HttpParserError as exc:
            self._refuse(APIError(400, f"invalid HTTP request: {exc}"))

    # -- parser callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._body_bytes = True, 0, 0
        self._arm(self.head_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        if self._in_head:
            super().on_header(name, value)
        # else a trailer field: counted (bounded) and dropped

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._cancel_timer()
        if self.parser.should_upgrade():
            raise _Refuse(APIError(400, "protocol upgrades (WebSocket) are not served here"))
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit() and \
                    int(value) > self.max_body_bytes:
                raise _Refuse(too_large(self.max_body_bytes))
        super().on_headers_complete()
        if self.parser.get_http_version() == "1.0":
            self.cycle.waiting_for_100_continue = False  # 100 Continue is HTTP/1.1
            close_delimited(self.cycle)
        self._progress_at = self.loop.time()
        self._arm(self.body_timeout_s)  # cancelled when the message is complete

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.max_body_bytes:
            raise _Refuse(too_large(self.max_body_bytes))
        self._progress_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_timer()
        super().on_message_complete()

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            what = "request head" if self._in_head else "request trailers"
            raise _Refuse(APIError(431, f"{what} over {MAX_HEAD_BYTES} bytes",
                                   code="header_too_large"))

    # -- deadlines -----------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(seconds, self._deadline)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deadline(self) -> None:
        self._timer = None
        if self._in_head:
            return self._refuse(APIError(408, f"request head not complete within "
                                              f"{self.head_timeout_s:g} s",
                                         code="request_timeout"))
        idle = self.loop.time() - self._progress_at
        if self.flow.read_paused:  # the router stopped reading, not the client
            self._progress_at = self.loop.time()
            idle = 0.0
        if idle < self.body_timeout_s:
            self._timer = self.loop.call_later(self.body_timeout_s - idle, self._deadline)
            return
        self._refuse(APIError(408, f"request body made no progress for "
                                   f"{self.body_timeout_s:g} s", code="request_timeout"))

    # -- refusals ------------------------------------------------------------------------

    def _refuse(self, err: APIError) -> None:
        """Answer ``err`` (unless an answer already started), then linger and close. A
        request received whole and still being answered is answered first (what follows
        it is what was refused)."""
        self._cancel_timer()
        if self._lingering or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            self._refusal = err
            self.pipeline.clear()
            self.flow.pause_reading()
            return
        started = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() now says the client left
            cycle.message_event.set()
        self.pipeline.clear()
        if started:  # half an answer is out: nothing valid can follow it
            self.transport.close()
            return
        body = json.dumps(err.body()).encode()
        head = [STATUS_LINE[err.status],
                *(b"%s: %s\r\n" % pair for pair in self.server_state.default_headers),
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body)]
        head += [f"{k.lower()}: {v}\r\n".encode("latin-1")
                 for k, v in error_headers(err).items()]
        self.transport.write(b"".join(head) + b"connection: close\r\n\r\n" + body)
        self._linger()

    def on_response_complete(self) -> None:
        if self._refusal is not None:
            self.server_state.total_requests += 1
            err, self._refusal = self._refusal, None
            return self._refuse(err)
        super().on_response_complete()

    def _linger(self) -> None:
        """End our side, read and drop what the client still sends, close after LINGER_S."""
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)


def protocol_class(max_body_bytes: int, head_timeout_s: float, body_timeout_s: float,
                   max_connections: int) -> type[FrontDoorProtocol]:
    """``FrontDoorProtocol`` with these limits (uvicorn builds protocols from a class)."""
    return type("FrontDoorProtocol", (FrontDoorProtocol,), {
        "max_body_bytes": max_body_bytes, "head_timeout_s": head_timeout_s,
        "body_timeout_s": body_timeout_s, "max_connections": max_connections})


def config(app, settings, **overrides) -> uvicorn.Config:
    """The uvicorn configuration of a router serving ``app`` (an ASGI app) under
    ``settings`` (``RouterSettings``)."""
    options = dict(
        host=settings.host, port=settings.port, loop="none", lifespan="off", ws="none",
        http=protocol_class(settings.max_body_bytes, settings.head_timeout_s,
                            settings.body_timeout_s, settings.max_connections),
        access_log=False, log_level=settings.log_level.lower(), server_header=False,
        proxy_headers=False,  # the router reads no client address
        timeout_keep_alive=settings.keepalive_s,
        timeout_graceful_shutdown=settings.shutdown_grace_s)
    options.update(overrides)
    return uvicorn.Config(app, **options)


async def serve(app, settings, sockets=None) -> None:
    """Serve ``app`` until SIGINT/SIGTERM (a second signal stops at once), finishing the
    requests that run for up to ``shutdown_grace_s``."""
    server = uvicorn.Server(config(app, settings))
    # uvicorn's own handlers re-raise a captured SIGINT/SIGTERM once it has stopped (exit
    # 130 for a clean stop) and force the stop only on a second SIGINT: these stop it the
    # same way on either signal, at once on the second
    server.capture_signals = contextlib.nullcontext

    def on_signal() -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await server.serve(sockets=sockets)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
