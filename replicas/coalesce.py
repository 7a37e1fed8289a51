"""uvicorn's HTTP protocol with writes coalesced per event-loop step.

uvicorn writes a response's status line and headers with one ``transport.write`` and its
body with another, so a small answer (a probe's, a short JSON body) leaves as two TCP
segments and wakes its reader twice: measured here, a router received each probe answer in
1.9 reads on average, and each read is a wake-up, a system call and a parse. Here the
writes made during one step of the event loop are joined and sent with one ``write`` at
the end of that step (``loop.call_soon``), which for a ready answer means head and body
together; a stream's later events still leave as they are produced.

A streamed response's head (chunked, so its body comes later) is held a little longer,
up to ``HEAD_HOLD_S``, for its first event: a stream that has its first event ready within
that time (a short prefill) then leaves as one segment instead of two, which spares its
reader (the router) a wake-up and a read per request, and the server a write. Nothing is
late for it: a client learns nothing from a stream's head alone, and a long prefill's
head still leaves after ``HEAD_HOLD_S``.

Used by ``python -m replicas``: ``uvicorn.Config(app, http=CoalescingHttpToolsProtocol,
...)``.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from wire.http10 import close_delimited


HEAD_HOLD_S = 0.02  # how long a streamed response's head waits for its first event


def _is_stream_head(data: bytes) -> bool:
    """Is ``data`` exactly a response head announcing a chunked (streamed) body?"""
    return data.startswith(b"HTTP/1.") and data.endswith(b"\r\n\r\n") and \
        b"\r\ntransfer-encoding: chunked\r\n" in data.lower()


class CoalescingTransport:
    """A transport whose writes during one loop step go out as one ``write`` (a streamed
    response's lone head: after up to ``HEAD_HOLD_S``, with what follows it by then);
    everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._flusher: asyncio.Handle | None = None
        self._holding = False  # the flusher is the head's timer, not this step's end

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._pending.append(data)
        if self._flusher is None:
            if len(data) < 4096 and _is_stream_head(data):
                self._flusher = self._loop.call_later(HEAD_HOLD_S, self._flush)
                self._holding = True
            else:
                self._flusher = self._loop.call_soon(self._flush)
        elif self._holding:  # the held head's first event: both leave at this step's end
            self._flusher.cancel()
            self._flusher = self._loop.call_soon(self._flush)
            self._holding = False

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def _unschedule(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()  # when called early (close, abort)
            self._flusher, self._holding = None, False

    def _flush(self) -> None:
        self._unschedule()
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()  # what was written before close() still goes out
        self._transport.close()

    def abort(self) -> None:
        self._unschedule()
        self._pending = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a ``CoalescingTransport``; a stream to an HTTP/1.0
    client delimited by the close (``wire.http10``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.parser.get_http_version() == "1.0":
            close_delimited(self.cycle)
