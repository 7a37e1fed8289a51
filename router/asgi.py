"""The router as one raw ASGI app, for a maintained ASGI server (uvicorn, granian).

``router.server.HTTPServer`` calls the proxy handlers straight from its connections; this
is the same router for any ASGI server: the proxy endpoints (``RouterApp.routes``) are
answered by their handlers, with the body read in full (413 past ``max_body_bytes``) and a
watcher on ``receive()`` that cancels the handler (and with it the upstream request) when
the client leaves; every other path goes to the FastAPI app unchanged. ``--http-server``
chooses which server runs it (``router/__main__.py``); the A/B that compares them is
``bench/router_servers.py``.
"""

from __future__ import annotations

import asyncio
import logging

from replicas.asgi import send_error
from replicas.errors import APIError, too_large

log = logging.getLogger("router.asgi")


class ProxyASGI:
    def __init__(self, app, routes, max_body_bytes: int, lifespan=None) -> None:
        self.app = app  # the FastAPI app: every path but the proxy endpoints
        self.routes = routes
        self.max_body_bytes = max_body_bytes
        self.lifespan = lifespan  # (start, stop) coroutine functions run by ASGI lifespan

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            raw = scope.get("raw_path")  # matched undecoded: /v1/chat%2Fcompletions is not ours
            path = raw.decode("latin-1") if raw is not None else scope["path"]
            handler = self.routes.get((scope["method"], path))
            if handler is not None:
                return await self._proxy(handler, scope, receive, send)
        elif kind == "lifespan" and self.lifespan is not None:
            return await self._lifespan(receive, send)
        await self.app(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        start, stop = self.lifespan
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await start()
                except Exception as exc:
                    log.exception("router start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _proxy(self, handler, scope, receive, send) -> None:
        started = finished = False

        async def tracking_send(message: dict) -> None:
            nonlocal started, finished
            started = True
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            body = await self._body(scope, receive)
        except APIError as err:
            return await send_error(send, err)
        if body is None:
            return  # the client left before its body arrived
        work = asyncio.ensure_future(handler(scope["headers"], body, tracking_send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and finished:
                # servers report a disconnect once the answer is sent: the handler is
                # past its last send (finishing its accounting), not abandoned
                await asyncio.shield(work)
        finally:
            if not work.done():  # the client left (or this request is being cancelled)
                work.cancel()
            watcher.cancel()
        if work.cancelled():
            return
        exc = work.exception()
        if exc is None:
            if not started:
                log.error("the handler of %s returned no response", scope["path"])
                await send_error(send, APIError(500, "internal error", type="server_error"))
        elif isinstance(exc, APIError):
            if not started:
                await send_error(send, exc)
        else:
            log.error("unhandled error on %s", scope["path"], exc_info=exc)
            if not started:
                await send_error(send, APIError(500, "internal error", type="server_error"))

    async def _body(self, scope, receive) -> bytes | None:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise too_large(limit)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                raise too_large(limit)
            parts.append(part)
            if not message.get("more_body"):
                return parts[0] if len(parts) == 1 else b"".join(parts)


async def _disconnected(receive) -> None:
    """Returns once the client has left."""
    while (await receive())["type"] != "http.disconnect":
        pass
