"""A minimal HTTP/1.1 client for probes: pooled keep-alive connections, one request each.

Probes are the router's hottest path (up to one per replica per request) and tiny: a
small POST and a small JSON answer with ``Content-Length``. A general client spends most of
its time on machinery a probe never needs (chunked bodies, redirects, cookies, tracing), so
this one writes the request bytes and parses the status line, headers and body itself, on
an ``asyncio.Protocol``. A connection whose request was cancelled (a missed deadline) or
that broke is closed, never reused.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class ProbeHTTPError(Exception):
    pass


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._waiter is None or self._waiter.done():
            return
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        try:
            status, length, keep = _parse_head(bytes(self._buffer[:head_end]))
        except ValueError as exc:
            self._waiter.set_exception(ProbeHTTPError(str(exc)))
            return
        end = head_end + 4 + length
        if len(self._buffer) < end:
            return
        body = bytes(self._buffer[head_end + 4:end])
        del self._buffer[:end]
        if not keep:
            self.closed = True
        self._waiter.set_result((status, body))

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ProbeHTTPError(f"connection lost: {exc}"))

    async def request(self, data: bytes) -> tuple[int, bytes]:
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self._waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _parse_head(head: bytes) -> tuple[int, int, bool]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {lines[0][:60]!r}")
    status, length, keep = int(parts[1]), None, True
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection" and value.strip().lower() == b"close":
            keep = False
        elif name == b"transfer-encoding":
            raise ValueError("chunked probe answers are not supported")
    if length is None:
        raise ValueError("probe answer without Content-Length")
    return status, length, keep


class ProbeClient:
    """``await client.post(base_url, path, body, headers) -> (status, body)``."""

    def __init__(self, connect_timeout: float = 1.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        host, port = _host_port(base_url)
        conn = await self._acquire(host, port)
        head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}",
                "Content-Type: application/json", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        try:
            result = await conn.request(data)
        except BaseException:
            conn.close()  # cancelled or broken mid-request: the stream is in an unknown state
            raise
        if conn.closed:
            conn.close()
        else:
            self._idle.setdefault((host, port), []).append(conn)
        return result

    async def _acquire(self, host: str, port: int) -> _Connection:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(_Connection, host, port)
        return conn

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()


def _host_port(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    if parts.scheme != "http":
        raise ProbeHTTPError(f"probes need plain http:// replicas, got {base_url}")
    return parts.hostname or "127.0.0.1", parts.port or 80
