"""Reports of a load run: a documented JSON document and a readable table.

Definitions follow BENCHMARKS.md ("Definitions used by every benchmark"). Latencies are in
milliseconds; percentiles interpolate linearly between the closest ranks (numpy's default),
so ``p50`` of ``[1, 2, 3, 4]`` is 2.5. A request is *completed* when its answer was HTTP 200
and its stream ended with ``data: [DONE]`` and no error event; latency and token figures
count completed requests only.

The JSON document (``build_report``)::

    schema          "loadtest.run/1"
    started_at      ISO 8601 UTC time the run started
    url, model      base URL driven and model name sent
    workload        the workload's name and parameters (as given to ``build_report``), or null
    driver          the driver's settings: rate (requests/s, null: unpaced), burstiness,
                    constant_rate, time_scale, concurrency (null: no cap), max_seconds,
                    request_timeout_s, seed, ignore_eos (the API key is never written)
    summary
      requests      requests in the workload
      sent          requests sent (including failed and cancelled ones)
      completed     requests completed (see above)
      failed        sent - completed (HTTP errors, error events, broken streams, timeouts,
                    requests cancelled at max_seconds)
      not_sent      requests - sent (max_seconds ended the run first)
      stopped_early true when max_seconds ended the run
      duration_s    from the first request's due time to the last answer
      request_throughput       completed / duration_s (requests/s)
      prompt_tokens            sum of usage.prompt_tokens
      cached_tokens            sum of usage.prompt_tokens_details.cached_tokens
      prefill_tokens           prompt_tokens - cached_tokens (prompt tokens computed)
      completion_tokens        sum of usage.completion_tokens
      input_token_throughput   prompt_tokens / duration_s (tokens/s)
      output_token_throughput  completion_tokens / duration_s
      total_token_throughput   (prompt_tokens + completion_tokens) / duration_s
      token_hit_rate           cached_tokens / prompt_tokens (null without usage)
      ttft_ms       time to first token: request sent -> first chunk carrying text
      tpot_ms       time per output token after the first, per request:
                    (e2e - ttft) / (completion_tokens - 1), requests with >= 2 tokens
      itl_ms        inter-token latency: gaps between successive text chunks, all requests
      e2e_ms        request sent -> end of stream
                    (each of the four: {"n", "mean", "p50", "p90", "p99"}; null values
                    when n is 0)
      load_imbalance  max / mean over replicas of prefill_tokens (null when no replica is
                    known or none computed anything)
      errors        {error message: count} over failed requests
    replicas        {replica URL (x-replica header): {
                      requests   completed requests it answered
                      failed     failed requests that named it
                      share      requests / completed (of all completed requests)
                      prompt_tokens, cached_tokens, prefill_tokens, hit_rate}}
                    Replicas come from the x-replica header and, for our router, from its
                    /stats (so idle replicas count, with zeros). Requests without the header
                    (a single replica, another router) are under "unattributed", which is
                    left out of load_imbalance.
    records         one per sent request, in sending order: request_id, session, group,
                    scheduled_s (due time from the start, null when unpaced), start_s (sent,
                    from the start), ok, status (HTTP, null when no answer), error, ttft_s,
                    itl_s (list), e2e_s, prompt_tokens, cached_tokens, completion_tokens
                    (from usage; null when the server sent none), replica (x-replica or null)
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .driver import RequestRecord, RunResult

SCHEMA = "loadtest.run/1"
UNATTRIBUTED = "unattributed"
_DRIVER_FIELDS = ("rate", "burstiness", "constant_rate", "time_scale", "concurrency",
                  "max_seconds", "request_timeout_s", "seed", "ignore_eos")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def distribution_ms(seconds: Sequence[float]) -> dict:
    """``{"n", "mean", "p50", "p90", "p99"}`` in milliseconds of values in seconds."""
    if not seconds:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    ms = [s * 1000.0 for s in seconds]
    return {"n": len(ms), "mean": sum(ms) / len(ms), "p50": percentile(ms, 50),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def build_report(result: RunResult, workload: dict | None = None,
                 include_records: bool = True) -> dict:
    """The JSON document described in the module docstring."""
    cfg = result.config
    doc = {
        "schema": SCHEMA,
        "started_at": result.started_at,
        "url": result.url,
        "model": result.model,
        "workload": workload,
        "driver": {name: getattr(cfg, name) for name in _DRIVER_FIELDS},
        "summary": summarize(result.records, result.duration_s, result.requests_total,
                             result.replicas),
        "replicas": per_replica(result.records, result.replicas),
    }
    doc["summary"]["stopped_early"] = result.stopped_early
    if include_records:
        doc["records"] = [r.to_dict() for r in result.records]
    return doc


def summarize(records: Sequence[RequestRecord], duration_s: float, requests_total: int,
              replicas: Sequence[str] | None = None) -> dict:
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    completion = sum(r.completion_tokens or 0 for r in done)
    with_usage = any(r.prompt_tokens is not None for r in done)
    per = lambda x: x / duration_s if duration_s > 0 else None  # noqa: E731
    return {
        "requests": requests_total,
        "sent": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "not_sent": requests_total - len(records),
        "duration_s": duration_s,
        "request_throughput": per(len(done)),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "completion_tokens": completion,
        "input_token_throughput": per(prompt),
        "output_token_throughput": per(completion),
        "total_token_throughput": per(prompt + completion),
        "token_hit_rate": cached / prompt if with_usage and prompt else None,
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms(_tpots(done)),
        "itl_ms": distribution_ms([x for r in done for x in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "load_imbalance": load_imbalance(per_replica(records, replicas)),
        "errors": dict(Counter(r.error or "unknown" for r in records if not r.ok)),
    }


def per_replica(records: Sequence[RequestRecord],
                replicas: Sequence[str] | None = None) -> dict[str, dict]:
    rows = {url: _row() for url in replicas or ()}
    done = sum(1 for r in records if r.ok)
    for r in records:
        row = rows.setdefault(r.replica or UNATTRIBUTED, _row())
        if not r.ok:
            row["failed"] += 1
            continue
        row["requests"] += 1
        row["prompt_tokens"] += r.prompt_tokens or 0
        row["cached_tokens"] += r.cached_tokens or 0
    for row in rows.values():
        row["prefill_tokens"] = row["prompt_tokens"] - row["cached_tokens"]
        row["share"] = row["requests"] / done if done else 0.0
        row["hit_rate"] = (row["cached_tokens"] / row["prompt_tokens"]
                           if row["prompt_tokens"] else None)
    return dict(sorted(rows.items()))


def load_imbalance(rows: dict[str, dict]) -> float | None:
    """max / mean over replicas (``unattributed`` left out) of prefill tokens computed."""
    prefill = [row["prefill_tokens"] for url, row in rows.items() if url != UNATTRIBUTED]
    if not prefill or sum(prefill) == 0:
        return None
    return max(prefill) / (sum(prefill) / len(prefill))


def write_report(path: str | Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def format_table(doc: dict) -> str:
    """A human-readable summary of a report document."""
    s = doc["summary"]
    wl = doc.get("workload") or {}
    lines = [
        f"{doc['url']}  model {doc['model']}  workload {wl.get('name', '-')}",
        f"requests {s['requests']}  completed {s['completed']}  failed {s['failed']}  "
        f"not sent {s['not_sent']}  in {s['duration_s']:.2f} s"
        + ("  (stopped at max_seconds)" if s.get("stopped_early") else ""),
        f"throughput  {_num(s['request_throughput'], '.2f')} req/s   "
        f"in {_num(s['input_token_throughput'], '.0f')} tok/s   "
        f"out {_num(s['output_token_throughput'], '.0f')} tok/s",
        f"tokens      prompt {s['prompt_tokens']}  cached {s['cached_tokens']}  "
        f"prefill {s['prefill_tokens']}  completion {s['completion_tokens']}",
        f"hit rate    {_num(s['token_hit_rate'], '.3f')}   "
        f"load imbalance {_num(s['load_imbalance'], '.2f')}",
        "",
        f"{'latency (ms)':<14}{'n':>7}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        lines.append(f"{key[:-3].upper():<14}{d['n']:>7}" + "".join(
            f"{_num(d[k], '.2f'):>10}" for k in ("mean", "p50", "p90", "p99")))
    lines += ["", f"{'replica':<32}{'requests':>9}{'share':>8}{'failed':>8}"
                  f"{'prefill tok':>13}{'hit rate':>10}"]
    for url, row in doc["replicas"].items():
        lines.append(f"{url:<32}{row['requests']:>9}{row['share']:>8.3f}{row['failed']:>8}"
                     f"{row['prefill_tokens']:>13}{_num(row['hit_rate'], '.3f'):>10}")
    for message, count in s["errors"].items():
        lines.append(f"error x{count}: {message}")
    return "\n".join(lines)


def _tpots(done: Sequence[RequestRecord]) -> list[float]:
    return [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in done
            if r.completion_tokens and r.completion_tokens > 1 and r.ttft_s is not None
            and r.e2e_s is not None]


def _row() -> dict:
    return {"requests": 0, "failed": 0, "share": 0.0, "prompt_tokens": 0, "cached_tokens": 0,
            "prefill_tokens": 0, "hit_rate": None}


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
