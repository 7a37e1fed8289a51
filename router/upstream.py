"""The router's side of its conversations with replicas: probes, checks, forwarding.

All of it goes through one ``http1.Client`` (pooled keep-alive HTTP/1.1, see there for why
not a general client). Probes go out together under one deadline: each is written on a
pooled connection at once and its answer parsed as it arrives, without a task per probe;
whatever has not answered by the deadline counts as "no reuse known" and its connection is
closed, so a late probe never holds the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from .http1 import Client, Response
from .settings import RouterSettings


@dataclass(frozen=True)
class ProbeResult:
    num_tokens: int
    num_tokens_before_hybrid_pruning: int
    load: dict
    seconds: float


class ProbeFailed(Exception):
    pass


class Upstream:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.client = Client(settings.connect_timeout_s)
        self._internal = ({"authorization": f"Bearer {settings.internal_token}"}
                          if settings.internal_token else {})
        self._probe_headers = {"content-type": "application/json", **self._internal}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.client.close()

    # -- probes ------------------------------------------------------------------------

    async def probe_all(self, urls: list[str], body: bytes) -> dict[str, ProbeResult | Exception]:
        """Probe ``urls`` concurrently; whatever has not answered by the deadline is
        abandoned and reported as a TimeoutError."""
        client, headers = self.client, self._probe_headers
        t0 = time.perf_counter()
        waits: dict[asyncio.Future, tuple[str, Response | None]] = {}
        out: dict[str, ProbeResult | Exception] = {}
        for url in urls:
            try:
                data = client.encode("POST", url, "/probe_reuse", body, headers)
                response = client.start("POST", url, data)
            except (ValueError, OSError) as exc:
                out[url] = exc
                continue
            if response is not None:  # sent on a pooled connection
                waits[response.finished()] = (url, response)
            else:  # a connection to open first
                waits[asyncio.ensure_future(
                    client.fetch("POST", url, "/probe_reuse", body, headers))] = (url, None)
        if waits:
            done, pending = await asyncio.wait(waits, timeout=self.settings.probe_deadline_ms / 1e3)
        else:
            done, pending = set(), set()
        for fut in pending:
            url, response = waits[fut]
            if response is not None:
                response.close()
            else:
                fut.cancel()
            out[url] = TimeoutError("probe deadline passed")
        for fut in done:
            url, response = waits[fut]
            exc = fut.exception()
            if exc is not None:
                out[url] = exc
                continue
            if response is not None:
                status, raw, at = response.status, response.body_now(), response.done_at
            else:
                (status, raw), at = fut.result(), time.perf_counter()
            try:
                out[url] = _probe_result(status, raw, at - t0)
            except (ProbeFailed, ValueError, KeyError, TypeError) as exc:
                out[url] = exc if isinstance(exc, ProbeFailed) else ProbeFailed(
                    f"unreadable probe answer: {type(exc).__name__}: {exc}")
        return out

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


def _probe_result(status: int, raw: bytes, seconds: float) -> ProbeResult:
    if status != 200:
        raise ProbeFailed(f"HTTP {status}")
    data = json.loads(raw.decode())
    return ProbeResult(data["num_tokens"], data["num_tokens_before_hybrid_pruning"],
                       data.get("load") or {}, seconds)


def _split(url: str) -> tuple[str, str]:
    """``http://h:p/a/b`` -> (``http://h:p``, ``/a/b``)."""
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host}", slash + path
