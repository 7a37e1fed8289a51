"""The router as one raw ASGI app (served by uvicorn: ``router/http_server.py``).

The proxy endpoints (``RouterApp.routes``) skip FastAPI's layers: each is called with the
client's headers and its whole body, and a watcher on ``receive()`` cancels it (and with it
the upstream request) when the client leaves. Every other path goes to the FastAPI app
unchanged. Paths are matched undecoded, so ``/v1/chat%2Fcompletions`` is not a proxy
endpoint (the app answers it 404). Body and head limits are the server's
(``http_server.FrontDoorProtocol``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from collections.abc import Awaitable, Callable

from wire.asgi import send_error
from wire.errors import APIError

log = logging.getLogger("router.asgi")

Send = Callable[[dict], Awaitable[None]]
# ``handler(headers, body, send)``: the client's headers (names in lower case), its whole
# body, and the ASGI send (``http.response.start``, then ``http.response.body``).
Handler = Callable[[list[tuple[bytes, bytes]], bytes, Send], Awaitable[None]]


class ProxyASGI:
    def __init__(self, app, routes: dict[tuple[str, str], Handler]) -> None:
        self.app = app  # the FastAPI app: every path but the proxy endpoints
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            raw = scope.get("raw_path")  # matched undecoded: /v1/chat%2Fcompletions is not ours
            path = raw.decode("latin-1") if raw is not None else scope["path"]
            handler = self.routes.get((scope["method"], path))
            if handler is not None:
                return await self._proxy(handler, scope, receive, send)
        await self.app(scope, receive, send)

    async def _proxy(self, handler, scope, receive, send) -> None:
        started = finished = False

        async def tracking_send(message: dict) -> None:
            nonlocal started, finished
            started = True
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        body = await _body(receive)
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
        except asyncio.CancelledError:  # the server stopped past its grace period
            if not started:
                with contextlib.suppress(Exception):
                    await send_error(send, APIError(
                        503, "the router stopped before this request was answered",
                        type="server_error", code="shutting_down"))
            raise
        finally:
            watcher.cancel()
            if not work.done():  # the client left (or this request is being cancelled)
                work.cancel()
                # its clean-up (the upstream request closed, the accounting) runs before
                # this request is over
                await asyncio.wait((work,))
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

async def _body(receive) -> bytes | None:
    """The whole request body; None if the client left first."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _disconnected(receive) -> None:
    """Returns once the client has left."""
    while (await receive())["type"] != "http.disconnect":
        pass
