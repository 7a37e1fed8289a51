"""deploy/grafana and deploy/prometheus: the files parse, and every metric a Grafana panel
queries exists in the live /metrics of a router and a replica after some traffic (the
Tenants row's in a router run with --api-keys)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest
import yaml

from bench._common import metric_sum
from tests.procs import Proc
from tests.waiting import until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "prefix-router.json"

# PromQL words that look like metric names but are not (functions are followed by "(").
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan", "atan2"}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_CLAUSES = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][A-Za-z0-9_:]*)(?!\s*\(|[\w:])")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label names, functions, durations and
    Grafana variables are not)."""
    expr = _STRINGS.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)      # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)     # ranges and subqueries
    expr = _CLAUSES.sub(" ", expr)              # by (...), on (...), group_left (...)
    expr = re.sub(r"\boffset\s+\S+", " ", expr)
    return {m for m in _IDENT.findall(expr) if m.lower() not in _KEYWORDS}


@pytest.mark.parametrize("expr, names", [
    ('sum by (replica) (rate(router_requests_total{replica=~"$replica"}[$__rate_interval]))',
     {"router_requests_total"}),
    ("histogram_quantile(0.99, sum by (le, replica) (rate(x_seconds_bucket[5m])))",
     {"x_seconds_bucket"}),
    ("sum(rate(a_total[1m])) / ignoring(replica) group_left sum(b) > bool 0",
     {"a_total", "b"}),
    ('a{state="used"} offset 5m - on (replica) c unless d', {"a", "c", "d"}),
    ("scalar(sum(rate(e_total[$__range]))) * 100", {"e_total"}),
    ("max_over_time(up[1h:5m]) or vector(0)", {"up"}),
])
def test_metric_names_from_promql(expr, names):
    assert metric_names(expr) == names


def panels(dashboard: dict):
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])  # collapsed rows keep theirs inside


def queries(some) -> list[str]:
    return [t["expr"] for p in some for t in p.get("targets", [])]


def in_row(dashboard: dict, title: str) -> list[dict]:
    """The panels under the row ``title``: a collapsed row's own, or an open row's, those
    below it on the grid down to the next row."""
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    (row,) = [r for r in rows if r["title"] == title]
    if row["collapsed"]:
        return row["panels"]
    top = row["gridPos"]["y"]
    bottom = min((r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > top), default=math.inf)
    return [p for p in dashboard["panels"]
            if p["type"] != "row" and top < p["gridPos"]["y"] < bottom]


# The Tenants row's series: the router has them only with --api-keys.
TENANT_METRICS = {"router_tenant_requests_total", "router_tenant_rejected_total",
                  "router_tenant_prompt_tokens_total", "router_tenant_cached_tokens_total",
                  "router_tenant_in_flight"}


def test_dashboard_json_is_complete():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "prefix-router" and d["title"]
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    data = [p for p in panels(d) if p["type"] not in ("row", "text")]
    assert len(data) >= 20
    for p in data:
        assert p["title"] and p["targets"], p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["expr"].strip() and t["refId"] for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    cells = set()  # no two panels overlap on the 24-column grid
    for p in panels(d):
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
    titles = " | ".join(p["title"].lower() for p in data)
    for topic in ("health", "share of traffic", "hit rate", "reused vs computed",
                  "attention-only vs final", "kv pages", "kv pages per pool",
                  "evicted pages per pool", "running and waiting", "ttft", "decisions",
                  "tenant"):
        assert topic in titles, topic
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == "prometheus"
    assert metric_names(variables["replica"]["query"]["query"]
                        .removeprefix("label_values(").split(",")[0]) == {
        "router_replica_healthy"}


def exposed(text: str) -> set[str]:
    """Series names a Prometheus scrape of this /metrics text can have: sample names, and
    the names a declared family gets once it has samples (labelled counters start empty)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = {"histogram": ("_bucket", "_count", "_sum"),
                        "summary": ("", "_count", "_sum")}.get(kind, ("",))
            names |= {name + s for s in suffixes}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def test_every_queried_metric_exists_live(live):
    live.traffic(8, start=1000, workers=4)
    router = httpx.get(live.router.url + "/metrics").text
    replica = httpx.get(live.replicas[0].url + "/metrics").text
    available = exposed(router) | exposed(replica)
    d = json.loads(DASHBOARD.read_text())
    tenants = in_row(d, "Tenants")  # test_tenant_panels_query_what_a_router_with_keys_has
    wanted = set().union(*(metric_names(q) for q in queries(p for p in panels(d)
                                                            if p not in tenants)))
    wanted.add("router_replica_healthy")  # the $replica variable's query
    assert wanted - available == set()
    assert available & TENANT_METRICS == set()  # without --api-keys the Tenants row is empty
    assert {n for n in wanted if n.startswith("router_")}  # both sides are on the dashboard
    assert {n for n in wanted if n.startswith("replica_")}
    for histogram in ("router_time_to_first_token_seconds", "replica_time_to_first_token_seconds"):
        assert f"{histogram}_bucket" in wanted
        assert re.search(rf"^{histogram}_count\S* [1-9]", router + replica, re.M), histogram
    # the per-pool panels group by life_cycle: the hybrid replica exposes its three pools
    hybrid = httpx.get(live.hybrid.url + "/metrics").text
    assert {"replica_kv_cache_pool_pages", "replica_kv_cache_pool_evicted_pages_total"} <= wanted
    assert set(re.findall(r'^replica_kv_cache_pool_evicted_pages_total\{[^}]*life_cycle="([^"]+)"',
                          hybrid, re.M)) == {"full_attention", "sliding_window(24)", "recurrent"}


def test_provisioning_and_scrape_config():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert (source["type"], source["uid"], source["url"]) == (
        "prometheus", "prometheus", "http://prometheus:9090")
    dp = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/prefix-router.yml")
                        .read_text())
    (provider,) = dp["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"

    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets = {name: [t for sc in j["static_configs"] for t in sc["targets"]]
               for name, j in jobs.items()}
    assert targets == {"router": ["router:8000"],
                       "replicas": ["replica-1:9001", "replica-2:9001", "replica-3:9001"]}
    (relabel,) = jobs["replicas"]["relabel_configs"]
    assert relabel["target_label"] == "replica" and relabel["replacement"] == "http://${1}"


KEYS = """\
tenants:
  acme:
    keys: [acme-key]
    limits: {requests_per_minute: 2}
  beta:
    keys: [beta-key]
default: reject
"""
PROMPT = "Tenant acme's system prompt, the same each time, long enough for blocks. " * 3


def complete(router: Proc, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(router.url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": "sim-byte-lm", "prompt": PROMPT, "max_tokens": 2})


def idle_metrics(router: Proc) -> str | None:
    """The router's /metrics once no tenant has a request in flight, else None."""
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return text if metric_sum(text, "router_tenant_in_flight") == 0 else None


def test_tenant_panels_query_what_a_router_with_keys_has(tmp_path):
    d = json.loads(DASHBOARD.read_text())
    tenants = in_row(d, "Tenants")
    assert [p["type"] for p in tenants] == ["timeseries"] * 5 + ["text"]
    assert set().union(*(metric_names(q) for q in queries(tenants))) == TENANT_METRICS
    keys = tmp_path / "api-keys.yaml"
    keys.write_text(KEYS)
    with (Proc("replicas", "--engine", "sim", "--log-level", "warning",
               "--tokens-per-block", "16") as replica,
          Proc("router", "--replicas", replica.url, "--log-level", "warning",
               "--tokens-per-block", "16", "--api-keys", str(keys)) as router):
        answers = [complete(router, key) for key in ("acme-key", "acme-key", "beta-key")]
        assert [r.status_code for r in answers] == [200, 200, 200]
        assert complete(router, "acme-key").status_code == 429  # acme's 3rd in the minute
        assert complete(router, None).status_code == 401
        text = until(lambda: idle_metrics(router), "every answer's slot given back")
    usage = [r.json()["usage"] for r in answers]
    hits = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    assert hits[0] == 0 and hits[1] > 0  # acme's repeat hit its own cache
    assert metric_sum(text, "router_tenant_requests_total", tenant="acme") == 2
    assert metric_sum(text, "router_tenant_requests_total", tenant="beta") == 1
    assert metric_sum(text, "router_tenant_rejected_total", tenant="acme",
                      reason="rate_limit_requests") == 1
    assert metric_sum(text, "router_tenant_rejected_total", tenant="",
                      reason="unauthenticated") == 1
    assert metric_sum(text, "router_tenant_rejected_total") == 2
    assert metric_sum(text, "router_tenant_prompt_tokens_total", tenant="acme") == (
        usage[0]["prompt_tokens"] + usage[1]["prompt_tokens"])
    assert metric_sum(text, "router_tenant_cached_tokens_total", tenant="acme") == hits[1]
    assert TENANT_METRICS - exposed(text) == set()
