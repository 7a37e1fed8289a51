// One colour per replica, stable for the life of the tab (charts, legends, decisions).

import { svg } from "./dom.js";

const PALETTE = ["#4e9af1", "#f5a524", "#3ecf8e", "#e5484d", "#a78bfa", "#2dd4bf",
                 "#f472b6", "#facc15", "#93c5fd", "#fb923c"];
const colors = new Map();  // replica URL -> colour

export function colorOf(url) {
  if (!colors.has(url)) colors.set(url, PALETTE[colors.size % PALETTE.length]);
  return colors.get(url);
}

export const swatch = (url) =>
  svg("svg", { class: "swatch", width: 10, height: 10, "aria-hidden": "true" },
      svg("rect", { width: 10, height: 10, rx: 2, fill: colorOf(url) }));
