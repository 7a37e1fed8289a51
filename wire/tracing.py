"""OpenTelemetry set-up shared by the router and the replicas (the optional ``otel`` extra).

Tracing is off unless asked for: by the setting ``otel_endpoint`` (``--otel-endpoint URL``,
``ROUTER_OTEL_ENDPOINT`` / ``REPLICA_OTEL_ENDPOINT``, a YAML key) or by the standard
environment (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or
``OTEL_TRACES_EXPORTER`` other than ``none``). Off, ``setup`` returns None, nothing imports
opentelemetry's SDK, and each hook on the request paths is one ``is None`` test.

On, everything the SDK reads from the environment it still reads there: the resource
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), the sampler (``OTEL_TRACES_SAMPLER``,
``OTEL_TRACES_SAMPLER_ARG``), the batch processor (``OTEL_BSP_*``), the exporter's headers,
timeout, compression and certificates (``OTEL_EXPORTER_OTLP_*``), the propagators
(``OTEL_PROPAGATORS``, W3C trace context and baggage by default), ``OTEL_SDK_DISABLED``.
Spans go through a ``BatchSpanProcessor`` to the OTLP/HTTP exporter (or the exporters
``OTEL_TRACES_EXPORTER`` names, found through the SDK's entry points); ``shutdown`` flushes
them. The global tracer provider is never set: a FastAPI that traces by itself when one is
(0.165 and later) keeps out of it, and tests inject a provider per service.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

INSTALL_HINT = "pip install prefix-router[otel]"
TRACES_PATH = "/v1/traces"


class TracingUnavailable(ValueError):
    """Tracing was asked for and cannot be had (the extra is not installed, or the
    configuration names something that does not exist): a start-up error."""


@dataclass
class Tracing:
    """The tracer one side (router or replica) makes its spans with."""

    provider: Any  # opentelemetry.sdk.trace.TracerProvider (or any API TracerProvider)
    tracer: Any
    owned: bool = False  # made here from the configuration: shut down (flushed) on stop

    def shutdown(self) -> None:
        if self.owned:
            self.provider.shutdown()


def requested(endpoint: str | None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether tracing is asked for: the setting, else the standard environment."""
    if endpoint:
        return True
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup(endpoint: str | None, service_name: str, scope: str,
          provider: Any = None) -> Tracing | None:
    """The side's tracing, or None when it is off.

    Args:
        endpoint: the ``otel_endpoint`` setting: an OTLP/HTTP collector's base URL
            (``http://collector:4318``; ``/v1/traces`` is appended unless given).
        service_name: ``service.name`` unless ``OTEL_SERVICE_NAME`` (or
            ``OTEL_RESOURCE_ATTRIBUTES``) names one.
        scope: the instrumentation scope of the spans (``router``, ``replicas``).
        provider: a TracerProvider to use instead of any configuration (tests inject an
            in-memory one); it stays the caller's to shut down.

    Raises TracingUnavailable when tracing is asked for and the extra is missing.
    """
    if provider is not None:
        return Tracing(provider, provider.get_tracer(scope))
    if not requested(endpoint):
        return None
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise TracingUnavailable(f"otel_endpoint {endpoint!r} must be an http:// or https:// "
                                 "URL (an OTLP/HTTP collector, e.g. http://127.0.0.1:4318)")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        exporters = _exporters(endpoint)
    except ImportError as exc:
        raise TracingUnavailable(
            f"tracing is configured ({_why_on(endpoint)}) but the OpenTelemetry SDK is not "
            f"installed ({exc}): {INSTALL_HINT}") from None
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service_name}))
    made = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER(_ARG)
    for exporter in exporters:
        made.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_*
    return Tracing(made, made.get_tracer(scope), owned=True)


def _why_on(endpoint: str | None) -> str:
    if endpoint:
        return f"otel_endpoint {endpoint}"
    names = [n for n in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                         "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") if os.environ.get(n)]
    return "environment " + ", ".join(names)


def _exporters(endpoint: str | None) -> list:
    """The span exporters: OTLP/HTTP to ``endpoint`` when the setting gives one, else those
    ``OTEL_TRACES_EXPORTER`` names (default ``otlp``), each configured by the environment.
    ``otlp`` is OTLP/HTTP (what the extra installs) unless ``OTEL_EXPORTER_OTLP_PROTOCOL``
    (or its ``_TRACES_`` form) says ``grpc``; other names are looked up as the SDK's own
    configurator does, among the ``opentelemetry_traces_exporter`` entry points."""
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        base = endpoint.rstrip("/")
        return [OTLPSpanExporter(endpoint=base if base.endswith(TRACES_PATH)
                                 else base + TRACES_PATH)]
    env = os.environ
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    out = []
    for name in names:
        if name in ("", "none"):
            continue
        if name == "otlp":
            name = "otlp_proto_grpc" if protocol == "grpc" else "otlp_proto_http"
        if name == "otlp_proto_http":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            out.append(OTLPSpanExporter())  # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT and the rest
        else:
            out.append(_by_entry_point(name))
    return out


def _by_entry_point(name: str):
    """An exporter another package registers (``console`` comes with the SDK)."""
    from importlib.metadata import entry_points

    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        known = sorted({"otlp", *(e.name for e in entry_points(
            group="opentelemetry_traces_exporter"))})
        raise TracingUnavailable(f"OTEL_TRACES_EXPORTER names {name!r}, which no installed "
                                 f"package provides; known: {', '.join(known)}")
    return next(iter(found)).load()()


def epoch_ns(monotonic_s: float, now_ns: int | None = None,
             now_monotonic_ns: int | None = None) -> int:
    """A ``time.monotonic()`` reading as the epoch nanoseconds spans are stamped with.
    Converting several readings with one (``now_ns``, ``now_monotonic_ns``) pair keeps
    their differences exact."""
    if now_ns is None:
        now_ns, now_monotonic_ns = time.time_ns(), time.monotonic_ns()
    return now_ns - now_monotonic_ns + int(monotonic_s * 1e9)
