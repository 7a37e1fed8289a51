"""The replica's HTTP API (FastAPI): thin routes over ReplicaService."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import random
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from wire import jsonwire
from wire.asgi import HotRoutes, document, send_bytes
from wire.errors import APIError, install_error_handlers, invalid
from wire.openapi import body_schema, not_ready_body
from wire.openapi import install as install_openapi
from wire.schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                          CompletionResponse, ErrorResponse, ModelList, ProbeAnswer, ProbeRequest,
                          RenderedPrompt, ReplicaStats, _GenerationParams, Status,
                          TokenizerInfo)

from .body_limit import BodySizeLimit
from .responses import DONE, Formatter, text_pieces
from .sequence import Sequence
from .service import ReplicaService, new_request_id
from .settings import ReplicaSettings

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}


def create_app(settings: ReplicaSettings, service: ReplicaService | None = None) -> HotRoutes:
    """The replica's ASGI app: ``/probe_reuse`` as plain ASGI (``HotRoutes``), everything
    else FastAPI (``.app``)."""
    service = service or ReplicaService(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        await service.stop()

    app = FastAPI(title="replica", lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    def internal_auth(request: Request) -> None:
        check_internal(settings.internal_token, request.headers.get("authorization", ""))

    faults = _Faults(settings)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(service, request, body, faults, service.completion_tokens,
                               "completion", settings.default_max_tokens)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(service, request, body, faults, service.chat_tokens, "chat",
                               settings.default_chat_max_tokens)

    # vLLM's render API: the prompt's token ids as a completion would compute them. vLLM's
    # router (0.1.17) routes by prefix only through these: it asks every worker to render
    # every request, and routes by load alone when a worker cannot.
    @app.post("/v1/completions/render", response_model=list[RenderedPrompt],
              responses=_ERRORS)
    async def render_completion(body: CompletionRequest, request: Request):
        return _json([_rendered(service, request, body, service.completion_tokens,
                                settings.default_max_tokens)])

    @app.post("/v1/chat/completions/render", response_model=RenderedPrompt,
              responses=_ERRORS)
    async def render_chat_completion(body: ChatCompletionRequest, request: Request):
        return _json(_rendered(service, request, body, service.chat_tokens,
                               settings.default_chat_max_tokens))

    document(app, "POST", "/probe_reuse", response_model=ProbeAnswer, responses=_ERRORS,
             openapi_extra=body_schema(ProbeRequest))

    tracing = service.tracing  # None: off

    async def probe_reuse(scope, body: bytes, receive, send) -> None:
        # The hot path (the router asks every replica for every request): plain ASGI, the
        # body validated straight from bytes by pydantic-core.
        started = None if tracing is None else time.time_ns()
        if settings.internal_token is not None:
            check_internal(settings.internal_token, _header(scope, b"authorization"))
        try:
            request = ProbeRequest.model_validate_json(body)
        except ValidationError as exc:
            raise invalid(exc.errors()) from None
        if settings.fault_probe_delay_s:
            await asyncio.sleep(settings.fault_probe_delay_s)
        answer = service.probe(request)
        if started is not None:
            tracing.probe(scope, started, answer)
        await send_bytes(send, 200, jsonwire.dumps(answer))

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[service.model_card()])

    @app.get("/tokenizer", response_model=TokenizerInfo)
    async def tokenizer() -> dict:
        """The tokenizer and chat template this replica serves with (what a router started
        without --tokenizer loads)."""
        return service.tokenizer.wire()

    @app.get("/health", response_model=Status)
    async def health() -> Status:
        return Status(status="ok")

    @app.get("/ready", response_model=Status, responses={503: {"model": ErrorResponse}})
    async def ready():
        if service.ready and not service.draining:
            return Status(status="ready")
        state = "draining" if service.draining else "starting"
        return JSONResponse(not_ready_body(state), status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(generate_latest(service.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats", response_model=ReplicaStats, responses=_ERRORS,
             dependencies=[Depends(internal_auth)])
    async def stats() -> dict:
        return _stats(service)

    hot = HotRoutes(app, settings.max_body_bytes)
    hot.add("POST", "/probe_reuse", probe_reuse)
    return hot


def _request_id(request: Request) -> str:
    """The caller's ``x-request-id`` (the router's), else a new one."""
    return request.headers.get("x-request-id") or new_request_id()


def _rendered(service: ReplicaService, request: Request, body: _GenerationParams,
              tokens_of: Callable[[_GenerationParams], list[int]], default_max: int) -> dict:
    return service.rendered(tokens_of(body), body, default_max, _request_id(request))


def _json(content) -> Response:
    return Response(jsonwire.dumps(content), media_type="application/json")


def check_internal(token: str | None, authorization: str) -> None:
    """APIError 401 unless ``authorization`` carries the internal token (when one is set)."""
    if token is None:
        return
    if not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
        raise APIError(401, "missing or wrong internal token", type="authentication_error",
                       code="invalid_token")


def _header(scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


async def _generate(service: ReplicaService, request: Request, body: _GenerationParams,
                    faults: _Faults, tokens_of: Callable[[_GenerationParams], list[int]],
                    kind: str, default_max: int):
    """``tokens_of(body)`` gives the prompt's ids (or raises the APIError that refuses it):
    called inside the request's span, so that a refusal (an injected fault, a wrong model,
    a prompt the template or the limits refuse, a full queue) is traced too."""
    request_id = _request_id(request)
    tracing = service.tracing  # None: off
    span = None if tracing is None else tracing.completion(request.scope, request_id)
    try:
        faults.maybe_fail()
        seq = service.new_sequence(tokens_of(body), body, default_max, request_id)
        service.submit(seq)
    except APIError as exc:
        if span is not None:
            tracing.refused(span, exc)
        raise
    fmt = Formatter(kind, request_id, service.model_id)
    headers = {"x-request-id": request_id}
    pieces = text_pieces(service, seq, body.stop)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _sse(fmt, seq, pieces, include_usage)
        if service.settings.fault_cut_stream_after is not None:
            events = _cut(events, service.settings.fault_cut_stream_after)
        if span is not None:  # the spans end with the stream
            events = tracing.streamed(events, span, seq)
        return StreamingResponse(events,
                                 media_type="text/event-stream", headers=headers)
    watcher = asyncio.create_task(_abort_on_disconnect(request, service, seq))
    error = None
    try:
        text, finish = [], None
        async for piece in pieces:
            text.append(piece.text)
            finish = piece.finish_reason
            if piece.error:
                raise APIError(500, piece.error, type="server_error")
    except BaseException as exc:
        error = exc
        raise
    finally:
        watcher.cancel()
        await pieces.aclose()
        if span is not None:
            tracing.finished(span, seq, error)
    return JSONResponse(fmt.whole("".join(text), finish, seq), headers=headers)


async def _sse(fmt: Formatter, seq: Sequence, pieces, include_usage: bool):
    try:
        if fmt.chat:
            yield fmt.chunk("", first=True)
        async for piece in pieces:
            if piece.error:
                yield Formatter.error_event(piece.error)
                break
            if piece.text:
                yield fmt.chunk(piece.text)
            if piece.finish_reason is not None:
                yield fmt.chunk(None, piece.finish_reason)
        if include_usage:
            yield fmt.usage_chunk(seq)
        yield DONE
    finally:
        await pieces.aclose()


class _Faults:
    """Injected failures (settings ``fault_*``), for fault tests and drills."""

    def __init__(self, settings: ReplicaSettings) -> None:
        self.rate = settings.fault_error_rate
        self.rng = random.Random(settings.seed)

    def maybe_fail(self) -> None:
        if self.rate and self.rng.random() < self.rate:
            raise APIError(500, "injected fault (fault_error_rate)", type="server_error")


class InjectedStreamCut(Exception):
    pass


async def _cut(events, after: int):
    """Pass ``after`` content chunks (the chat role chunk does not count), then break the
    connection the way a crashing replica would."""
    sent = 0
    async for event in events:
        if sent >= after:
            raise InjectedStreamCut(f"stream cut after {after} chunks (fault_cut_stream_after)")
        yield event
        if '"role"' not in event:
            sent += 1


async def _abort_on_disconnect(request: Request, service: ReplicaService, seq: Sequence):
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            service.scheduler.abort(seq)
            return


def _pools(service: ReplicaService, pools) -> list[dict]:
    """The manager's pool statistics, with what the engine says of each pool: how many of
    the model's layers keep their cache there and the bytes of one page."""
    layers = getattr(service.engine, "pool_layers", None)
    planned = getattr(service.engine, "pool_page_bytes", lambda: None)()  # sim of a model
    sizes = list(planned) if planned else [None] * len(pools)
    storage = [service.manager.page_storage(i) for i in range(len(pools))]
    for i, store in enumerate(storage):
        if store is not None:
            sizes[i] = store[0].numel() * store.element_size()
    return [{**dataclasses.asdict(p), "layers": len(layers[i]) if layers else None,
             "page_bytes": sizes[i]} for i, p in enumerate(pools)]


def _stats(service: ReplicaService) -> dict:
    s = service.manager.stats()
    sched = service.scheduler
    return {
        "model": service.model_id,
        "engine": service.engine.describe(),
        "kv_cache": {
            "tokens_per_block": service.manager.config.tokens_per_block,
            "num_pages": s.num_pages, "free_pages": s.free_pages, "used_pages": s.used_pages,
            "cached_pages": s.cached_pages, "cached_blocks": s.cached_blocks,
            "pools": _pools(service, s.pools),
            "evicted_blocks": s.evicted_blocks,
        },
        "reuse": {
            "queries": s.reuse_queries, "query_tokens": s.query_tokens,
            "hit_tokens": s.hit_tokens,
            "hit_tokens_before_hybrid_pruning": s.hit_tokens_before_hybrid_pruning,
            # what the attention layers alone could have reused but the recurrent layers
            # could not (no snapshot there)
            "tokens_lost_to_hybrid_pruning": s.hit_tokens_before_hybrid_pruning - s.hit_tokens,
            "token_hit_rate": s.hit_rate,
        },
        "scheduler": {"running": len(sched.running), "waiting": len(sched.waiting),
                      "steps": sched.steps, "preemptions": sched.preemptions},
        "load": dataclasses.asdict(service.load()),
    }
