"""Tracing off (the default): the request paths import nothing of OpenTelemetry's, and the
decision log carries no trace id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A router and a sim replica in a fresh process without any OTEL_* setting; two requests
# (collected, streamed); then what was imported. FastAPI imports the OpenTelemetry API
# itself (it depends on it), so what is asked is: what did the requests import, and is any
# of the SDK, an exporter or our tracing modules loaded at all.
UNTRACED = """
import json, logging, sys
import httpx
from tests.tracing.servers import cluster

lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(json.loads(record.getMessage()))
log = logging.getLogger("router.decisions")
log.addHandler(Keep())
log.setLevel(logging.INFO)

def loaded():
    return {m for m in sys.modules if m.split(".")[0] == "opentelemetry"}

with cluster(1) as (router, replicas):
    before = loaded()
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                "stream": stream}
        answer = httpx.post(router + "/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
    imported = sorted(loaded() - before)
print(json.dumps({
    "imported_by_requests": imported,
    "sdk_or_exporter": sorted(m for m in loaded()
                              if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))),
    "tracing_modules": sorted(m for m in ("router.tracing", "replicas.tracing")
                              if m in sys.modules),
    "decision_keys": [sorted(line) for line in lines],
}))
"""


def test_untraced_requests_import_no_opentelemetry_and_log_no_trace_id():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FASTAPI_OTEL"))}
    done = subprocess.run([sys.executable, "-c", UNTRACED], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["imported_by_requests"] == []
    assert seen["sdk_or_exporter"] == []
    assert seen["tracing_modules"] == []
    keys = ["candidates", "chosen", "event", "model", "probe_ms", "prompt_tokens", "reason",
            "request_id"]
    assert seen["decision_keys"] == [keys, keys]  # no trace_id


def test_the_tracing_set_up_module_imports_no_opentelemetry():
    code = ("import sys, wire.tracing\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == "[]"
