// Formatting of figures for the dashboard: pure functions, no DOM.

export const clamp = (x, lo, hi) => Math.min(hi, Math.max(lo, x));

/** A count: "12,345"; "–" when unknown. */
export const fmtInt = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US"));

/** A ratio as a percentage with one decimal: "91.4%". */
export const fmtPct = (x) => (x == null || !isFinite(x) ? "–" : (100 * x).toFixed(1) + "%");

/** Seconds as "4.21 ms", "68.5 ms" or "1.25 s". */
export function fmtSeconds(s) {
  if (s == null) return "–";
  if (s < 0.01) return (s * 1000).toFixed(2) + " ms";
  if (s < 1) return (s * 1000).toFixed(1) + " ms";
  return s.toFixed(2) + " s";
}

/** Any other number (policy scores): three significant digits. */
export function fmtNum(x) {
  if (x == null) return "–";
  if (x === 0) return "0";
  return Math.abs(x) >= 1000 ? fmtInt(x) : Number(x.toPrecision(3)).toString();
}

/** Epoch seconds as local "HH:MM:SS.mmm". */
export function fmtClock(epochS) {
  const d = new Date(epochS * 1000);
  return d.toLocaleTimeString("en-GB", { hour12: false }) + "." +
    String(d.getMilliseconds()).padStart(3, "0");
}

export const shortUrl = (url) => url.replace(/^https?:\/\//, "");
