"""Schemathesis against the live replica's and router's OpenAPI schemas.

Every operation is fuzzed in three ways: schemathesis's positive mode (bodies the schema
allows), its negative mode (bodies it forbids) and "plausible" positive bodies, nudged past the
validators that JSON Schema cannot express (n=1, a prompt present, token ids in the vocabulary)
so that the generation path is reached, not only the 400 path. Every response must be no 5xx
and must match the schema of its status code. Derandomized, so a run is reproducible.
"""

from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance

from tests.procs import Proc

pytestmark = pytest.mark.slow

REPLICA_ARGS = ("--engine", "sim", "--sim-speedup", "1000", "--max-model-len", "2048",
                "--log-level", "warning")
CHECKS = [not_a_server_error, response_schema_conformance]
MIN_CASES = 1000
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/probe_reuse")

# Each run draws examples of its own (a fixed seed would replay the same ones forever),
# except in CI (CI set), where the same examples every run keep a failure reproducible.
IN_CI = bool(os.environ.get("CI"))


@pytest.fixture(scope="module")
def replica():
    with Proc("replicas", *REPLICA_ARGS) as rep:
        yield rep


@pytest.fixture(scope="module")
def router():
    with Proc("replicas", *REPLICA_ARGS) as a, Proc("replicas", *REPLICA_ARGS) as b, \
            Proc("router", "--replicas", f"{a.url},{b.url}", "--log-level", "warning") as rt:
        yield rt


def _dangling_refs(doc: dict) -> set[str]:
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)))
    return refs - set(doc.get("components", {}).get("schemas", {}))


def _plausible(case):
    """Nudge a positive case past the validators that the JSON Schema does not express."""
    body = case.body
    if not isinstance(body, dict):
        return case
    body = dict(body)
    body["n"] = 1
    for key in ("echo", "logprobs", "top_logprobs", "best_of"):
        body.pop(key, None)
    stop = body.get("stop")
    if isinstance(stop, list):
        body["stop"] = [s for s in stop if s][:4]
    elif stop == "":
        body["stop"] = None
    for key in ("prompt_token_ids", "token_ids"):
        if isinstance(body.get(key), list):
            body[key] = [t % 260 for t in body[key]] or None
    body.pop("prompt_token_ids_b64", None)
    body.pop("token_ids_b64", None)
    if case.path == "/v1/completions":
        if not body.get("prompt_token_ids") and (not isinstance(body.get("prompt"), str)
                                                 or not body["prompt"]):
            body["prompt"] = "hello"
    if "messages" in body and isinstance(body["messages"], list):
        for m in body["messages"]:
            if isinstance(m.get("content"), list):
                m["content"] = [{"type": "text", "text": p.get("text") or "x"}
                                for p in m["content"]]
    case.body = body
    return case


def fuzz(base_url: str, doc: dict, per_mode: int) -> tuple[int, list[str]]:
    schema = schemathesis.openapi.from_dict(doc)
    session = requests.Session()
    total, failures = 0, []
    for result in schema.get_all_operations():
        op = result.ok()
        strategies = {mode.value: op.as_strategy(generation_mode=mode) for mode in GenerationMode}
        if op.path in GENERATION_PATHS:
            strategies["plausible"] = strategies["positive"].map(_plausible)
        for name, strategy in strategies.items():
            seen = 0

            @settings(max_examples=per_mode, deadline=None, derandomize=IN_CI, database=None,
                      suppress_health_check=list(HealthCheck),
                      phases=[Phase.explicit, Phase.generate, Phase.shrink])
            @given(case=strategy)
            def run(case):
                nonlocal seen
                seen += 1
                case.call_and_validate(base_url=base_url, session=session, checks=CHECKS,
                                       timeout=30)

            try:
                run()
            except Unsatisfiable:
                pass  # e.g. the negative mode of an operation without inputs
            except Exception as exc:  # noqa: BLE001 - every failure is reported at the end
                failures.append(f"{op.label} [{name}]: {exc}")
            total += seen
    return total, failures


def test_replica_schema(replica):
    doc = httpx.get(replica.url + "/openapi.json").json()
    assert not _dangling_refs(doc)
    started = time.monotonic()
    total, failures = fuzz(replica.url, doc, per_mode=150)
    print(f"replica: {total} cases in {time.monotonic() - started:.1f}s")
    assert not failures, "\n\n".join(failures)
    assert total >= MIN_CASES


def test_router_schema(router):
    doc = httpx.get(router.url + "/openapi.json").json()
    started = time.monotonic()
    total, failures = fuzz(router.url, doc, per_mode=220)
    print(f"router: {total} cases in {time.monotonic() - started:.1f}s")
    assert not failures, "\n\n".join(failures)
    assert total >= MIN_CASES


def test_router_schema_has_no_dangling_refs(router):
    doc = httpx.get(router.url + "/openapi.json").json()
    assert not _dangling_refs(doc)


def test_router_ready_503_matches_its_schema():
    with Proc("router", "--replicas", "http://127.0.0.1:9", "--log-level", "warning",
              ready_path="/health") as rt:
        doc = httpx.get(rt.url + "/openapi.json").json()
        op = schemathesis.openapi.from_dict(doc)["/ready"]["GET"]
        case = op.Case()
        response = case.call(base_url=rt.url)
        assert response.status_code == 503
        case.validate_response(response, checks=[response_schema_conformance])
