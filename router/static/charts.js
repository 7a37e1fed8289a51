// Charts drawn as SVG: stacked bars, sparklines and a time chart. No library.

import { svg } from "./dom.js";
import { clamp, fmtInt } from "./format.js";

/**
 * A horizontal stacked bar. parts: [{key, cls, label}], drawn left to right.
 * Returns the <svg>; call bar.update({key: value, ...}) to redraw it.
 */
export function stackedBar(parts, height) {
  const root = svg("svg", { class: "stack", width: "100%", height: height || 14, role: "img" },
    svg("rect", { class: "stack-bg", width: "100%", height: "100%", rx: 3 }));
  const segments = parts.map((p) => {
    const title = svg("title");
    const rect = svg("rect", { class: "seg " + (p.cls || ""), x: "0%", width: "0%",
                               height: "100%", "data-part": p.key }, title);
    root.append(rect);
    return { key: p.key, label: p.label || p.key, rect, title };
  });
  root.update = (values) => {
    const total = segments.reduce((a, s) => a + (values[s.key] || 0), 0);
    let x = 0;
    const words = segments.map((s) => {
      const v = values[s.key] || 0;
      const w = total > 0 ? (100 * v) / total : 0;
      s.rect.setAttribute("x", x + "%");
      s.rect.setAttribute("width", w + "%");
      x += w;
      return (s.title.textContent = `${s.label}: ${fmtInt(v)} (${w.toFixed(1)}%)`);
    });
    root.setAttribute("aria-label", words.join(", "));
  };
  return root;
}

/** Path data through points [{t, v}] (v in 0..1; null: a gap) in the box x0..x1, y0..y1. */
export function linePath(points, tMin, tMax, x0, x1, y0, y1) {
  const span = Math.max(1e-9, tMax - tMin);
  let d = "";
  let pen = false;
  for (const p of points) {
    if (p.v == null || p.t < tMin) { pen = false; continue; }
    const x = x0 + ((p.t - tMin) / span) * (x1 - x0);
    const y = y1 - clamp(p.v, 0, 1) * (y1 - y0);
    d += (pen ? "L" : "M") + x.toFixed(1) + " " + y.toFixed(1);
    pen = true;
  }
  return d;
}

/** A sparkline of one series (values 0..1) over [tMin, now], with a dot at the latest. */
export function drawSparkline(root, points, color, tMin, now) {
  const w = Math.max(120, root.clientWidth || 400), h = 40;
  root.setAttribute("viewBox", `0 0 ${w} ${h}`);
  root.replaceChildren(svg("line", { class: "grid", x1: 0, x2: w, y1: 2, y2: 2 }),
                       svg("line", { class: "grid", x1: 0, x2: w, y1: h - 2, y2: h - 2 }));
  const box = [1, w - 5, 3, h - 3];
  const d = linePath(points, tMin, now, ...box);
  if (d) root.append(svg("path", { d, fill: "none", stroke: color, "stroke-width": 1.8 }));
  const shown = points.filter((p) => p.v != null && p.t >= tMin);
  const last = shown[shown.length - 1];
  if (last) {
    const x = box[0] + ((last.t - tMin) / Math.max(1e-9, now - tMin)) * (box[1] - box[0]);
    const y = box[3] - clamp(last.v, 0, 1) * (box[3] - box[2]);
    root.append(svg("circle", { cx: x, cy: y, r: 3, fill: color }));
  }
  root.dataset.points = String(shown.length);
}

/**
 * A time chart of ratios (0-100% axis) over the last `span` seconds.
 * series: [{points: [{t, v}], color, cls, title, replica}]; returns how many were drawn.
 */
export function drawTimeChart(root, series, span, now, emptyText) {
  const w = Math.max(300, root.clientWidth || 800), h = 220;
  const L = 44, R = 12, T = 10, B = 24;
  root.setAttribute("viewBox", `0 0 ${w} ${h}`);
  root.replaceChildren();
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    const y = h - B - v * (h - B - T);
    root.append(svg("line", { class: v === 0 ? "axis" : "grid", x1: L, x2: w - R, y1: y, y2: y }),
                svg("text", { class: "tick", x: L - 6, y: y + 4, "text-anchor": "end" },
                    (v * 100).toFixed(0) + "%"));
  }
  const step = span > 300 ? 120 : span > 120 ? 60 : span > 40 ? 15 : 5;
  for (let ago = 0; ago <= span; ago += step) {
    const x = L + ((span - ago) / span) * (w - L - R);
    const label = ago === 0 ? "now" : "-" + (ago >= 60 ? ago / 60 + "m" : ago + "s");
    root.append(svg("text", { class: "tick", x, y: h - 6, "text-anchor": "middle" }, label));
  }
  let drawn = 0;
  for (const s of series) {
    const d = linePath(s.points, now - span, now, L, w - R, T, h - B);
    if (!d) continue;
    drawn++;
    root.append(svg("path", { d, class: "series " + (s.cls || ""), fill: "none",
                              stroke: s.color, "stroke-width": 2, "data-replica": s.replica },
                    svg("title", {}, s.title)));
  }
  if (!drawn) {
    root.append(svg("text", { class: "tick", x: w / 2, y: h / 2, "text-anchor": "middle" },
                    emptyText));
  }
  root.dataset.series = String(drawn);
  return drawn;
}
