"""The spans of one routed request, across the router and live sim replicas (in this
process, each side with an in-memory exporter of its own: the replicas' spans join the
router's trace only through the ``traceparent`` they are sent)."""

from __future__ import annotations

import contextlib
import json
import logging

import httpx
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.tracing.servers import cluster
from tests.waiting import until

ROUTER_SPANS = ["choose", "forward", "probe", "probe_reuse", "probe_reuse", "router request",
                "tokenize"]
REPLICA_SPANS = ["POST /probe_reuse", "POST /probe_reuse", "POST /v1/chat/completions",
                 "decode", "prefill", "queue"]
MESSAGES = [{"role": "user", "content": "where does this request spend its time? " * 8}]
CLIENT_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN_ID = 0xB7AD6B7169203331


class Exported:
    """A TracerProvider whose spans are kept in memory, exported as each one ends."""

    def __init__(self, service: str) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource({"service.name": service}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self) -> list:
        return list(self.exporter.get_finished_spans())

    def names(self) -> list[str]:
        return sorted(s.name for s in self.spans())


@contextlib.contextmanager
def decisions():
    """The router's decision log lines, as parsed JSON."""
    lines: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(json.loads(record.getMessage()))

    log = logging.getLogger("router.decisions")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.fixture(scope="module")
def traced():
    """Two sim replicas and a router, traced; the first request warms one replica's cache
    with MESSAGES (so the next is routed there on its probed reuse); exporters emptied."""
    router_side, replica_side = Exported("router"), Exported("replica")
    # a generous probe deadline: a late probe (a loaded test machine) is not this test's case
    with cluster(2, router_side.provider, replica_side.provider,
                 probe_deadline_ms=5000) as (router, replicas):
        complete(router, {"messages": MESSAGES, "max_tokens": 4})
        until(lambda: router_side.names() == ROUTER_SPANS
              and replica_side.names() == REPLICA_SPANS, "the first request's spans")
        yield router, replicas, router_side, replica_side


def complete(router: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response,
                                                                            dict, str]:
    """Send a chat completion; (response, usage, finish reason), from a stream too."""
    response = httpx.post(router + "/v1/chat/completions", json=body, headers=headers,
                          timeout=30)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        answer = response.json()
        return response, answer["usage"], answer["choices"][0]["finish_reason"]
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    finish = next(c["choices"][0]["finish_reason"] for c in chunks
                  if c["choices"] and c["choices"][0].get("finish_reason"))
    return response, next(c["usage"] for c in chunks if c.get("usage")), finish


def one_trace(traced, body: dict, headers: dict | None = None):
    """Route one request; its response, usage, finish reason and every span, by side."""
    router, _, router_side, replica_side = traced
    router_side.exporter.clear()
    replica_side.exporter.clear()
    with decisions() as lines:
        response, usage, finish = complete(router, body, headers)
    until(lambda: router_side.names() == ROUTER_SPANS and replica_side.names() == REPLICA_SPANS,
          lambda: f"the request's spans: {router_side.names()} {replica_side.names()}")
    return response, usage, finish, lines, router_side.spans(), replica_side.spans()


def by_name(spans, name: str):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


def children(spans, parent) -> list[str]:
    return sorted(s.name for s in spans
                  if s.parent is not None and s.parent.span_id == parent.context.span_id)


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_one_routed_request_is_one_trace_from_the_router_into_the_replica(traced, stream):
    _, replicas, _, _ = traced
    body = {"messages": MESSAGES, "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response, usage, finish, lines, ours, theirs = one_trace(traced, body)
    chosen = response.headers["x-replica"]
    (other,) = [url for url in replicas if url != chosen]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0  # routed to the replica that had the prompt (the fixture's request)

    # -- the router's tree ------------------------------------------------------------
    root = by_name(ours, "router request")
    assert root.parent is None and root.kind is SpanKind.SERVER  # no traceparent: a new trace
    trace_id = root.context.trace_id
    assert {s.context.trace_id for s in ours + theirs} == {trace_id}
    assert children(ours, root) == ["choose", "forward", "probe", "tokenize"]
    assert root.attributes["http.request.method"] == "POST"
    assert root.attributes["url.path"] == "/v1/chat/completions"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["router.request_id"] == response.headers["x-request-id"]
    assert root.attributes["router.replica"] == chosen

    tokenize = by_name(ours, "tokenize")
    assert tokenize.attributes["router.prompt_tokens"] == usage["prompt_tokens"]

    fan_out = by_name(ours, "probe")
    assert children(ours, fan_out) == ["probe_reuse", "probe_reuse"]
    assert (fan_out.attributes["router.probe.targets"],
            fan_out.attributes["router.probe.answered"]) == (2, 2)
    probes = {s.attributes["router.replica"]: s for s in ours if s.name == "probe_reuse"}
    assert sorted(probes) == sorted(replicas)
    for url, reuse in ((chosen, cached), (other, 0)):
        probe = probes[url]
        assert probe.kind is SpanKind.CLIENT
        assert probe.attributes["router.probe.num_tokens"] == reuse
        assert probe.attributes["router.probe.num_tokens_before_hybrid_pruning"] == reuse
        assert probe.attributes["router.probe.outcome"] == "answered"
        assert probe.attributes["http.response.status_code"] == 200
        # the span lasts the probe's round trip, as measured
        assert probe.end_time - probe.start_time == int(
            probe.attributes["router.probe.latency_s"] * 1e9)

    choose = by_name(ours, "choose")
    a = choose.attributes
    assert (a["router.policy"], a["router.chosen"], a["router.runner_up"]) == \
        ("prefix", chosen, other)
    assert (a["router.chosen.reuse"], a["router.runner_up.reuse"]) == (cached, 0)
    assert a["router.chosen.score"] < a["router.runner_up.score"]
    assert a["router.chosen.estimated_ttft_s"] < a["router.runner_up.estimated_ttft_s"]
    assert a["router.reason"].startswith("lowest expected TTFT")

    forward = by_name(ours, "forward")
    a = forward.attributes
    assert forward.kind is SpanKind.CLIENT
    assert (a["router.attempt"], a["router.replica"], a["router.outcome"],
            a["http.response.status_code"]) == (1, chosen, "ok", 200)
    assert "router.retry_reason" not in a  # the first attempt
    assert a["url.full"] == chosen + "/v1/chat/completions"
    assert (a["router.cached_tokens"], a["gen_ai.usage.input_tokens"],
            a["gen_ai.usage.output_tokens"]) == (cached, usage["prompt_tokens"],
                                                 usage["completion_tokens"])
    assert [e.name for e in forward.events] == ["first token"]
    assert forward.start_time <= forward.events[0].timestamp <= forward.end_time

    # -- the replicas continue it -----------------------------------------------------
    served = by_name(theirs, "POST /v1/chat/completions")
    assert served.parent.span_id == forward.context.span_id and served.parent.is_remote
    assert served.kind is SpanKind.SERVER
    assert served.attributes["server.port"] == int(chosen.rsplit(":", 1)[1])
    assert served.attributes["replica.request_id"] == response.headers["x-request-id"]
    assert served.attributes["http.response.status_code"] == 200
    assert children(theirs, served) == ["decode", "prefill", "queue"]
    queue, prefill, decode = (by_name(theirs, n) for n in ("queue", "prefill", "decode"))
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert dict(prefill.attributes) == {
        "replica.prompt_tokens": usage["prompt_tokens"], "replica.cached_tokens": cached,
        "replica.computed_tokens": usage["prompt_tokens"] - cached}
    assert dict(decode.attributes) == {"replica.generated_tokens": usage["completion_tokens"],
                                       "replica.finish_reason": finish}
    for s in (s for s in theirs if s.name == "POST /probe_reuse"):  # each under its probe
        port = s.attributes["server.port"]
        (probe,) = [p for url, p in probes.items() if url.endswith(f":{port}")]
        assert s.parent.span_id == probe.context.span_id
        assert s.attributes["replica.probe.num_tokens"] == \
            probe.attributes["router.probe.num_tokens"]

    # -- the decision log names the trace ---------------------------------------------
    (line,) = lines
    assert (line["request_id"], line["chosen"], line["trace_id"]) == \
        (response.headers["x-request-id"], chosen, f"{trace_id:032x}")


def test_a_client_traceparent_is_continued(traced):
    parent = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
    _, _, _, lines, ours, theirs = one_trace(
        traced, {"messages": MESSAGES, "max_tokens": 2}, {"traceparent": parent})
    root = by_name(ours, "router request")
    assert (root.context.trace_id, root.parent.span_id, root.parent.is_remote) == \
        (CLIENT_TRACE_ID, CLIENT_SPAN_ID, True)
    assert {s.context.trace_id for s in ours + theirs} == {CLIENT_TRACE_ID}
    assert lines[0]["trace_id"] == f"{CLIENT_TRACE_ID:032x}"


def test_a_retry_is_a_second_forward_span_saying_why():
    """Round robin over a replica that answers every completion 500 and a sound one: of two
    requests, the one sent to the failing replica first is retried on the other."""
    router_side, replica_side = Exported("router"), Exported("replica")
    with cluster(2, router_side.provider, replica_side.provider, policy="round_robin",
                 replica_settings=[{"fault_error_rate": 1.0}, {}]) as (router, replicas):
        failing, sound = replicas
        served = [complete(router, {"messages": MESSAGES, "max_tokens": 2})[0]
                  for _ in range(2)]
        assert [r.headers["x-replica"] for r in served] == [sound, sound]
        until(lambda: router_side.names().count("router request") == 2
              and replica_side.names().count("decode") == 2
              and replica_side.names().count("POST /v1/chat/completions") == 3,
              "both requests' spans, and the refused attempt's")
    spans = router_side.spans()
    (root,) = [s for s in spans if s.name == "router request"
               and children(spans, s) == ["choose", "forward", "forward", "tokenize"]]
    first, second = sorted((s for s in spans if s.name == "forward"
                            and s.parent.span_id == root.context.span_id),
                           key=lambda s: s.attributes["router.attempt"])
    assert (first.attributes["router.attempt"], first.attributes["router.replica"],
            first.attributes["http.response.status_code"], first.attributes["router.outcome"],
            first.attributes["error.type"]) == (1, failing, 500, "failed", "500")
    assert first.status.status_code.name == "ERROR"
    assert first.events == ()  # no first token from the failing replica
    assert "router.retry_reason" not in first.attributes
    assert (second.attributes["router.attempt"], second.attributes["router.replica"],
            second.attributes["router.retry_reason"], second.attributes["router.outcome"]) == \
        (2, sound, "replica answered 500", "ok")
    assert [e.name for e in second.events] == ["first token"]
    assert root.attributes["http.response.status_code"] == 200
    # each attempt is continued by its replica: the failing one's span says 500, and has
    # no queue, prefill or decode (the request never reached the scheduler)
    theirs = replica_side.spans()
    refused, continued = sorted(
        (s for s in theirs if s.name == "POST /v1/chat/completions"
         and s.context.trace_id == root.context.trace_id),
        key=lambda s: s.attributes["http.response.status_code"], reverse=True)
    assert (refused.parent.span_id, refused.attributes["http.response.status_code"],
            refused.attributes["error.type"], refused.status.status_code.name) == (
        first.context.span_id, 500, "500", "ERROR")
    assert children(theirs, refused) == []
    assert continued.parent.span_id == second.context.span_id
    assert children(theirs, continued) == ["decode", "prefill", "queue"]


def test_a_request_the_replica_refuses_is_a_server_span_with_its_status(traced):
    """A wrong model (404) and a prompt of ids outside the vocabulary (400), sent to a
    replica directly: each is one server span with the status, continuing the caller's
    trace; a 4xx is the caller's error, not the server's (no ERROR status)."""
    _, replicas, _, replica_side = traced
    replica_side.exporter.clear()
    parent = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
    wrong_model = httpx.post(replicas[0] + "/v1/chat/completions", timeout=30,
                             headers={"traceparent": parent},
                             json={"model": "nope", "messages": MESSAGES, "max_tokens": 2})
    bad_ids = httpx.post(replicas[0] + "/v1/completions", timeout=30,
                         headers={"traceparent": parent},
                         json={"prompt": [1, 2, 10**6], "max_tokens": 2})
    assert (wrong_model.status_code, bad_ids.status_code) == (404, 400), bad_ids.text
    until(lambda: replica_side.names() == ["POST /v1/chat/completions", "POST /v1/completions"],
          lambda: f"both refusals' spans: {replica_side.names()}")
    spans = sorted(replica_side.spans(), key=lambda s: s.start_time)
    assert [(s.attributes["http.response.status_code"], s.status.status_code.name,
             s.context.trace_id, s.parent.span_id) for s in spans] == [
        (404, "UNSET", CLIENT_TRACE_ID, CLIENT_SPAN_ID),
        (400, "UNSET", CLIENT_TRACE_ID, CLIENT_SPAN_ID)]
