"""The replica's spans (OpenTelemetry), when tracing is on.

Imported only when tracing is configured (``ReplicaService.tracing``). Each span continues
the ``traceparent`` the request came with (the router's "forward" or "probe_reuse" span)::

    POST /v1/chat/completions   SERVER: replica.request_id, http.response.status_code
    |-- queue                   arrival -> first admitted to the running batch
    |-- prefill                 -> first token: replica.prompt_tokens,
    |                           replica.cached_tokens, replica.computed_tokens
    `-- decode                  -> finished: replica.generated_tokens, replica.finish_reason
    POST /probe_reuse           SERVER: replica.probe.num_tokens, ..._before_hybrid_pruning

The scheduler carries no spans: it stamps the ``Sequence`` (``arrival``, ``scheduled_at``,
``first_token_at``, ``finished_at``, all ``time.monotonic()``), and the three children are
made from those stamps, with explicit start and end times, once the answer is over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from wire.errors import APIError
from wire.probe import ProbeAnswer
from wire.tracing import Tracing, epoch_ns

from .sequence import Sequence


class ReplicaTracing:
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self.tracer = tracing.tracer

    def shutdown(self) -> None:
        self.tracing.shutdown()

    def completion(self, scope: dict, request_id: str):
        """The server span of a completion request, from now until ``finished``."""
        attributes = _server(scope)
        attributes["replica.request_id"] = request_id
        return self.tracer.start_span(f"{scope['method']} {scope['path']}", _parent(scope),
                                      SpanKind.SERVER, attributes)

    def refused(self, span, exc: APIError) -> None:
        """The request was refused before it was queued: an injected fault (500), a model
        not served here (404), a prompt it cannot take (400), a full queue (429), a drain
        (503). The server span alone, with the status."""
        span.set_attribute("http.response.status_code", exc.status)
        if exc.status >= 500:
            _error(span, str(exc.status), str(exc))
        span.end()

    async def streamed(self, events: AsyncIterator[str], span, seq: Sequence):
        """``events`` as they come; the spans end when the stream does (or breaks)."""
        error = None
        try:
            async for event in events:
                yield event
        except BaseException as exc:
            error = exc
            raise
        finally:
            await events.aclose()  # its own clean-up (the sequence aborted) first
            self.finished(span, seq, error)

    def finished(self, span, seq: Sequence, error: BaseException | None = None) -> None:
        """End the server span, with its queue, prefill and decode children."""
        now_ns, now_mono = time.time_ns(), time.monotonic_ns()

        def at(t: float) -> int:
            return epoch_ns(t, now_ns, now_mono)

        end = seq.finished_at if seq.finished_at is not None else now_mono / 1e9
        scheduled, first = seq.scheduled_at, seq.first_token_at
        inside = set_span_in_context(span)
        self.tracer.start_span("queue", inside, start_time=at(seq.arrival)).end(
            at(scheduled if scheduled is not None else end))
        if scheduled is not None:
            cached = seq.cached_tokens or 0
            self.tracer.start_span("prefill", inside, start_time=at(scheduled), attributes={
                "replica.prompt_tokens": len(seq.prompt), "replica.cached_tokens": cached,
                "replica.computed_tokens": len(seq.prompt) - cached,
            }).end(at(first if first is not None else end))
        if first is not None:
            self.tracer.start_span("decode", inside, start_time=at(first), attributes={
                "replica.generated_tokens": len(seq.output),
                # not finished yet: its abort (the client left) waits for the engine step
                "replica.finish_reason": seq.finish_reason or "abort",
            }).end(at(end))
        status = 200
        if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            span.set_attribute("replica.cancelled", True)  # the client left
        elif isinstance(error, APIError):
            status = error.status
        elif error is not None:
            span.record_exception(error)
            _error(span, type(error).__name__, str(error))
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            _error(span, str(status), str(error))
        span.end()

    def probe(self, scope: dict, started_ns: int, answer: ProbeAnswer) -> None:
        """A span for an answered probe, from ``started_ns`` until now."""
        attributes = _server(scope)
        attributes.update({"http.response.status_code": 200,
                           "replica.probe.num_tokens": answer.num_tokens,
                           "replica.probe.num_tokens_before_hybrid_pruning":
                               answer.num_tokens_before_hybrid_pruning})
        self.tracer.start_span("POST /probe_reuse", _parent(scope), SpanKind.SERVER,
                               attributes, start_time=started_ns).end()


def _parent(scope: dict):
    """The trace context the request carries (W3C ``traceparent``; OTEL_PROPAGATORS)."""
    return propagate.extract({k.decode("latin-1"): v.decode("latin-1")
                              for k, v in scope["headers"]})


def _server(scope: dict) -> dict:
    path = scope["path"]
    attributes = {"http.request.method": scope["method"], "url.path": path,
                  "http.route": path, "url.scheme": scope.get("scheme", "http")}
    server = scope.get("server")
    if server:
        attributes["server.address"], attributes["server.port"] = server[0], server[1]
    return attributes


def _error(span, kind: str, description: str | None) -> None:
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, description))
