// One card per replica: health, traffic, reuse, hybrid pruning, KV pages (in all and per
// pool), load, latency.

import { stackedBar } from "./charts.js";
import { swatch } from "./colors.js";
import { el, setValue, svg } from "./dom.js";
import { fmtInt, fmtPct, fmtSeconds, shortUrl } from "./format.js";

// used = total - free - cached (the load reports free and cached pages, not used ones)
export function pagesOf(load) {
  if (!load) return null;
  const cached = load.cached_pages || 0;
  return { used: Math.max(0, load.total_pages - load.free_pages - cached), cached,
           free: load.free_pages, total: load.total_pages };
}

// The columns of the per-pool table: a field of /stats' kv_pools entries, its heading.
// block_pages: pages on cached blocks (for the recurrent pool, the snapshots kept).
const POOL_COLUMNS = [["layers", "layers", null],
                      ["cached_pages", "cached", "cached"], ["used_pages", "used", "used"],
                      ["free_pages", "free", "free"], ["block_pages", "on blocks", null],
                      ["evicted_pages", "evicted", null]];

function poolTable() {
  const heading = ([, label, cls]) =>
    el("th", { scope: "col" }, cls ? el("span", { class: "key " + cls }) : null, label);
  const body = el("tbody");
  const box = el("div", { class: "poolbox", hidden: true },
    el("div", { class: "label" }, "KV pages per pool"),
    el("table", { class: "pools" },
      el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "life cycle"),
                         POOL_COLUMNS.map(heading))),
      body));
  return { box, body, key: null, rows: [] };
}

function poolRow(index) {
  const f = {};
  const cell = (name, cls) => el("td", { class: cls },
                                 (f[name] = el("span", { class: "v", "data-field": name })));
  const root = el("tr", { "data-pool": index }, cell("life_cycle", "lc"),
                  POOL_COLUMNS.map(([name]) => cell(name, "num")));
  return { root, f };
}

/** One row per pool (life cycle), as the router last fetched them; hidden when unknown
 * (--backend openai, or not fetched yet). Rows are rebuilt only when the pools change. */
function renderPools(table, pools) {
  const list = pools || [];
  table.box.hidden = pools == null;
  const key = list.map((p) => p.life_cycle).join("\n");
  if (table.key !== key) {
    table.key = key;
    table.rows = list.map((_, i) => poolRow(i));
    table.body.replaceChildren(...table.rows.map((r) => r.root));
  }
  list.forEach((p, i) => {
    const row = table.rows[i];
    const size = p.page_bytes ? `, ${fmtInt(p.page_bytes)} bytes each` : "";
    const snapshots = p.life_cycle === "recurrent"
      ? ` (a live state per running request; on blocks: snapshots kept, evicted: snapshots ` +
        `evicted)` : "";
    row.root.title = `${fmtInt(p.num_pages)} pages${size}${snapshots}`;
    setValue(row.f.life_cycle, p.life_cycle, p.life_cycle);
    for (const [name] of POOL_COLUMNS) {
      setValue(row.f[name], p[name], fmtInt(p[name]));
    }
  });
}

/** The card's DOM, built once per replica; renderCard fills it on every poll. */
export function makeCard(url) {
  const f = {};  // data-field name -> element
  const F = (name, cls) => (f[name] = el("span", { class: "v " + (cls || ""),
                                                   "data-field": name }, "–"));
  const kpi = (label, name, cls, sub) =>
    el("div", {}, el("div", { class: "label" }, label), F(name, cls || "big"), sub);
  const key = (cls) => el("span", { class: "key " + cls });
  const spark = svg("svg", { class: "spark", "data-field": "hit_rate_sparkline", role: "img",
                             "aria-label": "hit rate over time" });
  const tokens = stackedBar([{ key: "reused", cls: "reused" },
                             { key: "computed", cls: "computed" }]);
  const pruning = stackedBar([{ key: "final", cls: "reused", label: "final reuse" },
                              { key: "pruned", cls: "pruned", label: "lost to hybrid pruning" }]);
  const pages = stackedBar([{ key: "used", cls: "used" }, { key: "cached", cls: "cached" },
                            { key: "free", cls: "free" }]);
  const pools = poolTable();
  const root = el("article", { class: "card", "data-replica": url },
    el("header", {},
      el("div", { class: "title" }, swatch(url),
         el("span", { class: "url", title: url, "data-field": "url" }, shortUrl(url))),
      el("div", { class: "badges" }, F("health", "badge"), F("circuit", "badge"),
         F("draining", "badge"))),
    el("div", { class: "model" }, F("model", "muted"), F("problem", "problem")),
    el("div", { class: "kpis" },
      kpi("Requests", "requests", "big",
          el("div", { class: "sub" }, F("share"), " of traffic · ", F("failures"), " failed")),
      kpi("Hit rate", "hit_rate", "big",
          el("div", { class: "sub" }, "last 10 s ", F("hit_rate_recent"))),
      kpi("TTFT p50", "ttft_p50_s", "mid"),
      kpi("TTFT p99", "ttft_p99_s", "mid")),
    el("div", { class: "sparkbox" }, spark),
    el("div", { class: "label" }, "Prefill tokens"),
    tokens,
    el("div", { class: "sub legendline" },
      key("reused"), "reused ", F("cached_tokens"), " ", key("computed"), "computed ",
      F("computed_tokens"), " of ", F("prompt_tokens")),
    el("div", { class: "label" }, "Probed reuse: attention-only vs final"),
    pruning,
    el("div", { class: "sub legendline" },
      key("reused"), "final ", F("probed_tokens"), " ", key("pruned"),
      "lost to hybrid pruning ", F("pruned_tokens"), " (", F("pruned_share"),
      ") of attention-only ", F("probed_tokens_before_hybrid_pruning")),
    el("div", { class: "label" }, "KV pages"),
    pages,
    el("div", { class: "sub legendline" },
      key("used"), "used ", F("pages_used"), " ", key("cached"), "cached ", F("pages_cached"),
      " ", key("free"), "free ", F("pages_free"), " of ", F("total_pages")),
    pools.box,
    el("div", { class: "load" },
      kpi("Running", "running", "mid"), kpi("Waiting", "waiting", "mid"),
      kpi("In flight", "in_flight", "mid"),
      kpi("Queued prefill", "queued_prefill_tokens", "mid")));
  return { root, f, spark, tokens, pruning, pages, pools };
}

export function renderCard(card, r, totalRequests, recent) {
  const f = card.f;
  const set = (name, value, text) => setValue(f[name], value, text);
  set("health", r.health, r.health);
  f.health.dataset.state = r.health;
  set("circuit", r.circuit, "circuit " + r.circuit.replace("_", "-"));
  f.circuit.dataset.state = r.circuit;
  set("draining", r.draining, r.draining ? "draining" : "");
  f.draining.hidden = !r.draining;
  set("model", r.model, r.model || "model unknown");
  set("problem", r.problem, r.problem ? " · " + r.problem : "");
  const share = totalRequests > 0 ? r.requests / totalRequests : 0;
  set("requests", r.requests, fmtInt(r.requests));
  set("share", share, fmtPct(share));
  set("failures", r.failures, fmtInt(r.failures));
  set("hit_rate", r.hit_rate, fmtPct(r.hit_rate));
  set("hit_rate_recent", recent.rate, fmtPct(recent.rate));
  set("ttft_p50_s", r.ttft_p50_s, fmtSeconds(r.ttft_p50_s));
  set("ttft_p99_s", r.ttft_p99_s, fmtSeconds(r.ttft_p99_s));

  const computed = r.prompt_tokens - r.cached_tokens;
  set("prompt_tokens", r.prompt_tokens, fmtInt(r.prompt_tokens));
  set("cached_tokens", r.cached_tokens, fmtInt(r.cached_tokens));
  set("computed_tokens", computed, fmtInt(computed));
  card.tokens.update({ reused: r.cached_tokens, computed });

  const before = r.probed_tokens_before_hybrid_pruning, final = r.probed_tokens;
  const pruned = Math.max(0, before - final);
  const prunedShare = before > 0 ? pruned / before : null;
  set("probed_tokens_before_hybrid_pruning", before, fmtInt(before));
  set("probed_tokens", final, fmtInt(final));
  set("pruned_tokens", pruned, fmtInt(pruned));
  set("pruned_share", prunedShare, fmtPct(prunedShare));
  card.pruning.update({ final, pruned });

  const p = pagesOf(r.load) || {};
  const load = r.load || {};
  set("pages_used", p.used, fmtInt(p.used));
  set("pages_cached", p.cached, fmtInt(p.cached));
  set("pages_free", p.free, fmtInt(p.free));
  set("total_pages", p.total, fmtInt(p.total));
  card.pages.update({ used: p.used, cached: p.cached, free: p.free });
  renderPools(card.pools, r.kv_pools);
  set("running", load.running, fmtInt(load.running));
  set("waiting", load.waiting, fmtInt(load.waiting));
  set("queued_prefill_tokens", load.queued_prefill_tokens, fmtInt(load.queued_prefill_tokens));
  set("in_flight", r.in_flight, fmtInt(r.in_flight));
  card.root.dataset.health = r.health;
}
