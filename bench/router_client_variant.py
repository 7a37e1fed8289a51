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
import json
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


class _Variant(Upstream):
    """Probes as tasks under one deadline; the rest through ``_request``."""

    async def probe_all(self, urls, body):
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        tasks = {url: loop.create_task(self._probe(url, body)) for url in urls}
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
        return 0  # these clients pool connections as they are used

    async def get_json(self, url: str, timeout: float):
        async with asyncio.timeout(timeout):
            status, raw = await self._fetch("GET", url, b"", dict(self._internal))
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, None


class AiohttpUpstream(_Variant):
    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.client.close()
        self._session = None

    def _s(self):
        import aiohttp
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                auto_decompress=False, skip_auto_headers=("User-Agent",))
        return self._session

    async def _probe(self, url, body):
        async with self._s().post(url + "/probe_reuse", data=body,
                                  headers=self._probe_headers) as r:
            return r.status, await r.read()

    async def _fetch(self, method, url, body, headers):
        async with self._s().request(method, url, data=body or None, headers=headers) as r:
            return r.status, await r.read()

    async def post(self, url, path, body, headers):
        r = await self._s().post(url + path, data=body, headers=headers)
        return _AiohttpAnswer(r)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class HttpxUpstream(_Variant):
    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.client.close()
        self._c = None

    def _s(self):
        import httpx
        if self._c is None:
            self._c = httpx.AsyncClient(timeout=None, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0))
        return self._c

    async def _probe(self, url, body):
        r = await self._s().post(url + "/probe_reuse", content=body,
                                 headers=self._probe_headers)
        return r.status_code, r.content

    async def _fetch(self, method, url, body, headers):
        r = await self._s().request(method, url, content=body or None, headers=headers)
        return r.status_code, r.content

    async def post(self, url, path, body, headers):
        c = self._s()
        r = await c.send(c.build_request("POST", url + path, content=body, headers=headers),
                         stream=True)
        return _HttpxAnswer(r)

    async def close(self) -> None:
        if self._c is not None:
            await self._c.aclose()


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
