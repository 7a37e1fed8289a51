// The latest routing decisions: the choice, the reason, and every candidate as the policy
// saw it (probed reuse, load, score).

import { swatch } from "./colors.js";
import { el, svg } from "./dom.js";
import { fmtClock, fmtInt, fmtNum, shortUrl } from "./format.js";

export const DECISIONS_SHOWN = 10;
let shownKey = null;

/** Redraw only when the latest decisions changed (keeps any text selection). */
export function renderDecisions(box, decisions) {
  const shown = decisions.slice(0, DECISIONS_SHOWN);
  const key = shown.map((d) => d.request_id).join(",");
  if (key === shownKey) return;
  shownKey = key;
  box.replaceChildren(...(shown.length ? shown.map(decisionView)
                                     : [el("p", { class: "empty" }, "No decisions yet.")]));
}

function decisionView(d) {
  const value = (name, v, text, cls) =>
    el("span", { class: cls, "data-field": name, "data-value": v }, text);
  const head = el("div", { class: "dhead" },
    value("at", d.at, fmtClock(d.at), "when"),
    el("span", { class: "dchosen", "data-field": "chosen", "data-value": d.chosen },
       swatch(d.chosen), shortUrl(d.chosen)),
    el("span", { class: "reason", "data-field": "reason" }, d.reason),
    el("span", { class: "muted" },
       value("prompt_tokens", d.prompt_tokens, fmtInt(d.prompt_tokens)), " prompt tokens · probe ",
       value("probe_ms", d.probe_ms, d.probe_ms.toFixed(1)), " ms · ",
       el("span", { class: "rid", title: d.request_id }, d.request_id.slice(0, 8))));
  const columns = ["replica", "probed reuse", "reuse", "attention-only", "pending",
                   "queued prefill", "running", "waiting", "in flight", "score"];
  return el("article", { class: "decision", "data-request-id": d.request_id }, head,
    el("table", { class: "cands" },
      el("thead", {}, el("tr", {}, columns.map((c) => el("th", {}, c)))),
      el("tbody", {}, d.candidates.map((c) => candidateRow(c, d)))));
}

function candidateRow(c, d) {
  const chosen = c.replica === d.chosen;
  const cell = (name, text) =>
    el("td", { class: "num", "data-field": name, "data-value": c[name] ?? "" }, text);
  const width = (n) => (d.prompt_tokens ? (120 * (n || 0)) / d.prompt_tokens : 0);
  const bar = svg("svg", { class: "reusebar", width: 120, height: 10, role: "img",
                           "aria-label": `reuse ${fmtInt(c.reuse)} of ${fmtInt(d.prompt_tokens)}` },
    svg("rect", { class: "stack-bg", width: 120, height: 10, rx: 2 }),
    svg("rect", { class: "pruned", height: 10, width: width(c.reuse_before_hybrid_pruning) }),
    svg("rect", { class: "reused", height: 10, width: width(c.reuse) }));
  return el("tr", { class: chosen ? "chosen" : null, "data-replica": c.replica },
    el("td", {}, swatch(c.replica), " ", shortUrl(c.replica), chosen ? " ✓" : "",
       c.note ? el("span", { class: "note" }, " " + c.note) : null),
    el("td", {}, bar),
    cell("reuse", c.reuse == null ? "no answer" : fmtInt(c.reuse)),
    cell("reuse_before_hybrid_pruning", fmtInt(c.reuse_before_hybrid_pruning)),
    cell("pending_reuse", fmtInt(c.pending_reuse)),
    cell("queued_prefill_tokens", fmtInt(c.queued_prefill_tokens)),
    cell("running", fmtInt(c.running)),
    cell("waiting", fmtInt(c.waiting)),
    cell("in_flight", fmtInt(c.in_flight)),
    cell("score", fmtNum(c.score)));
}
