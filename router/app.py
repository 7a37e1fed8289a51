"""The router's HTTP API: the OpenAI endpoints of a replica, plus operations endpoints."""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel


from wire import jsonwire
from wire.asgi import document, send_bytes
from wire.errors import APIError, install_error_handlers
from wire.openapi import body_schema, not_ready_body
from wire.openapi import install as install_openapi
from wire.schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                          CompletionResponse, ErrorResponse, ServedModel, ServedModelList,
                          Status)

from .asgi import Handler
from .dashboard import install_dashboard
from .metrics import RouterMetrics
from .forward import AttemptAccounting, forward
from .policies import Decision
from .proxy import (DONE, UpstreamAnswer, UpstreamError, UpstreamFailed, UpstreamRefused,
                    collect, describe, error_event)
from .requests import Prepared
from .service import RouterService
from .settings import RouterSettings
from .stats import AdminResult, ReplicaList, RouterStats, stats_view

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 502, 503)}


class ReplicaURL(BaseModel):
    url: str


@dataclass
class RouterApp:
    """What ``router.asgi.ProxyASGI`` serves: the proxy endpoints by their handlers
    (``routes``), everything else through the FastAPI app (``asgi``)."""

    asgi: FastAPI
    routes: dict[tuple[str, str], Handler]
    service: RouterService


def create_app(settings: RouterSettings, service: RouterService | None = None) -> RouterApp:
    """The router's endpoints. The caller starts and stops ``service`` around serving."""
    svc = service or RouterService(settings)
    svc.metrics = RouterMetrics(svc)

    app = FastAPI(title="router")
    app.state.service = svc
    install_error_handlers(app)
    install_openapi(app)

    document(app, "POST", "/v1/completions", response_model=CompletionResponse,
             responses=_ERRORS, openapi_extra=body_schema(CompletionRequest))
    document(app, "POST", "/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=_ERRORS, openapi_extra=body_schema(ChatCompletionRequest))

    @app.get("/v1/models", response_model=ServedModelList)
    async def models() -> ServedModelList:
        created = int(time.time())
        return ServedModelList(data=[ServedModel(id=m, created=created)
                                     for m in sorted(svc.models())])

    @app.get("/health", response_model=Status)
    async def health() -> Status:
        return Status(status="ok")

    @app.get("/ready", response_model=Status, responses={503: {"model": ErrorResponse}})
    async def ready():
        if svc.registry.eligible(None):
            return Status(status="ready")
        return JSONResponse(not_ready_body("no eligible replica"), status_code=503)

    @app.get("/stats", response_model=RouterStats)
    async def stats() -> dict:
        return stats_view(svc)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(generate_latest(svc.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    install_dashboard(app)
    _admin_routes(app, svc, settings)
    routes = {("POST", "/v1/completions"): _proxy(svc, "completion"),
              ("POST", "/v1/chat/completions"): _proxy(svc, "chat")}
    if svc.tracing is not None:  # each in a root span; off, the handlers run as they are
        routes = svc.tracing.traced(routes)
    return RouterApp(app, routes, svc)


def _admin_routes(app: FastAPI, svc: RouterService, settings: RouterSettings) -> None:
    if not settings.admin_token:
        return  # admin endpoints are off unless a token is set

    def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {settings.admin_token}".encode()):
            raise APIError(401, "missing or wrong admin token", type="authentication_error")

    admin_errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 409)}

    @app.get("/admin/replicas", response_model=ReplicaList, responses=admin_errors)
    async def list_replicas(request: Request) -> dict:
        check(request)
        return {"replicas": stats_view(svc)["replicas"]}

    @app.post("/admin/replicas", response_model=AdminResult, response_model_exclude_none=True,
              responses=admin_errors)
    async def add_replica(body: ReplicaURL, request: Request) -> dict:
        check(request)
        if not body.url.startswith(("http://", "https://")):
            raise APIError(400, "url must start with http:// or https://", param="url")
        if svc.registry.get(body.url) is not None:
            raise APIError(409, f"replica {body.url} is already registered", param="url")
        replica = await svc.add_replica(body.url)
        return {"added": replica.url, "model": replica.model}

    @app.post("/admin/replicas/drain", response_model=AdminResult,
              response_model_exclude_none=True, responses=admin_errors)
    async def drain_replica(body: ReplicaURL, request: Request) -> dict:
        check(request)
        replica = _known(svc, body.url)
        replica.draining = True
        return {"draining": replica.url, "in_flight": replica.in_flight}

    @app.delete("/admin/replicas", response_model=AdminResult,
              response_model_exclude_none=True, responses=admin_errors)
    async def remove_replica(body: ReplicaURL, request: Request) -> dict:
        check(request)
        _known(svc, body.url)
        svc.remove_replica(body.url)
        return {"removed": body.url}


def _known(svc: RouterService, url: str):
    replica = svc.registry.get(url)
    if replica is None:
        raise APIError(404, f"no replica {url}", param="url")
    return replica


# -- the proxy path (answered by router.asgi.ProxyASGI, not the FastAPI app) ------------

def _proxy(svc: RouterService, kind: str) -> Handler:
    async def handler(raw_headers: list[tuple[bytes, bytes]], body: bytes, send,
                      trace=None) -> None:
        """An APIError raised before the answer started becomes the error response; a
        client that leaves cancels this (and with it the upstream request). ``trace``:
        the request's spans (``router.tracing.RequestTrace``) when tracing is on."""
        arrived = time.monotonic()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
        p = svc.builder.prepare(kind, body, headers)
        if trace is not None:
            trace.tokenized(p)  # from here on, p.trace
        # --api-keys: the tenant's limits on the tokenized prompt, before any probe (429)
        admission = p.tenant.admit(p.route.num_tokens) if p.tenant is not None else None
        try:
            decision = await svc.decide(p)
            try:
                if p.stream:
                    await _stream(svc, p, decision, arrived, send)
                else:
                    await _answer(svc, p, decision, arrived, send)
            except UpstreamError as exc:  # raised only before anything reached the client
                await _answer_upstream_error(send, exc)
        finally:  # answered, failed, or cancelled (the client left): the slot is free
            if admission is not None:
                admission.release()
    return handler


async def _answer(svc: RouterService, p: Prepared, decision: Decision, arrived: float,
                  send) -> None:
    """Non-streaming clients: the whole answer, collected from the replica's stream."""
    total = svc.settings.total_timeout_s
    try:
        async with asyncio.timeout(total):
            answer = await forward(svc, p, decision, arrived, partial(_whole, svc, p))
    except TimeoutError:
        raise APIError(504, f"no complete answer within {total:g} s (total_timeout_s)",
                       type="server_error", code="timeout") from None
    await send_bytes(send, *answer)


async def _whole(svc: RouterService, p: Prepared, accounting: AttemptAccounting,
                 answer: UpstreamAnswer) -> tuple[int, bytes, bytes, dict[str, str]]:
    """(status, body, content type, headers) for ``send_bytes``. Nothing has reached the
    client yet, so a replica that fails half-way is UpstreamFailed: the next one is tried."""
    try:
        if svc.settings.backend == "openai":
            body = await answer.response.read(svc.settings.idle_timeout_s)
            content_type = answer.response.headers.get("content-type", "application/json")
        else:
            body = jsonwire.dumps(collect(await answer.chunks(), chat=p.kind == "chat"))
            content_type = "application/json"
    except (ConnectionError, TimeoutError) as exc:
        raise UpstreamFailed("replica failed before the answer was complete: "
                             f"{describe(exc)}", 503) from exc
    accounting.usage = answer.usage
    accounting.answering()
    return 200, body, content_type.encode("latin-1"), {"x-replica": accounting.replica.url,
                                                       "x-request-id": p.request_id}


async def _stream(svc: RouterService, p: Prepared, decision: Decision, arrived: float,
                  send) -> None:
    """Streaming clients: relayed from the best replica that gets to its first token."""
    await forward(svc, p, decision, arrived, partial(_relay, svc, p, send))
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _relay(svc: RouterService, p: Prepared, send, accounting: AttemptAccounting,
                 answer: UpstreamAnswer) -> None:
    """The head (this replica answers), then the events as they come."""
    accounting.answering()
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"x-replica", accounting.replica.url.encode("latin-1")),
        (b"x-request-id", p.request_id.encode("latin-1"))]})
    events = _events(svc, p, accounting, answer)
    try:
        async for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
    finally:
        await events.aclose()  # out of its total timeout now, even if sending was cancelled


async def _events(svc: RouterService, p: Prepared, accounting: AttemptAccounting,
                  answer: UpstreamAnswer):
    """The answer's events as they come; a break after the first one ends the stream
    with an error event (the answer cannot be retried without repeating it)."""
    drop_usage = svc.settings.backend == "ours" and not p.include_usage
    total = svc.settings.total_timeout_s
    try:
        first = b"".join(e for e in answer.buffered if not (drop_usage and _usage_only(e)))
        if first:
            yield first
        async with asyncio.timeout_at(accounting.started + total):
            async for event in answer.rest():
                if not (drop_usage and _usage_only(event)):
                    yield event
        accounting.usage = answer.usage
    except TimeoutError:
        accounting.outcome = "timeout"
        yield error_event(f"no complete answer within {total:g} s (total_timeout_s)",
                          code="timeout")
        yield DONE
    except ConnectionError as exc:
        accounting.outcome, accounting.failure = "broken", f"stream broke: {exc}"
        yield error_event(f"the replica failed while streaming: {exc}", code="upstream_broken")
        yield DONE


def _usage_only(event: bytes) -> bool:
    return b"\"choices\":[]" in event and b"\"usage\"" in event


async def _answer_upstream_error(send, exc: UpstreamError) -> None:
    """The one mapping of a replica's failure to the client's answer: a client error
    (UpstreamRefused) as the replica gave it; anything else an OpenAI error, raised for
    the server to send."""
    if isinstance(exc, UpstreamRefused):
        headers = {k.lower(): v for k, v in exc.headers.items()
                   if k.lower() in ("x-should-retry", "retry-after", "x-request-id")}
        headers["x-should-retry"] = "false"
        headers["x-replica"] = exc.replica
        content_type = exc.headers.get("content-type", "application/json")
        return await send_bytes(send, exc.status, exc.body, content_type.encode("latin-1"),
                                headers)
    rate_limited = exc.status == 429
    raise APIError(exc.status, str(exc), type="rate_limit_error" if rate_limited
                   else "server_error", code="upstream_failed",
                   headers={"Retry-After": exc.retry_after or "1"} if rate_limited else None
                   ) from None
