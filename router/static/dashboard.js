// Operator dashboard of the prefix router: polls /stats, keeps a short history in the tab,
// and draws it (charts.js). Every figure sits in an element with data-field (data-value holds
// the raw number), inside an element with data-replica=URL where it belongs to one replica.

import { makeCard, pagesOf, renderCard } from "./cards.js";
import { drawSparkline, drawTimeChart, stackedBar } from "./charts.js";
import { colorOf, swatch } from "./colors.js";
import { renderDecisions } from "./decisions.js";
import { renderTenants, tenantColumns } from "./tenants.js";
import { el, setValue, svg } from "./dom.js";
import { clamp, fmtInt, fmtPct, shortUrl } from "./format.js";

const HISTORY_S = 900;    // history this tab keeps
const MIN_SPAN_S = 20;    // time axes cover at least this much
const WINDOW_S = 10;      // "recent" hit rate: over this many seconds
const INTERVAL_MS = clamp(Number(new URLSearchParams(location.search).get("interval")) || 1000,
                          200, 60000);

const state = {
  history: new Map(),  // replica URL -> [{t, prompt, cached, requests, rate, rps}]
  cluster: [],         // the same for the totals
  cards: new Map(),    // replica URL -> card
  paused: false,
  busy: false,
  polls: 0,
  timer: null,
};

const $ = (id) => document.getElementById(id);
const now = () => performance.now() / 1000;

// -- history kept in the browser ------------------------------------------------------

/** Append cumulative counters; the sample's rate is the hit rate of the last WINDOW_S. */
function remember(list, t, c) {
  const last = list[list.length - 1];
  if (last && (c.prompt < last.prompt || c.requests < last.requests)) list.length = 0;  // reset
  let base = null;  // the newest sample at least WINDOW_S old, else the oldest
  for (let i = list.length - 1; i >= 0; i--) {
    base = list[i];
    if (t - base.t >= WINDOW_S) break;
  }
  const dp = base ? c.prompt - base.prompt : 0;
  const sample = { t, ...c, rate: dp > 0 ? (c.cached - base.cached) / dp : null,
                   rps: base && t > base.t ? (c.requests - base.requests) / (t - base.t) : null };
  list.push(sample);
  while (t - list[0].t > HISTORY_S) list.shift();
  return sample;
}

const ratePoints = (samples) => samples.map((s) => ({ t: s.t, v: s.rate }));

function timeSpan() {
  const c = state.cluster;
  const seen = c.length ? c[c.length - 1].t - c[0].t : 0;
  return Math.min(HISTORY_S, Math.max(MIN_SPAN_S, seen));
}

// -- cluster totals -------------------------------------------------------------------

const totalBars = {
  tokens: stackedBar([{ key: "reused", cls: "reused" }, { key: "computed", cls: "computed" }], 16),
  pages: stackedBar([{ key: "used", cls: "used" }, { key: "cached", cls: "cached" },
                     { key: "free", cls: "free" }], 16),
};
$("total-tokens-bar").append(totalBars.tokens);
$("total-pages-bar").append(totalBars.pages);
$("tenants-head").append(...tenantColumns());

function renderTotals(stats, recent) {
  const t = stats.totals, reps = stats.replicas;
  const sum = (f) => reps.reduce((a, r) => a + (f(r) || 0), 0);
  const set = (id, value, text) => setValue($(id), value, text);
  const computed = t.prompt_tokens - t.cached_tokens;
  const pages = { used: 0, cached: 0, free: 0 };
  for (const p of reps.map((r) => pagesOf(r.load)).filter(Boolean)) {
    pages.used += p.used; pages.cached += p.cached; pages.free += p.free;
  }
  const running = sum((r) => r.load && r.load.running);
  const waiting = sum((r) => r.load && r.load.waiting);
  const inFlight = sum((r) => r.in_flight);
  const healthy = reps.filter((r) => r.health === "healthy").length;
  const open = reps.filter((r) => r.circuit !== "closed").length;
  set("policy", stats.policy, stats.policy);
  set("backend", stats.backend, stats.backend);
  set("total-requests", t.requests, fmtInt(t.requests));
  set("total-rps", recent.rps, recent.rps == null ? "–" : recent.rps.toFixed(1));
  set("total-hit-rate", t.hit_rate, fmtPct(t.hit_rate));
  set("total-hit-rate-recent", recent.rate, fmtPct(recent.rate));
  set("total-prompt-tokens", t.prompt_tokens, fmtInt(t.prompt_tokens));
  set("total-cached-tokens", t.cached_tokens, fmtInt(t.cached_tokens));
  set("total-computed-tokens", computed, fmtInt(computed));
  set("total-pages-used", pages.used, fmtInt(pages.used));
  set("total-pages-cached", pages.cached, fmtInt(pages.cached));
  set("total-pages-free", pages.free, fmtInt(pages.free));
  set("total-in-flight", inFlight, fmtInt(inFlight));
  set("total-running", running, fmtInt(running));
  set("total-waiting", waiting, fmtInt(waiting));
  set("total-healthy", healthy, String(healthy));
  set("total-replicas", reps.length, String(reps.length));
  set("total-open", open, String(open));
  $("total-healthy").dataset.state =
    healthy === reps.length ? "ok" : healthy === 0 ? "bad" : "warn";
  totalBars.tokens.update({ reused: t.cached_tokens, computed });
  totalBars.pages.update(pages);
}

// -- share of traffic -----------------------------------------------------------------

function renderShare(stats) {
  const total = stats.totals.requests;
  const bar = svg("svg", { width: "100%", height: 28, class: "share", role: "img" },
                  svg("rect", { class: "stack-bg", width: "100%", height: "100%", rx: 4 }));
  const legend = [];
  const words = [];
  let x = 0;
  for (const r of stats.replicas) {
    const share = total > 0 ? r.requests / total : 0;
    const w = 100 * share;
    if (w > 0) {
      bar.append(svg("rect", { x: x + "%", width: w + "%", height: "100%",
                               fill: colorOf(r.url), "data-replica": r.url },
                     svg("title", {}, `${shortUrl(r.url)}: ${fmtInt(r.requests)} requests`)));
      if (w >= 12) {
        bar.append(svg("text", { class: "share-label", x: x + w / 2 + "%", y: 18,
                                 "text-anchor": "middle" }, fmtPct(share)));
      }
    }
    x += w;
    words.push(`${shortUrl(r.url)} ${fmtPct(share)}`);
    const value = el("b", { "data-field": "share" });
    setValue(value, share, fmtPct(share));
    const count = el("span", { class: "muted", "data-field": "requests" });
    setValue(count, r.requests, fmtInt(r.requests) + " req");
    legend.push(el("span", { class: "legend-item", "data-replica": r.url }, swatch(r.url),
                   el("span", { class: "url" }, shortUrl(r.url)), value, count));
  }
  bar.setAttribute("aria-label", "share of traffic: " + words.join(", "));
  $("share-bar").replaceChildren(bar);
  $("share-legend").replaceChildren(...legend);
}

// -- replica cards --------------------------------------------------------------------

function renderReplicas(stats, t) {
  const box = $("replicas");
  const seen = new Set();
  const span = timeSpan();
  for (const r of stats.replicas) {
    seen.add(r.url);
    if (!state.history.has(r.url)) state.history.set(r.url, []);
    const history = state.history.get(r.url);
    const recent = remember(history, t, { prompt: r.prompt_tokens, cached: r.cached_tokens,
                                          requests: r.requests });
    let card = state.cards.get(r.url);
    if (!card) state.cards.set(r.url, (card = makeCard(r.url)));
    box.append(card.root);  // (re)appending keeps the order of /stats
    renderCard(card, r, stats.totals.requests, recent);
    drawSparkline(card.spark, ratePoints(history), colorOf(r.url), t - span, t);
  }
  for (const [url, card] of state.cards) {
    if (!seen.has(url)) {  // removed from the router
      card.root.remove();
      state.cards.delete(url);
      state.history.delete(url);
    }
  }
}

function renderHitChart(stats, t) {
  const series = stats.replicas.map((r) => ({
    points: ratePoints(state.history.get(r.url) || []), color: colorOf(r.url),
    title: shortUrl(r.url), replica: r.url }));
  series.push({ points: ratePoints(state.cluster), cls: "cluster", title: "cluster" });
  drawTimeChart($("hit-chart"), series, timeSpan(), t,
                `no traffic in the last ${WINDOW_S} s yet`);
}

// -- polling --------------------------------------------------------------------------

function render(stats) {
  const t = now();
  const recent = remember(state.cluster, t, { prompt: stats.totals.prompt_tokens,
                                              cached: stats.totals.cached_tokens,
                                              requests: stats.totals.requests });
  stats.replicas.forEach((r) => colorOf(r.url));
  renderTotals(stats, recent);
  renderShare(stats);
  renderReplicas(stats, t);
  renderHitChart(stats, t);
  renderTenants($("tenants-panel"), $("tenants-body"), $("tenants-summary"), stats.tenants);
  renderDecisions($("decisions"), stats.decisions || []);
}

function setStatus(kind, text) {
  $("status").dataset.state = kind;
  $("status").textContent = text;
}

async function poll() {
  state.timer = null;
  if (state.busy) return;
  state.busy = true;
  try {
    const response = await fetch("stats", { cache: "no-store",
                                            headers: { accept: "application/json" } });
    if (!response.ok) throw new Error(`/stats answered ${response.status}`);
    render(await response.json());
    state.polls++;
    document.body.dataset.polls = String(state.polls);
    setStatus("live", "live");
    $("updated").textContent = "updated " +
      new Date().toLocaleTimeString("en-GB", { hour12: false }) +
      ` · every ${INTERVAL_MS / 1000} s`;
  } catch (err) {
    setStatus("down", "router unreachable: " + (err && err.message ? err.message : err));
  } finally {
    state.busy = false;
    if (!state.paused && !state.timer) state.timer = setTimeout(poll, INTERVAL_MS);
  }
}

$("pause").addEventListener("click", (ev) => {
  state.paused = !state.paused;
  ev.currentTarget.textContent = state.paused ? "Resume" : "Pause";
  if (state.paused) {
    clearTimeout(state.timer);
    state.timer = null;
    setStatus("paused", "paused");
  } else {
    poll();
  }
});

poll();
