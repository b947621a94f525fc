// The plan's picture, shared by the standalone page and the ComfyUI panel. The drawing itself is made by the
// server (graph/draw/timeline.py: the same SVG as `vramgraph plan --svg`), sent as the "svg" field of POST
// /vramgraph/plan and of the websocket's vramgraph.plan event. This module only inserts it and adds the live
// state: every element of step i carries data-step="i"; the running step gets the class "current" and the
// steps not reached yet the class "pending" (the SVG's own <style> says how they look).

const GiB = 2 ** 30;

export function gib(n) {
  return n >= GiB / 10 ? `${(n / GiB).toFixed(2)} GiB` : `${(n / 2 ** 20).toFixed(1)} MiB`;
}

/**
 * Put the plan's SVG (text) into `wrap`, replacing what was there, unless it is already shown; then mark
 * the live state. opts: {current (step index or null), reached (steps done so far, or null when nothing
 * runs), id (the id the inserted <svg> gets)}. Returns the <svg> element.
 */
export function showTimeline(wrap, svgText, opts = {}) {
  let svg = wrap.querySelector("svg");
  if (!svg || wrap.vgSvgText !== svgText) {
    const doc = new DOMParser().parseFromString(svgText, "image/svg+xml");
    if (doc.querySelector("parsererror") || doc.documentElement.localName !== "svg") {
      throw new Error("the plan's picture is not an SVG document");
    }
    svg = document.importNode(doc.documentElement, true);
    if (opts.id) svg.id = opts.id;
    wrap.replaceChildren(svg);
    wrap.vgSvgText = svgText;
  }
  markSteps(svg, opts.current ?? null, opts.reached ?? null);
  return svg;
}

/** Mark step `current` as running and the steps after `reached` as pending (null: none). */
export function markSteps(svg, current, reached) {
  for (const el of svg.querySelectorAll("[data-step]")) {
    const i = Number(el.dataset.step);
    el.classList.toggle("current", current !== null && i === current);
    el.classList.toggle("pending", reached !== null && i > reached);
  }
}

/** The index of the plan step that runs `node`, or null. */
export function stepOfNode(plan, node) {
  if (!plan) return null;
  const i = plan.steps.findIndex((s) => s.kind === "run" && s.node === node);
  return i < 0 ? null : i;
}
