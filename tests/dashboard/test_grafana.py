"""deploy/grafana and deploy/prometheus: the files parse, and every metric a Grafana panel
queries exists in the live /metrics of a router and a replica after some traffic."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

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


def queries(dashboard: dict) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


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
                  "evicted pages per pool", "running and waiting", "ttft", "decisions"):
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
    wanted = set().union(*(metric_names(q) for q in queries(d)))
    wanted.add("router_replica_healthy")  # the $replica variable's query
    assert wanted - available == set()
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
