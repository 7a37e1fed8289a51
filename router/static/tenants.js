// The top tenants (--api-keys): requests, refusals, prompt and cached tokens, hit rate, and
// how close each is to its limits. Hidden when the router runs without API keys.

import { el, setValue } from "./dom.js";
import { fmtInt, fmtPct } from "./format.js";

export const TENANTS_SHOWN = 10;  // /stats lists tenants most requests first

const COLUMNS = ["tenant", "requests", "rejected", "prompt tokens", "cached tokens",
                 "hit rate", "in flight / limit", "requests / min", "prompt tokens / min"];

/** ``used / limit`` as two figures; "no limit" where there is none (and the use, when
 * nothing counts it: /stats has no window without a limit). */
function usedOf(used, usedName, limit, limitName) {
  const l = el("span", { "data-field": limitName });
  setValue(l, limit, limit == null ? "no limit" : fmtInt(limit));
  if (used == null) return [l];
  const u = el("span", { "data-field": usedName });
  setValue(u, used, fmtInt(used));
  return [u, " / ", l];
}

function row(t) {
  const cell = (name, value, text) => {
    const v = el("span", { "data-field": name });
    setValue(v, value, text);
    return el("td", { class: "num" }, v);
  };
  const by = Object.entries(t.rejected_by).filter(([, n]) => n > 0)
    .map(([why, n]) => `${why}: ${fmtInt(n)}`).join(", ");
  const name = el("span", { "data-field": "name" });
  setValue(name, t.name, t.name);
  const rejected = cell("rejected", t.rejected, fmtInt(t.rejected));
  if (by) rejected.title = by;
  const lim = t.limits;
  return el("tr", { "data-tenant": t.name },
    el("td", { class: "tname" }, name),
    cell("requests", t.requests, fmtInt(t.requests)),
    rejected,
    cell("prompt_tokens", t.prompt_tokens, fmtInt(t.prompt_tokens)),
    cell("cached_tokens", t.cached_tokens, fmtInt(t.cached_tokens)),
    cell("hit_rate", t.hit_rate, fmtPct(t.hit_rate)),
    el("td", { class: "num" },
       usedOf(t.in_flight, "in_flight", lim.concurrent_requests, "concurrent_requests")),
    el("td", { class: "num" },
       usedOf(t.requests_last_minute, "requests_last_minute", lim.requests_per_minute,
              "requests_per_minute")),
    el("td", { class: "num" },
       usedOf(t.prompt_tokens_last_minute, "prompt_tokens_last_minute",
              lim.prompt_tokens_per_minute, "prompt_tokens_per_minute")));
}

/** Fill the tenants panel from /stats' ``tenants`` (null: no --api-keys, panel hidden). */
export function renderTenants(panel, body, summary, tenants) {
  panel.hidden = tenants == null;
  if (tenants == null) return;
  const def = el("b", { "data-field": "default" });
  setValue(def, tenants.default, tenants.default);
  const unauth = el("b", { "data-field": "unauthenticated" });
  setValue(unauth, tenants.unauthenticated, fmtInt(tenants.unauthenticated));
  const count = el("b", { "data-field": "tenants" });
  setValue(count, tenants.tenants.length, fmtInt(tenants.tenants.length));
  summary.replaceChildren(count, " tenants · unknown or missing keys: ", def,
                          " · refused 401: ", unauth);
  const shown = tenants.tenants.slice(0, TENANTS_SHOWN);
  body.replaceChildren(...(shown.length ? shown.map(row) : [
    el("tr", {}, el("td", { class: "empty", colspan: COLUMNS.length }, "No tenants.")),
  ]));
}

export const tenantColumns = () => COLUMNS.map((c) => el("th", { scope: "col" }, c));
