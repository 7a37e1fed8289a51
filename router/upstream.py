"""The router's side of its conversations with replicas: probes, checks, forwarding.

All of it goes through one ``http1.Client`` (pooled keep-alive HTTP/1.1, see there for why
not a general client). Probes go out together under one deadline: each is written on a
pooled connection at once and its answer parsed as it arrives, without a task per probe;
whatever has not answered by the deadline counts as "no reuse known" (a late probe never
holds the request); its connection returns to the pool when the answer has come, or is
closed after ``probe_late_grace_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import orjson

from wire.probe import ProbeAnswer

from .http1 import Client, Response
from .settings import RouterSettings


@dataclass(slots=True)
class ProbeResult:
    """A replica's probe answer and its round trip."""

    answer: ProbeAnswer
    seconds: float


class ProbeFailed(Exception):
    pass


class Upstream:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        keepalive = settings.upstream_keepalive_s or (60.0 if settings.backend == "ours"
                                                      else 4.0)
        self.client = Client(settings.connect_timeout_s, keepalive_s=keepalive)
        self._internal = ({"authorization": f"Bearer {settings.internal_token}"}
                          if settings.internal_token else {})
        self._probe_headers = {"content-type": "application/json", **self._internal}
        self._probe_heads: dict[str, bytes] = {}  # replica -> Client.head() of its probes
        self._late: set[asyncio.Task] = set()  # probes past their deadline, still connecting

    async def close(self) -> None:
        for task in list(self._late):
            task.cancel()
        self.client.close()

    # -- probes ------------------------------------------------------------------------

    async def probe_all(self, urls: list[str], body: bytes,
                        traced: dict[str, dict[str, str]] | None = None
                        ) -> dict[str, ProbeResult | Exception]:
        """Probe ``urls`` concurrently; whatever has not answered by the deadline is
        abandoned (its connection closed) and reported as a TimeoutError. ``traced``:
        headers more per replica (``traceparent``), when the request is traced."""
        client, heads = self.client, self._probe_heads
        length = b"Content-Length: %d\r\n\r\n" % len(body)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        all_done = loop.create_future()
        remaining = 0

        def one_done(_) -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0 and not all_done.done():
                all_done.set_result(None)

        sent: list[tuple[str, Response]] = []  # on pooled connections: no task per probe
        opening: list[tuple[str, asyncio.Task]] = []  # a connection to open first
        out: dict[str, ProbeResult | Exception] = {}
        try:
            for url in urls:
                try:
                    head = heads.get(url)
                    if head is None:
                        head = heads[url] = client.head("POST", url, "/probe_reuse",
                                                        self._probe_headers)
                    # the body (21 KB for 4k tokens) is not copied into one buffer per probe
                    fields = length if traced is None else _fields(traced[url]) + length
                    response = client.start("POST", url, (head + fields, body))
                except (ValueError, OSError) as exc:
                    out[url] = exc
                    continue
                remaining += 1
                if response is not None:
                    response.on_done = one_done
                    sent.append((url, response))
                else:
                    task = loop.create_task(self._fetch_probe(
                        url, body, None if traced is None else traced[url]))
                    task.add_done_callback(one_done)
                    opening.append((url, task))
            if remaining:
                deadline = loop.call_later(self.settings.probe_deadline_ms / 1e3,
                                           lambda: all_done.done() or all_done.set_result(None))
                try:
                    await all_done
                finally:
                    deadline.cancel()
        finally:  # late probes (or all of them, if this request was cancelled) are abandoned
            for url, response in sent:
                response.on_done = None
                if response.complete:
                    out[url] = _probe_result(response.status, response.body_now(),
                                             response.done_at - t0)
                elif response.error is not None:
                    out[url] = response.error
                else:
                    # late, not lost: its small answer is on the way, and the connection
                    # goes back to the pool when it has come (closing it would make the
                    # next probe pay for a new connection, and a burst feed on itself)
                    response.release(self.settings.probe_late_grace_s)
                    out[url] = TimeoutError("probe deadline passed")
            for url, task in opening:
                if not task.done():  # late: it may finish (and pool its connection) alone
                    self._late.add(task)
                    task.add_done_callback(self._late_done)
                    out[url] = TimeoutError("probe deadline passed")
                elif task.cancelled():
                    out[url] = TimeoutError("probe cancelled")
                elif task.exception() is not None:
                    out[url] = task.exception()
                else:
                    status, raw = task.result()
                    out[url] = _probe_result(status, raw, time.perf_counter() - t0)
        return out

    async def warm(self, url: str) -> int:
        """Top up the idle connections kept open to ``url`` (``warm_connections``)."""
        n = self.settings.warm_connections
        return await self.client.warm(url, n) if n else 0

    async def _fetch_probe(self, url: str, body: bytes,
                           more: dict[str, str] | None = None) -> tuple[int, bytes]:
        """A probe on a new connection, given up after the deadline and the late grace."""
        s = self.settings
        headers = self._probe_headers if more is None else {**self._probe_headers, **more}
        async with asyncio.timeout(s.probe_deadline_ms / 1e3 + s.probe_late_grace_s):
            return await self.client.fetch("POST", url, "/probe_reuse", body,
                                           headers, repeatable=True)  # read-only

    def _late_done(self, task: asyncio.Task) -> None:
        self._late.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a late probe's failure is already counted

    # -- checks ------------------------------------------------------------------------

    async def get_json(self, url: str, timeout: float) -> tuple[int, dict | None]:
        """GET a replica's JSON resource; (status, body or None if not JSON)."""
        headers = dict(self._internal)
        if self.settings.backend == "openai" and self.settings.backend_api_key:
            headers["authorization"] = f"Bearer {self.settings.backend_api_key}"
        base, path = _split(url)
        async with asyncio.timeout(timeout):
            status, body = await self.client.fetch("GET", base, path, b"", headers)
        try:
            return status, json.loads(body) if body else None
        except ValueError:
            return status, None

    async def is_ready(self, url: str) -> tuple[bool, str]:
        path = "/ready" if self.settings.backend == "ours" else "/health"
        try:
            status, _ = await self.get_json(url + path, self.settings.health_timeout_s)
        except (TimeoutError, OSError, ValueError) as exc:
            return False, f"{path}: {type(exc).__name__}: {exc}".rstrip(": ")
        return status == 200, f"{path} answered {status}"

    # -- forwarding --------------------------------------------------------------------

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send a request and wait for the head of the answer; the caller reads the body
        (streamed) and closes the response."""
        return await self.client.request("POST", url, path, body, headers)


def _probe_result(status: int, raw: bytes, seconds: float) -> ProbeResult | ProbeFailed:
    """The probe's answer, or ProbeFailed saying why it is of no use."""
    if status != 200:
        return ProbeFailed(f"HTTP {status}")
    try:
        data = orjson.loads(raw)  # our replica's answer: small integers, no jsonwire checks
        return ProbeResult(ProbeAnswer.from_wire(data), seconds)
    except (ValueError, KeyError, TypeError) as exc:
        return ProbeFailed(f"unreadable probe answer: {type(exc).__name__}: {exc}")


def _fields(headers: dict[str, str]) -> bytes:
    """Header lines for a request head (our own trace headers: no line breaks)."""
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode("latin-1")


def _split(url: str) -> tuple[str, str]:
    """``http://h:p/a/b`` -> (``http://h:p``, ``/a/b``)."""
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host}", slash + path
