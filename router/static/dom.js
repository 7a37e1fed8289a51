// Building the page. This is the only way text from the router (replica URLs, reasons,
// problems) enters it: as text nodes and attribute values, never parsed as HTML.

const SVGNS = "http://www.w3.org/2000/svg";

function build(node, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v != null && v !== false) node.setAttribute(k, String(v));
  }
  for (const child of children.flat()) {
    if (child != null) node.append(child);  // a string becomes a text node
  }
  return node;
}

/** el("span", {class: "v"}, "text", childNode, ...): an HTML element. */
export const el = (tag, attrs, ...children) =>
  build(document.createElement(tag), attrs, children);

/** The same for SVG elements. */
export const svg = (tag, attrs, ...children) =>
  build(document.createElementNS(SVGNS, tag), attrs, children);

/** Show a figure: the raw number in data-value (for tests and tools), text for people. */
export function setValue(node, value, text) {
  node.dataset.value = value == null ? "" : String(value);
  node.textContent = text;
}
