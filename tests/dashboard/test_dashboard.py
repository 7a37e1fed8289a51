"""GET /dashboard in a real headless Chromium, against live replicas and a router.

The page must show what /stats reports (integer counts exactly, rates within the rounding
of their display; each replica's KV pools in a table of its own), change as traffic arrives
without a reload, list the latest decisions with every candidate and the reason, and show
replica names as text, never as markup.
A missing browser is a failure, not a skip: .ci/run installs Debian's chromium.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import sync_playwright

from tests.procs import Proc

from .conftest import FAMILIES, HYBRID_MODEL

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "artifacts" / "dashboard.png"
STATIC = ROOT / "router" / "static"
SHOWN_DECISIONS = 10  # DECISIONS_SHOWN in router/static/decisions.js
POOL_COLUMNS = ("layers", "cached_pages", "used_pages", "free_pages", "block_pages",
                "evicted_pages")

# Everything the page shows, read in one go: {value: data-value, text: textContent}.
SNAPSHOT_JS = """() => {
  const fields = (root) => {
    const out = {};
    for (const n of root.querySelectorAll('[data-field]')) {
      out[n.dataset.field] = {value: n.dataset.value ?? null, text: n.textContent};
    }
    return out;
  };
  return {
    polls: Number(document.body.dataset.polls),
    status: document.getElementById('status').textContent,
    marker: window.__sameDocument ?? null,
    xss: window.__xss ?? null,
    injected: document.querySelectorAll('[onload], [onerror], script:not([src])').length,
    totals: fields(document.getElementById('totals')),
    policy: document.getElementById('policy').textContent,
    chartSeries: Number(document.getElementById('hit-chart').dataset.series || 0),
    cards: [...document.querySelectorAll('#replicas > .card')].map((c) => ({
      replica: c.dataset.replica,
      title: c.querySelector('.url').getAttribute('title'),
      sparkPoints: Number(c.querySelector('svg.spark').dataset.points || 0),
      poolsShown: !c.querySelector('.poolbox').hidden,
      pools: [...c.querySelectorAll('table.pools tbody tr')].map((r) => ({
        title: r.title, fields: fields(r)})),
      fields: fields(c)})),
    legend: [...document.querySelectorAll('#share-legend [data-replica]')].map((l) => ({
      replica: l.dataset.replica, fields: fields(l)})),
    decisions: [...document.querySelectorAll('#decisions .decision')].map((d) => ({
      request_id: d.dataset.requestId,
      head: fields(d.querySelector('.dhead')),
      candidates: [...d.querySelectorAll('tbody tr')].map((r) => ({
        replica: r.dataset.replica, chosen: r.classList.contains('chosen'),
        fields: fields(r)}))})),
  };
}"""


@pytest.fixture(scope="module")
def browser(live, tmp_path_factory):
    assert os.access(CHROMIUM, os.X_OK), (
        f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium); "
        ".ci/run does this")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM,
            headless=True, args=ARGS, viewport={"width": 1400, "height": 1000})
        outside: list[str] = []

        def only_the_router(route):  # the page must work offline: nothing but the router
            if route.request.url.startswith(live.router.url + "/"):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        context.route("**/*", only_the_router)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        try:
            yield page, errors, outside
        finally:
            context.close()


def snapshot(page) -> dict:
    return page.evaluate(SNAPSHOT_JS)


def wait_for(page, predicate, what: str, timeout: float = 15.0) -> dict:
    """Poll the page until ``predicate(snapshot)`` holds; returns that snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        snap = snapshot(page)
        if predicate(snap):
            return snap
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; page shows {snap['totals']}")
        time.sleep(0.1)


# -- reading displayed figures -------------------------------------------------------------

def as_int(field: dict) -> int:
    """An integer count: data-value and the text agree exactly."""
    value = int(field["value"])
    assert int(field["text"].replace(",", "").split()[0]) == value, field
    return value


def as_int_or_none(field: dict) -> int | None:
    """A count, or "–" for one the replica does not know (no data-value)."""
    if field["value"] == "":
        assert field["text"] == "\u2013", field
        return None
    return as_int(field)


def as_rate(field: dict, expected: float) -> None:
    """A rate: data-value exact, the text ("91.4%") within the rounding of one decimal."""
    assert float(field["value"]) == pytest.approx(expected, abs=1e-12), field
    shown = float(field["text"].rstrip("%")) / 100
    assert abs(shown - expected) <= 0.0005 + 1e-9, (field, expected)


def as_seconds(field: dict, expected: float | None) -> None:
    if expected is None:
        assert field["value"] == "" and field["text"] == "–", field
        return
    assert float(field["value"]) == pytest.approx(expected, abs=1e-12), field
    number, unit = field["text"].split()
    decimals = len(number.split(".")[1]) if "." in number else 0
    scale = {"ms": 1e-3, "s": 1.0}[unit]
    assert abs(float(number) * scale - expected) <= 0.5 * 10 ** -decimals * scale + 1e-12, (
        field, expected)


def short(url: str) -> str:
    return re.sub(r"^https?://", "", url)


def pools_shown(card: dict) -> list[dict] | None:
    """A card's per-pool table as /stats' kv_pools entries (None: the table is hidden)."""
    if not card["poolsShown"]:
        assert card["pools"] == [], card["replica"]
        return None
    rows = []
    for row in card["pools"]:
        f = row["fields"]
        assert f["life_cycle"]["text"] == f["life_cycle"]["value"]
        words = row["title"].replace(",", "").split()  # "N pages[ B bytes each][ (...)]"
        num_pages = int(words[0])
        page_bytes = int(words[2]) if words[2:4] and words[3] == "bytes" else None
        rows.append({"life_cycle": f["life_cycle"]["text"], "num_pages": num_pages,
                     "page_bytes": page_bytes,
                     **{name: as_int_or_none(f[name]) for name in POOL_COLUMNS}})
    return rows


def shows(snap: dict, stats: dict) -> bool:
    """The page shows this /stats' request count and every replica's KV pools."""
    return (snap["totals"]["requests"]["value"] == str(stats["totals"]["requests"])
            and [c["replica"] for c in snap["cards"]] == [r["url"] for r in stats["replicas"]]
            and all(pools_shown(c) == r["kv_pools"]
                    for c, r in zip(snap["cards"], stats["replicas"])))


# -- what the page must agree with ---------------------------------------------------------

def assert_agrees(snap: dict, stats: dict) -> None:
    t, shown = stats["totals"], snap["totals"]
    assert snap["policy"] == stats["policy"]
    for name in ("requests", "prompt_tokens", "cached_tokens"):
        assert as_int(shown[name]) == t[name], name
    assert as_int(shown["computed_tokens"]) == t["prompt_tokens"] - t["cached_tokens"]
    as_rate(shown["hit_rate"], t["hit_rate"])
    healthy = sum(r["health"] == "healthy" for r in stats["replicas"])
    assert as_int(shown["healthy"]) == healthy
    assert as_int(shown["replicas"]) == len(stats["replicas"])
    assert as_int(shown["in_flight"]) == sum(r["in_flight"] for r in stats["replicas"])

    assert [c["replica"] for c in snap["cards"]] == [r["url"] for r in stats["replicas"]]
    pages = {"used": 0, "cached": 0, "free": 0}
    for card, r in zip(snap["cards"], stats["replicas"]):
        assert_card(card, r, t["requests"])
        if r["load"]:
            load = r["load"]
            pages["used"] += load["total_pages"] - load["free_pages"] - load["cached_pages"]
            pages["cached"] += load["cached_pages"]
            pages["free"] += load["free_pages"]
    for state, n in pages.items():
        assert as_int(shown[f"pages_{state}"]) == n, state

    assert [entry["replica"] for entry in snap["legend"]] == [r["url"] for r in stats["replicas"]]
    for entry, r in zip(snap["legend"], stats["replicas"]):
        assert as_int(entry["fields"]["requests"]) == r["requests"]
        as_rate(entry["fields"]["share"], r["requests"] / t["requests"] if t["requests"] else 0)

    assert_decisions(snap["decisions"], stats["decisions"])


def assert_card(card: dict, r: dict, total_requests: int) -> None:
    f = card["fields"]
    assert card["title"] == r["url"]  # the full URL, as text
    assert f["url"]["text"] == short(r["url"])
    assert f["health"]["text"] == r["health"]
    assert f["circuit"]["value"] == r["circuit"]
    for name in ("requests", "failures", "prompt_tokens", "cached_tokens", "in_flight",
                 "probed_tokens", "probed_tokens_before_hybrid_pruning"):
        assert as_int(f[name]) == r[name], (r["url"], name)
    assert as_int(f["computed_tokens"]) == r["prompt_tokens"] - r["cached_tokens"]
    assert as_int(f["pruned_tokens"]) == (r["probed_tokens_before_hybrid_pruning"]
                                         - r["probed_tokens"])
    as_rate(f["hit_rate"], r["hit_rate"])
    as_rate(f["share"], r["requests"] / total_requests if total_requests else 0.0)
    as_seconds(f["ttft_p50_s"], r["ttft_p50_s"])
    as_seconds(f["ttft_p99_s"], r["ttft_p99_s"])
    assert pools_shown(card) == r["kv_pools"], r["url"]  # every pool, every figure, in order
    load = r["load"]
    if load is None:
        for name in ("pages_used", "pages_cached", "pages_free", "running", "waiting"):
            assert f[name]["value"] == "" and f[name]["text"] == "–", name
        return
    assert as_int(f["pages_used"]) == (load["total_pages"] - load["free_pages"]
                                       - load["cached_pages"])
    assert as_int(f["pages_cached"]) == load["cached_pages"]
    assert as_int(f["pages_free"]) == load["free_pages"]
    assert as_int(f["total_pages"]) == load["total_pages"]
    for name in ("running", "waiting", "queued_prefill_tokens"):
        assert as_int(f[name]) == load[name], name


def assert_decisions(shown: list[dict], decisions: list[dict]) -> None:
    assert len(shown) == min(SHOWN_DECISIONS, len(decisions))
    for d, want in zip(shown, decisions):
        assert d["request_id"] == want["request_id"]
        assert d["head"]["chosen"]["value"] == want["chosen"]
        assert d["head"]["reason"]["text"] == want["reason"]
        assert as_int(d["head"]["prompt_tokens"]) == want["prompt_tokens"]
        assert [c["replica"] for c in d["candidates"]] == [c["replica"] for c in
                                                             want["candidates"]]
        assert [c["replica"] for c in d["candidates"] if c["chosen"]] == [want["chosen"]]
        for row, c in zip(d["candidates"], want["candidates"]):
            for name in ("reuse", "reuse_before_hybrid_pruning", "pending_reuse",
                         "queued_prefill_tokens", "running", "waiting", "in_flight"):
                if c[name] is None:
                    assert row["fields"][name]["value"] == "", name
                else:
                    assert as_int(row["fields"][name]) == c[name], name


# -- the tests -----------------------------------------------------------------------------

def test_dashboard_follows_live_traffic(live, browser):
    page, errors, outside = browser
    try:
        page.goto(live.router.url + "/dashboard?interval=250")
        page.evaluate("() => { window.__sameDocument = 42; }")
        before = live.settled()
        snap = wait_for(page, lambda s: s["polls"] >= 2 and shows(s, before), "the first polls")
        assert snap["status"] == "live"
        assert_agrees(snap, live.stats())

        # Wave 1: shared prefixes, so repeats hit; the page follows without a reload. Two
        # requests to the hybrid replica fill its three pools.
        sent = live.traffic(24)
        for i in range(2):
            r = httpx.post(live.router.url + "/v1/completions", timeout=60, json={
                "model": HYBRID_MODEL, "max_tokens": 4,
                "prompt": "A hybrid model keeps three pools of KV pages. " * 3 + f"Q{i}?"})
            assert r.status_code == 200 and r.headers["x-replica"] == live.hybrid.url, r.text
        stats = live.settled()
        assert stats["totals"]["requests"] == before["totals"]["requests"] + 26
        assert stats["totals"]["hit_rate"] > 0
        snap = wait_for(page, lambda s: shows(s, stats), "wave 1 on the page")
        assert_agrees(snap, live.stats())
        assert as_int(snap["totals"]["requests"]) == before["totals"]["requests"] + 26
        hybrid = next(c for c in snap["cards"] if c["replica"] == live.hybrid.url)
        pools = pools_shown(hybrid)
        assert [p["life_cycle"] for p in pools] == [
            "full_attention", "sliding_window(24)", "recurrent"]
        assert pools[0]["cached_pages"] > 0 and all(p["num_pages"] == 48 for p in pools)
        assert [p["layers"] for p in pools] == [1, 1, 1]  # tiny-hybrid: one layer a kind
        assert pools[2]["block_pages"] > 0  # snapshots kept
        for card in snap["cards"]:
            if card["replica"] in {r.url for r in live.replicas}:
                assert [p["life_cycle"] for p in pools_shown(card)] == ["full_attention"]
        first_decision = snap["decisions"][0]["request_id"]
        assert snap["decisions"][0]["head"]["reason"]["text"]  # a reason is shown

        # Wave 2 in bursts, each after the page polled again, so the hit-rate history has
        # points over time.
        for burst in range(4):
            polls = snapshot(page)["polls"]
            wait_for(page, lambda s: s["polls"] > polls, f"a poll before burst {burst}")
            sent += live.traffic(6, start=24 + 6 * burst)
        stats = live.settled()
        snap = wait_for(page, lambda s: shows(s, stats), "wave 2 on the page")
        stats = live.stats()
        assert_agrees(snap, stats)
        assert snap["decisions"][0]["request_id"] != first_decision
        assert snap["marker"] == 42, "the page reloaded instead of updating in place"
        assert float(snap["totals"]["hit_rate"]["value"]) > 0
        assert snap["totals"]["hit_rate_recent"]["value"] not in ("", None)
        assert snap["chartSeries"] >= 2  # at least one replica and the cluster line
        for card in snap["cards"]:
            if card["replica"] in set(sent):
                assert card["sparkPoints"] >= 2, card["replica"]

        assert errors == []
        assert outside == []
    finally:  # kept also when an assertion failed, to see what the page showed
        page.screenshot(path=str(SCREENSHOT), full_page=True)


def test_replica_names_are_text_and_unreachable_replicas_show(live, browser):
    page, errors, _ = browser
    page.goto(live.router.url + "/dashboard?interval=250")
    snap = wait_for(page, lambda s: s["polls"] >= 2, "the first polls")
    card = next(c for c in snap["cards"] if c["replica"] == live.bogus)
    assert card["title"] == live.bogus
    assert card["fields"]["url"]["text"] == short(live.bogus)  # "<svg/onload=...>" as text
    assert card["fields"]["health"]["text"] == "unhealthy"
    assert "Connection refused" in card["fields"]["problem"]["text"]
    assert card["fields"]["pages_used"]["text"] == "–"  # no load known: not zero
    assert pools_shown(card) is None  # no pools known: no table
    assert snap["xss"] is None and snap["injected"] == 0
    assert as_int(snap["totals"]["healthy"]) == 4 and as_int(snap["totals"]["replicas"]) == 5
    assert errors == []


def test_dashboard_is_self_contained_and_locked_down(live):
    r = httpx.get(live.router.url + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", r.text)  # nothing from a CDN
    for path in sorted(STATIC.iterdir()):
        asset = httpx.get(f"{live.router.url}/dashboard/static/{path.name}")
        assert asset.status_code == 200 and asset.headers["x-content-type-options"] == "nosniff"
        if path.suffix == ".js":  # module scripts need a JavaScript type
            assert asset.headers["content-type"].startswith("text/javascript"), path.name
            # text from the router goes in as text: no HTML parsing, no eval
            assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|"
                                 r"\beval\(|new Function", asset.text), path.name


def raw_get(url: str, target: str) -> tuple[int, bytes]:
    """GET ``target`` sent as given (a client library would normalise ``..`` away):
    the status and the body."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                     .encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("target", [
    "/dashboard/../../etc/passwd",
    "/dashboard/static/../../../../etc/passwd",
    "/dashboard/static/../app.py",
    "/dashboard/static/%2e%2e/app.py",
    "/dashboard/static/..%2fapp.py",
])
def test_no_path_leaves_the_static_folder(live, target):
    status, body = raw_get(live.router.url, target)
    assert status == 404, body[:200]
    assert b"root:" not in body and b"import" not in body  # neither file's content


def test_missing_files_do_not_stop_the_router(tmp_path, monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from router import dashboard

    monkeypatch.setattr(dashboard, "STATIC", tmp_path / "absent")
    app = FastAPI()
    dashboard.install_dashboard(app)
    client = TestClient(app)
    r = client.get("/dashboard")
    assert r.status_code == 503 and "router/static" in r.text
    assert client.get("/dashboard/static/dashboard.js").status_code == 404


# -- tenants (--api-keys) ------------------------------------------------------------------

SHOWN_TENANTS = 10  # TENANTS_SHOWN in router/static/tenants.js

TENANTS_JS = """() => {
  const fields = (root) => {
    const out = {};
    for (const n of root.querySelectorAll('[data-field]')) {
      out[n.dataset.field] = {value: n.dataset.value ?? null, text: n.textContent};
    }
    return out;
  };
  const panel = document.getElementById('tenants-panel');
  return {
    polls: Number(document.body.dataset.polls),
    shown: !panel.hidden,
    summary: fields(document.getElementById('tenants-summary')),
    rows: [...panel.querySelectorAll('tbody tr[data-tenant]')].map((r) => ({
      tenant: r.dataset.tenant, title: r.querySelector('[data-field=rejected]')
        .parentElement.getAttribute('title'), fields: fields(r)})),
  };
}"""


def test_without_api_keys_the_tenants_panel_is_hidden(live, browser):
    page, errors, _ = browser
    page.goto(live.router.url + "/dashboard?interval=250")
    wait_for(page, lambda s: s["polls"] >= 2, "the first polls")
    snap = page.evaluate(TENANTS_JS)
    assert live.stats()["tenants"] is None
    assert snap["shown"] is False and snap["rows"] == []
    assert errors == []


def test_the_top_tenants_render_with_api_keys(live, browser, tmp_path):
    """Eleven tenants, ten with traffic: the table shows those ten, most requests first,
    with /stats' figures exactly; the one without requests is left out."""
    page, errors, _ = browser
    names = [f"t{i:02d}" for i in range(11)]
    path = tmp_path / "api-keys.yaml"
    path.write_text("tenants:\n" + "".join(
        f"  {n}: {{keys: [key-{n}]" + (", limits: {requests_per_minute: 2}" if n == "t02"
                                       else "") + "}\n" for n in names) + "default: reject\n")
    router = Proc("router", "--replicas", live.replicas[0].url, "--tokens-per-block", "16",
                  "--api-keys", str(path), "--log-level", "warning")
    try:
        def send(key: str, prompt: str) -> int:
            return httpx.post(router.url + "/v1/completions", timeout=30,
                              headers={"authorization": f"Bearer {key}"},
                              json={"prompt": prompt, "max_tokens": 2}).status_code

        assert [send("key-t01", FAMILIES[0]) for _ in range(3)] == [200, 200, 200]
        assert [send("key-t02", FAMILIES[1] + str(i)) for i in range(3)] == [200, 200, 429]
        for n in names[3:]:
            assert send(f"key-{n}", FAMILIES[2] + n) == 200
        assert send("not-a-key", "hello") == 401
        stats = httpx.get(router.url + "/stats", timeout=10).json()["tenants"]
        top = stats["tenants"][:SHOWN_TENANTS]
        assert [t["name"] for t in top] == ["t01", "t02", *names[3:]]
        assert top[0]["cached_tokens"] > 0 and top[1]["rejected"] == 1

        own = page.context.new_page()  # this router's page (the context admits only live's)
        own.route("**/*", lambda route: route.continue_()
                  if route.request.url.startswith(router.url + "/") else route.abort())
        own.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
        own.goto(router.url + "/dashboard?interval=250")
        for _ in range(150):  # a bounded wait for the page's first polls
            snap = own.evaluate(TENANTS_JS)
            if snap["polls"] >= 2 and snap["shown"]:
                break
            time.sleep(0.1)
        assert snap["shown"], snap
        assert snap["summary"]["default"]["text"] == "reject"
        assert as_int(snap["summary"]["unauthenticated"]) == stats["unauthenticated"] == 1
        assert as_int(snap["summary"]["tenants"]) == 11
        assert [r["tenant"] for r in snap["rows"]] == [t["name"] for t in top]
        for row, t in zip(snap["rows"], top):
            f = row["fields"]
            assert f["name"]["text"] == t["name"]
            for name in ("requests", "rejected", "prompt_tokens", "cached_tokens",
                         "in_flight"):
                assert as_int(f[name]) == t[name], (t["name"], name)
            as_rate(f["hit_rate"], t["hit_rate"])
            for used, limit in (("in_flight", "concurrent_requests"),
                                ("requests_last_minute", "requests_per_minute"),
                                ("prompt_tokens_last_minute", "prompt_tokens_per_minute")):
                if t["limits"][limit] is None:
                    assert (f[limit]["value"], f[limit]["text"]) == ("", "no limit")
                else:
                    assert as_int(f[limit]) == t["limits"][limit]
                    assert as_int(f[used]) == t[used]
        t02 = snap["rows"][1]
        assert t02["title"] == "rate_limit_requests: 1"
        assert as_int(t02["fields"]["requests_per_minute"]) == 2
        assert errors == []
        own.close()
    finally:
        router.stop()
