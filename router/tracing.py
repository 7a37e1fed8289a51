"""The spans of routed requests (OpenTelemetry), when tracing is on.

Imported only when tracing is configured (``RouterService.tracing``); with it off nothing
here runs and nothing from opentelemetry is imported. One routed request::

    router request            SERVER; continues the client's traceparent, else a new trace
    |-- tokenize              router.prompt_tokens
    |-- probe                 the fan-out: router.probe.targets, router.probe.answered
    |   `-- probe_reuse       CLIENT, one per probed replica: router.replica,
    |                         router.probe.num_tokens, ..._before_hybrid_pruning,
    |                         router.probe.latency_s, or the failure (status ERROR, error.type)
    |                         (the replica's "POST /probe_reuse" continues it)
    |-- choose                router.policy, router.chosen, router.reason, .score and
    |                         .estimated_ttft_s of router.chosen and router.runner_up
    `-- forward               CLIENT, one per attempt: router.attempt, router.replica,
                              router.retry_reason (attempts after the first),
                              http.response.status_code, router.outcome; the event
                              "first token" when the replica's first content came
                              (the replica's "POST /v1/..." continues it: queue, prefill, decode)

Steps are recorded by the code that runs them through ``Prepared.trace`` (None when off):
``tokenized`` after the request is prepared, ``probing`` / ``probed`` around the fan-out,
``chose`` after the policy, ``attempt`` per forwarding attempt (``AttemptTrace``).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from opentelemetry import propagate
from opentelemetry.trace import (SpanKind, Status, StatusCode, format_trace_id,
                                 set_span_in_context)

from wire.errors import APIError
from wire.tracing import Tracing, epoch_ns

from .upstream import ProbeResult

if TYPE_CHECKING:
    from .asgi import Handler
    from .forward import AttemptAccounting
    from .policies import Decision
    from .requests import Prepared

ROOT = "router request"
FIRST_TOKEN = "first token"


class RouterTracing:
    """The router's tracer, and the proxy handlers wrapped in a root span each."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def shutdown(self) -> None:
        self.tracing.shutdown()

    def traced(self, routes: dict[tuple[str, str], Handler]) -> dict[tuple[str, str], Handler]:
        """Each proxy handler inside a "router request" span; the handler gets the
        request's ``RequestTrace`` as its fourth argument."""
        return {(method, path): self._traced(handler, method, path)
                for (method, path), handler in routes.items()}

    def _traced(self, handler, method: str, path: str) -> Handler:
        tracer = self.tracing.tracer

        async def traced_handler(raw_headers, body: bytes, send) -> None:
            trace = RequestTrace(tracer, method, path, raw_headers)

            async def watched(message: dict) -> None:
                if message["type"] == "http.response.start":
                    trace.answered(message)
                await send(message)

            try:
                await handler(raw_headers, body, watched, trace)
            except BaseException as exc:
                trace.failed(exc)
                raise
            finally:
                trace.end()
        return traced_handler


class RequestTrace:
    """The spans of one routed request (see the module's docstring)."""

    def __init__(self, tracer, method: str, path: str,
                 raw_headers: list[tuple[bytes, bytes]]) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
        self.tracer = tracer
        self.started_ns = time.time_ns()
        attributes = {"http.request.method": method, "url.path": path, "http.route": path,
                      "url.scheme": "http"}
        if headers.get("host"):
            attributes.update(_address(headers["host"]))
        self.root = tracer.start_span(ROOT, propagate.extract(headers), SpanKind.SERVER,
                                      attributes, start_time=self.started_ns)
        self.context = set_span_in_context(self.root)
        span_context = self.root.get_span_context()
        # for the decision log: None when the provider makes no real spans
        self.trace_id = format_trace_id(span_context.trace_id) if span_context.is_valid else None
        self.status: int | None = None  # what the client got
        self._fanout = None
        self._probes: dict[str, object] = {}
        self._probe_start = 0

    # -- the steps ---------------------------------------------------------------------

    def tokenized(self, p: Prepared) -> None:
        """The request is validated and tokenized: from the root's start until now."""
        p.trace = self
        self.root.set_attribute("router.request_id", p.request_id)
        if p.model is not None:
            self.root.set_attribute("gen_ai.request.model", p.model)
        span = self.tracer.start_span("tokenize", self.context, start_time=self.started_ns,
                                      attributes={"router.prompt_tokens": p.route.num_tokens})
        span.end()

    def probing(self, urls: list[str]) -> dict[str, dict[str, str]]:
        """The fan-out starts: a span per probe; returns each probe's ``traceparent``
        (and ``tracestate``) headers, by replica."""
        now = self._probe_start = time.time_ns()
        self._fanout = self.tracer.start_span("probe", self.context, start_time=now,
                                              attributes={"router.probe.targets": len(urls)})
        inside = set_span_in_context(self._fanout)
        heads = {}
        for url in urls:
            span = self.tracer.start_span("probe_reuse", inside, SpanKind.CLIENT,
                                          _client_attributes(url, "/probe_reuse"),
                                          start_time=now)
            self._probes[url] = span
            heads[url] = _propagation(span)
        return heads

    def probed(self, results: dict[str, ProbeResult | Exception]) -> None:
        """The fan-out is over: each probe's answer (ended at its own round trip) or
        why it gave none."""
        end = time.time_ns()
        answered = 0
        for url, span in self._probes.items():
            result = results.get(url)
            if isinstance(result, ProbeResult):
                answered += 1
                answer = result.answer
                span.set_attributes({
                    "http.response.status_code": 200,
                    "router.probe.outcome": "answered",
                    "router.probe.num_tokens": answer.num_tokens,
                    "router.probe.num_tokens_before_hybrid_pruning":
                        answer.num_tokens_before_hybrid_pruning,
                    "router.probe.latency_s": result.seconds})
                span.end(self._probe_start + int(result.seconds * 1e9))
            else:
                late = isinstance(result, TimeoutError)
                span.set_attribute("router.probe.outcome", "late" if late else "failed")
                _error(span, "timeout" if late else type(result).__name__,
                       "no answer within the deadline" if late else f"{result}")
                span.end(end)
        self._probes = {}
        self._fanout.set_attribute("router.probe.answered", answered)
        self._fanout.end(end)
        self._fanout = None

    def chose(self, policy: str, decision: Decision, since: float) -> None:
        """The policy chose; ``since``: ``time.perf_counter()`` when choosing began."""
        now = time.time_ns()
        start = now - int((time.perf_counter() - since) * 1e9)
        by_name = {c.name: c for c in decision.candidates}
        ranked = decision.ranked()
        attributes = {"router.policy": policy, "router.reason": decision.reason,
                      "router.candidates": len(ranked)}
        attributes.update(_scored("router.chosen", by_name[decision.chosen]))
        if len(ranked) > 1:
            attributes.update(_scored("router.runner_up", by_name[ranked[1]]))
        span = self.tracer.start_span("choose", self.context, start_time=start,
                                      attributes=attributes)
        span.end(now)

    def attempt(self, number: int, replica: str, path: str,
                retry_reason: str | None) -> AttemptTrace:
        """A forwarding attempt begins (``number`` from 1; a retry says why)."""
        attributes = _client_attributes(replica, path)
        attributes["router.attempt"] = number
        if retry_reason is not None:
            attributes["router.retry_reason"] = retry_reason
        return AttemptTrace(self.tracer.start_span("forward", self.context, SpanKind.CLIENT,
                                                   attributes))

    # -- the answer --------------------------------------------------------------------

    def answered(self, message: dict) -> None:
        """The client's answer starts (``http.response.start``)."""
        self.status = message["status"]
        for name, value in message.get("headers", ()):
            if name == b"x-replica":
                self.root.set_attribute("router.replica", value.decode("latin-1"))

    def failed(self, exc: BaseException) -> None:
        """The handler raised: an APIError is the client's answer (sent by the server)."""
        if isinstance(exc, asyncio.CancelledError):
            self.root.set_attribute("router.cancelled", True)  # the client left
        elif self.status is None and isinstance(exc, APIError):
            self.status = exc.status
            if exc.status >= 500:
                self.root.record_exception(exc)
        elif self.status is None:
            self.status = 500
            self.root.record_exception(exc)

    def end(self) -> None:
        root = self.root
        for span in self._probes.values():  # the request was cancelled during the fan-out
            span.end()
        if self._fanout is not None:
            self._fanout.end()
        if self.status is not None:
            root.set_attribute("http.response.status_code", self.status)
            if self.status >= 500:  # a server span's error (4xx are the client's)
                _error(root, str(self.status), None)
        root.end()


class AttemptTrace:
    """The "forward" span of one attempt (``AttemptAccounting.trace``)."""

    __slots__ = ("span", "status")

    def __init__(self, span) -> None:
        self.span = span
        self.status: int | None = None  # the replica's

    def inject(self, headers: dict[str, str]) -> None:
        """``traceparent`` (and ``tracestate``) for the forwarded request."""
        headers.update(_propagation(self.span))

    def responded(self, status: int) -> None:
        self.status = status
        self.span.set_attribute("http.response.status_code", status)

    def first_token(self, at: float) -> None:
        """The replica's first content event came (``at``: ``time.monotonic()``)."""
        self.span.add_event(FIRST_TOKEN, timestamp=epoch_ns(at))

    def ended(self, accounting: AttemptAccounting) -> None:
        span = self.span
        outcome = (accounting.outcome or ("failed" if accounting.failure else None)
                   or ("refused" if self.status is not None and self.status >= 400
                       else "cancelled"))
        span.set_attribute("router.outcome", outcome)
        usage = accounting.usage
        if usage:
            span.set_attributes({
                "gen_ai.usage.input_tokens": usage.get("prompt_tokens", 0),
                "gen_ai.usage.output_tokens": usage.get("completion_tokens", 0),
                "router.cached_tokens":
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0})
        if outcome in ("failed", "broken", "timeout", "refused"):
            # error.type: the replica's status when it answered one, else what went wrong
            refused = self.status is not None and self.status >= 400
            _error(span, str(self.status) if refused else outcome,
                   accounting.failure or ("no complete answer in time" if outcome == "timeout"
                                          else None))
        span.end()


def _propagation(span) -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, set_span_in_context(span))
    return carrier


def _scored(prefix: str, candidate) -> dict:
    out = {prefix: candidate.name}
    if candidate.score is not None:
        out[prefix + ".score"] = candidate.score
    if candidate.estimate:  # prefix: (estimated TTFT in s, reuse, queued)
        out[prefix + ".estimated_ttft_s"] = candidate.estimate[0]
    if candidate.reuse is not None:
        out[prefix + ".reuse"] = candidate.reuse
    return out


def _client_attributes(base_url: str, path: str) -> dict:
    scheme, _, rest = base_url.partition("://")
    attributes = {"http.request.method": "POST", "url.full": base_url.rstrip("/") + path,
                  "router.replica": base_url}
    attributes.update(_address(rest.split("/", 1)[0], 443 if scheme == "https" else 80))
    return attributes


def _address(hostport: str, default_port: int = 80) -> dict:
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or host.endswith(":"):  # no port (or a bare IPv6)
        host, port = hostport, str(default_port)
    return {"server.address": host.strip("[]"), "server.port": int(port)}


def _error(span, kind: str, description: str | None) -> None:
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, description))
