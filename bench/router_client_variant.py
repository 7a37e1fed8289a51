"""The router with another HTTP client to its replicas, for the client A/B (issue 15).

    python -m bench.router_client_variant --client aiohttp [router flags ...]

runs ``python -m router`` with ``router.upstream.Upstream`` replaced by the same interface
on a maintained client: ``aiohttp`` (one ``ClientSession``, pooled keep-alive connections,
each probe a task under the same deadline; late ones cancelled) or ``httpx``
(``AsyncClient``, likewise). ``--client http1`` is the router as it ships (its own client,
``router/http1.py``). Nothing here is used by the router itself; ``bench/router_clients.py``
starts these processes side by side.
"""

from __future__ import annotations

import asyncio
import sys
import time

from router.upstream import Upstream, _probe_result


class _AiohttpAnswer:
    """An aiohttp response behind the interface the router reads answers through."""

    def __init__(self, response) -> None:
        self._r = response
        self.status = response.status
        self.headers = {k.lower(): v for k, v in response.headers.items()}

    async def readline(self, idle_timeout: float | None = None) -> bytes | None:
        async with asyncio.timeout(idle_timeout):
            line = await self._r.content.readline()
        if not line:
            return None
        return line.rstrip(b"\r\n") if line.endswith(b"\n") else line

    async def read(self, idle_timeout: float | None = None) -> bytes:
        async with asyncio.timeout(idle_timeout):
            return await self._r.read()

    def release(self, grace_s: float = 1.0) -> None:
        self._r.release()

    def close(self) -> None:
        self._r.close()


class _HttpxAnswer:
    def __init__(self, response) -> None:
        self._r = response
        self.status = response.status_code
        self.headers = {k.lower(): v for k, v in response.headers.items()}
        self._lines = response.aiter_lines()

    async def readline(self, idle_timeout: float | None = None) -> bytes | None:
        async with asyncio.timeout(idle_timeout):
            try:
                return (await anext(self._lines)).encode()
            except StopAsyncIteration:
                return None

    async def read(self, idle_timeout: float | None = None) -> bytes:
        async with asyncio.timeout(idle_timeout):
            return await self._r.aread()

    def release(self, grace_s: float = 1.0) -> None:
        self.close()

    def close(self) -> None:
        asyncio.get_running_loop().create_task(self._r.aclose())


class _Client:
    """What ``Upstream`` asks of its client besides ``fetch`` and ``request``."""

    def opened_to(self, base_url: str) -> int:
        return 0  # not counted (router_upstream_connections_opened shows 0)


class _AiohttpClient(_Client):
    """What ``Upstream`` asks of its client (``fetch``, ``request``) on one aiohttp
    ``ClientSession``: Upstream's own checks and forwarding then run unchanged."""

    def __init__(self) -> None:
        self._session = None

    def _s(self):
        import aiohttp
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                auto_decompress=False, skip_auto_headers=("User-Agent",))
        return self._session

    async def fetch(self, method, base_url, path, body=b"", headers=None, repeatable=None):
        async with self._s().request(method, base_url + path, data=body or None,
                                     headers=headers) as r:
            return r.status, await r.read()

    async def request(self, method, base_url, path, body=b"", headers=None, repeatable=None):
        return _AiohttpAnswer(await self._s().request(method, base_url + path, data=body,
                                                      headers=headers))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _HttpxClient(_Client):
    """The same on one httpx ``AsyncClient``."""

    def __init__(self) -> None:
        self._c = None

    def _s(self):
        import httpx
        if self._c is None:
            self._c = httpx.AsyncClient(timeout=None, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0))
        return self._c

    async def fetch(self, method, base_url, path, body=b"", headers=None, repeatable=None):
        r = await self._s().request(method, base_url + path, content=body or None,
                                    headers=headers)
        return r.status_code, r.content

    async def request(self, method, base_url, path, body=b"", headers=None, repeatable=None):
        c = self._s()
        return _HttpxAnswer(await c.send(c.build_request(method, base_url + path,
                                                         content=body, headers=headers),
                                         stream=True))

    async def aclose(self) -> None:
        if self._c is not None:
            await self._c.aclose()


class _Variant(Upstream):
    """``Upstream`` on another client; probes are tasks under the same deadline (late ones
    cancelled). These clients pool connections as they are used: nothing is warmed."""

    CLIENT: type = _AiohttpClient

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.client.close()
        self.client = self.CLIENT()

    async def probe_all(self, urls, body, traced=None):
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        plain = self._probe_headers  # ``traced``: trace headers per replica (tracing on)
        tasks = {url: loop.create_task(self.client.fetch(
                     "POST", url, "/probe_reuse", body,
                     plain if traced is None else {**plain, **traced[url]}))
                 for url in urls}
        await asyncio.wait(tasks.values(), timeout=self.settings.probe_deadline_ms / 1e3)
        out = {}
        for url, task in tasks.items():
            if not task.done():
                task.cancel()
                out[url] = TimeoutError("probe deadline passed")
            elif task.exception() is not None:
                out[url] = task.exception()
            else:
                status, raw = task.result()
                out[url] = _probe_result(status, raw, time.perf_counter() - t0)
        return out

    async def warm(self, url: str) -> int:
        return 0

    async def close(self) -> None:
        await self.client.aclose()


class AiohttpUpstream(_Variant):
    CLIENT = _AiohttpClient


class HttpxUpstream(_Variant):
    CLIENT = _HttpxClient


VARIANTS = {"aiohttp": AiohttpUpstream, "httpx": HttpxUpstream}


def main(argv: list[str]) -> int:
    client = "http1"
    if "--client" in argv:
        i = argv.index("--client")
        client = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if client != "http1":
        import router.service
        router.service.Upstream = VARIANTS[client]
    from router.__main__ import main as router_main
    return router_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
