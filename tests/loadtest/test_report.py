import json

import pytest

from loadtest.driver import DriverConfig, RequestRecord, RunResult
from loadtest.report import (build_report, distribution_ms, format_table, load_imbalance,
                             per_replica, percentile, write_report)

A, B, C = "http://a:1", "http://b:2", "http://c:3"


def rec(rid, replica, ok=True, prompt=None, cached=None, completion=None, ttft=None,
        e2e=None, itl=(), error=None, status=200):
    return RequestRecord(rid, None, None, 0.0, 0.0, ok=ok, status=status, error=error,
                         ttft_s=ttft, itl_s=list(itl), e2e_s=e2e, prompt_tokens=prompt,
                         cached_tokens=cached, completion_tokens=completion, replica=replica)


RECORDS = [
    rec("r1", A, prompt=100, cached=50, completion=5, ttft=0.1, e2e=0.5,
        itl=[0.1, 0.1, 0.1, 0.1]),
    rec("r2", B, prompt=200, cached=0, completion=3, ttft=0.2, e2e=0.6, itl=[0.3, 0.1]),
    rec("r3", A, prompt=100, cached=90, completion=1, ttft=0.3, e2e=0.3),
    rec("r4", B, ok=False, status=500, error="HTTP 500: boom", e2e=0.05),
]


def result(records=RECORDS, replicas=(A, B, C)):
    return RunResult(url="http://router:8000", model="m", config=DriverConfig(
        url="http://router:8000", concurrency=2, seed=3, api_key="secret"),
        records=list(records), requests_total=5, duration_s=2.0,
        started_at="2025-01-01T00:00:00+00:00", replicas=list(replicas))


@pytest.mark.parametrize("values,q,expected", [
    ([1, 2, 3, 4], 50, 2.5), ([1, 2, 3, 4], 90, 3.7), ([1, 2, 3, 4], 99, 3.97),
    ([4, 1, 3, 2], 0, 1), ([4, 1, 3, 2], 100, 4), ([7], 99, 7),
])
def test_percentile_interpolates_like_numpy(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected, abs=1e-12)


def test_distribution_in_milliseconds():
    assert distribution_ms([0.001, 0.002, 0.003, 0.004]) == pytest.approx(
        {"n": 4, "mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert distribution_ms([]) == {"n": 0, "mean": None, "p50": None, "p90": None,
                                   "p99": None}


def test_summary_numbers():
    doc = build_report(result(), workload={"name": "hand-made"})
    s = doc["summary"]
    assert {k: s[k] for k in ("requests", "sent", "completed", "failed", "not_sent",
                              "prompt_tokens", "cached_tokens", "prefill_tokens",
                              "completion_tokens", "stopped_early")} == {
        "requests": 5, "sent": 4, "completed": 3, "failed": 1, "not_sent": 1,
        "prompt_tokens": 400, "cached_tokens": 140, "prefill_tokens": 260,
        "completion_tokens": 9, "stopped_early": False}
    assert s["token_hit_rate"] == pytest.approx(140 / 400)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["input_token_throughput"] == pytest.approx(200.0)
    assert s["output_token_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(204.5)
    assert s["ttft_ms"] == pytest.approx({"n": 3, "mean": 200.0, "p50": 200.0, "p90": 280.0,
                                          "p99": 298.0})
    # TPOT: r1 (0.5 - 0.1) / 4 = 100 ms, r2 (0.6 - 0.2) / 2 = 200 ms, r3 has one token
    assert s["tpot_ms"] == pytest.approx({"n": 2, "mean": 150.0, "p50": 150.0, "p90": 190.0,
                                          "p99": 199.0})
    assert s["itl_ms"] == pytest.approx({"n": 6, "mean": 800 / 6, "p50": 100.0,
                                         "p90": 200.0, "p99": 290.0})
    assert s["e2e_ms"] == pytest.approx({"n": 3, "mean": 1400 / 3, "p50": 500.0,
                                         "p90": 580.0, "p99": 598.0})
    # prefill computed: A 50 + 10 = 60, B 200, C 0 -> max / mean = 200 / (260 / 3)
    assert s["load_imbalance"] == pytest.approx(600 / 260)
    assert s["errors"] == {"HTTP 500: boom": 1}


def test_per_replica_rows_and_header_less_answers():
    rows = per_replica(RECORDS + [rec("r5", None, prompt=10, cached=0, completion=2)], (A, C))
    assert list(rows) == [A, B, C, "unattributed"]
    assert rows[A] == pytest.approx({"requests": 2, "failed": 0, "share": 0.5,
                                     "prompt_tokens": 200, "cached_tokens": 140,
                                     "prefill_tokens": 60, "hit_rate": 0.7})
    assert rows[B] == {"requests": 1, "failed": 1, "share": 0.25, "prompt_tokens": 200,
                       "cached_tokens": 0, "prefill_tokens": 200, "hit_rate": 0.0}
    assert rows[C] == {"requests": 0, "failed": 0, "share": 0.0, "prompt_tokens": 0,
                       "cached_tokens": 0, "prefill_tokens": 0, "hit_rate": None}
    assert rows["unattributed"]["prefill_tokens"] == 10
    assert load_imbalance(rows) == pytest.approx(600 / 260)  # unattributed left out
    assert load_imbalance({"unattributed": rows["unattributed"]}) is None


def test_json_document_and_table(tmp_path):
    doc = build_report(result(), workload={"name": "hand-made"})
    assert doc["schema"] == "loadtest.run/1"
    assert doc["driver"] == {"rate": None, "burstiness": 1.0, "constant_rate": False,
                             "time_scale": 1.0, "concurrency": 2, "max_seconds": None,
                             "request_timeout_s": 300.0, "seed": 3, "ignore_eos": True}
    assert [r["request_id"] for r in doc["records"]] == ["r1", "r2", "r3", "r4"]
    assert doc["records"][0]["itl_s"] == [0.1, 0.1, 0.1, 0.1]
    path = tmp_path / "out.json"
    write_report(path, doc)
    text = path.read_text()
    assert "secret" not in text  # the API key is never written
    assert json.loads(text) == doc
    table = format_table(doc)
    assert "requests 5  completed 3  failed 1  not sent 1" in table
    assert "hit rate    0.350   load imbalance 2.31" in table
    assert "error x1: HTTP 500: boom" in table
    assert "records" not in build_report(result(), include_records=False)


def test_report_without_completed_requests():
    doc = build_report(result(records=[RECORDS[3]], replicas=()))
    s = doc["summary"]
    assert s["completed"] == 0 and s["token_hit_rate"] is None and s["load_imbalance"] is None
    assert s["ttft_ms"]["n"] == 0
    assert "TTFT                0         -" in format_table(doc)
