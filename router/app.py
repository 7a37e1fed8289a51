"""The router's HTTP API: the OpenAI endpoints of a replica, plus operations endpoints."""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from replicas.body_limit import BodySizeLimit
from replicas.errors import APIError, install_error_handlers
from replicas.openapi import body_schema, not_ready_body
from replicas.openapi import install as install_openapi
from replicas.schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                              CompletionResponse, ErrorResponse, ServedModel, ServedModelList,
                              Status)

from .dashboard import install_dashboard
from .metrics import RouterMetrics
from .proxy import DONE, Attempt, UpstreamRefused, collect, error_event
from .requests import Prepared
from .service import Flight, RouterService
from .settings import RouterSettings
from .stats import AdminResult, ReplicaList, RouterStats, stats_view

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 502, 503)}


class ReplicaURL(BaseModel):
    url: str


def create_app(settings: RouterSettings, service: RouterService | None = None) -> FastAPI:
    svc = service or RouterService(settings)
    svc.metrics = RouterMetrics(svc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await svc.start()
        yield
        await svc.stop()

    app = FastAPI(title="router", lifespan=lifespan)
    app.state.service = svc
    install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS,
              openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        return await _route(svc, request, "completion")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS,
              openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await _route(svc, request, "chat")

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
    return app


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


# -- the proxy path --------------------------------------------------------------------

async def _route(svc: RouterService, request: Request, kind: str):
    arrived = time.monotonic()
    p = svc.builder.prepare(kind, await request.body(), request.headers)
    decision, _ = await svc.decide(p)
    reason = decision.reason.split(" (")[0]
    tried: list[str] = []
    if p.stream:
        try:
            replica, attempt, flight = await _open(svc, p, decision, tried, arrived)
        except _Passed as passed:
            return passed.response()
        svc.metrics.decisions.labels(replica.url, reason).inc()
        return StreamingResponse(_relay(svc, attempt, flight, p), media_type="text/event-stream",
                                 headers=_headers(replica.url, p))
    task = asyncio.ensure_future(asyncio.wait_for(
        _collect(svc, p, decision, tried, arrived, reason), svc.settings.total_timeout_s))
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():  # the client went away: cancelling closes the upstream request
        task.cancel()
        return Response(status_code=499)
    try:
        return task.result()
    except asyncio.TimeoutError:
        raise APIError(504, f"no complete answer within {svc.settings.total_timeout_s:g} s "
                       "(total_timeout_s)", type="server_error", code="timeout") from None


async def _open(svc: RouterService, p: Prepared, decision, tried: list[str], arrived: float):
    try:
        replica, attempt, flight = await svc.open(p, decision, tried)
    except UpstreamRefused as exc:
        raise _Passed(exc) from None
    svc.metrics.overhead.observe(flight.started - arrived)
    if attempt.first_content_at is not None:
        svc.metrics.ttft.labels(replica.url).observe(attempt.first_content_at - flight.started)
    return replica, attempt, flight


async def _collect(svc: RouterService, p: Prepared, decision, tried: list[str], arrived: float,
                   reason: str) -> Response:
    """Non-streaming clients: collect the stream; nothing was sent, so a replica that fails
    half-way is retried on the next one."""
    while True:
        try:
            replica, attempt, flight = await _open(svc, p, decision, tried, arrived)
        except _Passed as passed:
            return passed.response()
        try:
            if svc.settings.backend == "openai":
                body = await attempt.response.read()
            else:
                events = list(attempt.buffered) + [e async for e in attempt.rest()]
                body = collect(events, chat=p.kind == "chat")
        except ConnectionError as exc:
            attempt.close()
            flight.end(ok=False, why=str(exc))
            tried.append(replica.url)
            continue
        except BaseException:
            attempt.close()
            flight.end(ok=True)  # cancelled: the client left
            raise
        attempt.close()
        flight.end(ok=True, usage=attempt.usage)
        svc.metrics.decisions.labels(replica.url, reason).inc()
        svc.metrics.requests.labels(replica.url, "ok").inc()
        if isinstance(body, bytes):
            return Response(body, headers=_headers(replica.url, p), media_type="application/json")
        return JSONResponse(body, headers=_headers(replica.url, p))


async def _relay(svc: RouterService, attempt: Attempt, flight: Flight, p: Prepared):
    """Streaming clients: relay events as they come; a break after the first one ends the
    stream with an error event (the answer cannot be retried without repeating it)."""
    drop_usage = svc.settings.backend == "ours" and not p.include_usage
    outcome = "ok"
    try:
        for event in attempt.buffered:
            if not (drop_usage and _usage_only(event)):
                yield event
        async with asyncio.timeout_at(flight.started + svc.settings.total_timeout_s):
            async for event in attempt.rest():
                if not (drop_usage and _usage_only(event)):
                    yield event
        flight.end(ok=True, usage=attempt.usage)
    except TimeoutError:
        outcome = "timeout"
        flight.end(ok=True)
        yield error_event(f"no complete answer within {svc.settings.total_timeout_s:g} s "
                          "(total_timeout_s)", code="timeout")
        yield DONE
    except ConnectionError as exc:
        outcome = "broken"
        flight.end(ok=False, why=f"stream broke: {exc}")
        yield error_event(f"the replica failed while streaming: {exc}", code="upstream_broken")
        yield DONE
    finally:
        attempt.close()
        flight.end(ok=True)  # the client left: not the replica's fault
        svc.metrics.requests.labels(flight.replica.url, outcome).inc()


def _usage_only(event: bytes) -> bool:
    return b"\"choices\":[]" in event and b"\"usage\"" in event


def _headers(replica: str, p: Prepared) -> dict[str, str]:
    return {"x-replica": replica, "x-request-id": p.request_id}


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Passed(Exception):
    """A replica's client error (4xx), passed to the client as it was."""

    def __init__(self, exc: UpstreamRefused) -> None:
        self.exc = exc

    def response(self) -> Response:
        headers = {k: v for k, v in self.exc.headers.items()
                   if k.lower() in ("content-type", "x-should-retry", "retry-after",
                                    "x-request-id")}
        headers["x-should-retry"] = "false"
        headers["x-replica"] = self.exc.replica
        return Response(self.exc.body, status_code=self.exc.status, headers=headers)
