"""Tracing's configuration: when it is on, what the SDK takes from the environment, the
OTLP/HTTP export (flushed on shutdown), and the start-up error without the extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench._common import OTLPSink
from replicas.settings import parse_args as replica_args
from router.settings import parse_args as router_args
from wire import tracing
from wire.tracing import TracingUnavailable

ROOT = Path(__file__).resolve().parents[2]
OTEL_ENV = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME",
            "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch):
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FASTAPI_OTEL"))}
    return {**env, **extra}


@pytest.mark.parametrize("endpoint, env, on", [
    (None, {}, False),
    ("http://collector:4318", {}, True),
    ("http://collector:4318", {"OTEL_TRACES_EXPORTER": "none"}, True),  # the flag wins
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    (None, {"OTEL_TRACES_EXPORTER": "console"}, True),
    (None, {"OTEL_TRACES_EXPORTER": "otlp"}, True),
    (None, {"OTEL_TRACES_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    (None, {"OTEL_SDK_DISABLED": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    (None, {"OTEL_SERVICE_NAME": "router"}, False),  # naming a service asks for nothing
])
def test_tracing_is_on_only_when_asked_for(endpoint, env, on):
    assert tracing.requested(endpoint, env) is on


def test_off_there_is_no_tracing_to_hold():
    assert tracing.setup(None, "router", "router") is None


def test_both_commands_take_the_endpoint_as_a_flag_and_from_their_environment(monkeypatch):
    url = "http://collector:4318"
    assert router_args(["--otel-endpoint", url]).otel_endpoint == url
    assert replica_args(["--otel-endpoint", url]).otel_endpoint == url
    monkeypatch.setenv("ROUTER_OTEL_ENDPOINT", url)
    monkeypatch.setenv("REPLICA_OTEL_ENDPOINT", url)
    assert (router_args([]).otel_endpoint, replica_args([]).otel_endpoint) == (url, url)


def test_an_endpoint_that_is_no_http_url_is_refused():
    with pytest.raises(TracingUnavailable, match="must be an http:// or https:// URL"):
        tracing.setup("collector:4318", "router", "router")


class Collector(OTLPSink):
    """An OTLP/HTTP collector on a loopback port: keeps each export request it gets."""

    def __init__(self) -> None:
        super().__init__(keep=True)

    def spans(self) -> list[tuple[str, str]]:
        """(service.name, span name) of everything exported to /v1/traces."""
        out = []
        for path, content_type, body in self.received:
            assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
            request = ExportTraceServiceRequest.FromString(body)
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                out += [(service, span.name) for scope in resource_spans.scope_spans
                        for span in scope.spans]
        return out


def test_the_endpoint_setting_exports_over_otlp_http_and_shutdown_flushes_the_batch():
    with Collector() as collector:
        made = tracing.setup(collector.url, "router", "router")
        made.tracer.start_span("one").end()
        assert collector.spans() == []  # batched, not sent one by one
        made.shutdown()
        assert collector.spans() == [("router", "one")]


def test_the_standard_environment_configures_the_export_and_the_service_name(monkeypatch):
    with Collector() as collector:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)  # base: +/v1/traces
        monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-router")
        made = tracing.setup(None, "router", "router")
        made.tracer.start_span("two").end()
        made.shutdown()
        assert collector.spans() == [("edge-router", "two")]


@pytest.mark.parametrize("sampler, recorded", [(None, True), ("always_off", False),
                                               ("always_on", True)])
def test_the_sampler_is_the_sdks_from_the_environment(monkeypatch, sampler, recorded):
    if sampler is not None:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    made = tracing.setup("http://127.0.0.1:9", "router", "router")
    try:
        assert made.tracer.start_span("sampled?").is_recording() is recorded
    finally:
        made.provider.shutdown()  # nothing recorded is pending: no export is tried


def test_exporters_named_by_the_environment_come_from_their_entry_points():
    code = ("from wire import tracing\n"
            "made = tracing.setup(None, 'replica', 'replicas')\n"
            "made.tracer.start_span('to the console').end()\n"
            "made.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          env=clean_env(OTEL_TRACES_EXPORTER="console"), text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"name": "to the console"' in done.stdout
    assert '"service.name": "replica"' in done.stdout


def test_an_exporter_no_package_provides_is_a_start_up_error(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "nosuchexporter")
    with pytest.raises(TracingUnavailable, match="'nosuchexporter', which no installed "
                       "package provides; known: console, otlp, otlp_proto_http"):
        tracing.setup(None, "router", "router")


# The SDK and the exporter made unimportable, as when the extra is not installed (the API
# is there either way: FastAPI depends on it)
WITHOUT_SDK = """
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
from %s.__main__ import main
sys.exit(main(%r))
"""


@pytest.mark.parametrize("module, argv, env", [
    ("router", ["--otel-endpoint", "http://127.0.0.1:4318"], {}),
    ("router", [], {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}),
    ("replicas", ["--engine", "sim", "--otel-endpoint", "http://127.0.0.1:4318"], {}),
    ("replicas", ["--engine", "sim"], {"OTEL_TRACES_EXPORTER": "otlp"}),
], ids=["router-flag", "router-env", "replica-flag", "replica-env"])
def test_tracing_asked_for_without_the_extra_stops_start_up_saying_what_to_install(
        module, argv, env):
    done = subprocess.run([sys.executable, "-c", WITHOUT_SDK % (module, argv)], cwd=ROOT,
                          env=clean_env(**env), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "the OpenTelemetry SDK is not installed" in done.stderr
    assert "pip install prefix-router[otel]" in done.stderr


def test_the_example_environment_file_turns_tracing_on_as_it_says(monkeypatch):
    env = dict(line.split("=", 1) for line in (ROOT / "config" / "otel.env").read_text()
               .splitlines() if line and not line.startswith("#"))
    assert tracing.requested(None, env)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    made = tracing.setup(None, "replica", "replicas")
    try:
        assert made.provider.sampler.get_description().startswith(
            "ParentBased{root:TraceIdRatioBased{0.1}")
        assert (made.provider.resource.attributes["service.name"],
                made.provider.resource.attributes["deployment.environment"]) == \
            ("replica", "staging")
    finally:
        made.provider.shutdown()  # nothing was recorded: no export is tried
