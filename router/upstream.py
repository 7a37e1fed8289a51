"""The router's HTTP client side: probes, admission and health checks, forwarding.

One ``aiohttp.ClientSession`` with pooled keep-alive connections serves the hot path (it
adds less latency than httpx here; see ../shared/PEERS.md). Probes go out concurrently
under one deadline; a probe that is late or fails counts as "no reuse known" and is
cancelled, so it never holds the request.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from array import array
from dataclasses import dataclass

import aiohttp

from .probe_client import ProbeClient
from .settings import RouterSettings


@dataclass(frozen=True)
class ProbeResult:
    num_tokens: int
    num_tokens_before_hybrid_pruning: int
    load: dict
    seconds: float


class ProbeFailed(Exception):
    pass


def token_ids_b64(tokens: list[int]) -> str:
    """Little-endian uint32 token ids, base64: the compact probe body."""
    data = array("I", tokens)
    if sys.byteorder != "little":
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode("ascii")


class Upstream:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None
        self.probes = ProbeClient(settings.connect_timeout_s)
        self._internal = ({"authorization": f"Bearer {settings.internal_token}"}
                          if settings.internal_token else {})

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s,
                                        sock_read=self.settings.idle_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                             auto_decompress=False)

    async def close(self) -> None:
        self.probes.close()
        if self.session is not None:
            await self.session.close()

    # -- probes ------------------------------------------------------------------------

    async def probe_all(self, urls: list[str], body: bytes) -> dict[str, ProbeResult | Exception]:
        """Probe ``urls`` concurrently; whatever has not answered by the deadline is
        cancelled and reported as a TimeoutError."""
        tasks = {asyncio.ensure_future(self._probe(url, body)): url for url in urls}
        done, pending = await asyncio.wait(tasks, timeout=self.settings.probe_deadline_ms / 1e3)
        out: dict[str, ProbeResult | Exception] = {}
        for task in pending:
            task.cancel()
            out[tasks[task]] = TimeoutError("probe deadline passed")
        for task in done:
            exc = task.exception()
            out[tasks[task]] = exc if exc is not None else task.result()
        return out

    async def _probe(self, url: str, body: bytes) -> ProbeResult:
        t0 = time.perf_counter()
        if url.startswith("http://"):
            status, raw = await self.probes.post(url, "/probe_reuse", body, self._internal)
        else:  # TLS: the general client
            headers = {"content-type": "application/json", **self._internal}
            async with self.session.post(url + "/probe_reuse", data=body,
                                         headers=headers) as r:
                status, raw = r.status, await r.read()
        if status != 200:
            raise ProbeFailed(f"HTTP {status}")
        data = json.loads(raw)
        return ProbeResult(data["num_tokens"], data["num_tokens_before_hybrid_pruning"],
                           data.get("load") or {}, time.perf_counter() - t0)

    # -- checks ------------------------------------------------------------------------

    async def get_json(self, url: str, timeout: float) -> tuple[int, dict | None]:
        headers = dict(self._internal)
        if self.settings.backend == "openai" and self.settings.backend_api_key:
            headers["authorization"] = f"Bearer {self.settings.backend_api_key}"
        async with self.session.get(url, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            body = await r.read()
            try:
                return r.status, json.loads(body) if body else None
            except ValueError:
                return r.status, None

    async def is_ready(self, url: str) -> tuple[bool, str]:
        path = "/ready" if self.settings.backend == "ours" else "/health"
        try:
            status, _ = await self.get_json(url + path, self.settings.health_timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return False, f"{path}: {type(exc).__name__}: {exc}".rstrip(": ")
        return status == 200, f"{path} answered {status}"

    # -- forwarding --------------------------------------------------------------------

    async def post(self, url: str, body: bytes, headers: dict[str, str]
                   ) -> aiohttp.ClientResponse:
        """Send a request; the response's body is read (streamed) by the caller."""
        return await self.session.post(url, data=body, headers=headers)
