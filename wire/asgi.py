"""Hot routes served as plain ASGI in front of a FastAPI app.

A FastAPI route passes each request through about ten layers (middleware, exception
handlers, dependency resolution, response classes) before the endpoint runs; on the
replica's ``/probe_reuse``, which runs once per replica probed for every routed request,
that was a large share of the CPU per request (BENCHMARKS.md, "router"; the router's proxy
endpoints skip the framework the same way: ``router/asgi.py``). ``HotRoutes`` answers those
few routes itself with the same
contract as the framework's routes: the body-size limit (413), OpenAI-style error bodies
for ``APIError`` (with ``x-should-retry: false`` on deterministic client errors), a 500 body
for anything unexpected (logged). Every other request goes to the app unchanged.

The routes stay declared in the FastAPI app (``document``) so that ``/openapi.json`` keeps
describing them; those declarations are never called.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request

from .errors import APIError, error_headers, too_large

log = logging.getLogger("wire.asgi")

Handler = Callable[[dict, bytes, Callable, Callable], Awaitable[None]]
JSON = b"application/json"


class HotRoutes:
    def __init__(self, app: FastAPI, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.routes: dict[tuple[str, str], Handler] = {}

    @property
    def state(self):
        return self.app.state

    def add(self, method: str, path: str, handler: Handler) -> None:
        """``handler(scope, body, receive, send)`` answers ``method path``."""
        self.routes[(method, path)] = handler

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            handler = self.routes.get((scope["method"], scope["path"]))
            if handler is not None:
                return await self._serve(handler, scope, receive, send)
        await self.app(scope, receive, send)

    async def _serve(self, handler: Handler, scope, receive, send) -> None:
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            body = await self._body(scope, receive)
            if body is None:
                return  # the client left before sending its body
            await handler(scope, body, receive, tracking_send)
        except APIError as err:
            if not started:
                await send_error(send, err)
        except Exception:
            log.exception("unhandled error on %s", scope["path"])
            if not started:
                await send_error(send, APIError(500, "internal error", type="server_error"))

    async def _body(self, scope, receive) -> bytes | None:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise too_large(limit)
        message = await receive()
        if message["type"] != "http.request":
            return None
        body = message.get("body", b"")
        if not message.get("more_body"):
            if len(body) > limit:
                raise too_large(limit)
            return body
        parts, size = [body], len(body)
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
                return b"".join(parts)


async def send_bytes(send, status: int, body: bytes, content_type: bytes = JSON,
                     headers: dict[str, str] | None = None) -> None:
    """A whole response in two ASGI messages."""
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def send_error(send, err: APIError) -> None:
    await send_bytes(send, err.status, json.dumps(err.body()).encode(),
                     headers=error_headers(err))


def document(app: FastAPI, method: str, path: str, **route) -> None:
    """Declare a route answered by ``HotRoutes`` so that the OpenAPI document shows it
    (``route``: FastAPI's ``response_model``, ``responses``, ``openapi_extra`` ...)."""

    async def answered_by_hot_routes(request: Request) -> None:
        # The route in front of the app matches the raw path; the app matches the decoded
        # one. Reaching here means the raw path was another resource that decodes to this
        # one (``/v1/chat%2Fcompletions``): there is no such route.
        raw = request.scope.get("raw_path", b"").decode("latin-1")
        raise APIError(404, f"no route {method} {raw}", type="not_found_error",
                       code="not_found")

    app.add_api_route(path, answered_by_hot_routes, methods=[method], **route)
