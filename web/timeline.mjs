// The plan's GPU memory over its steps, drawn as SVG from graph.timeline.timeline_data(plan):
// stacked bands per model (one colour per model label), the activation band of Run steps, the budget
// line, and + / - marks at Load and Unload steps. While a prompt runs, steps not reached yet are faded
// and the current one is highlighted. Shared by the standalone page and the ComfyUI panel.

export const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#bab0ac"];
export const ACTIVATION = "#e15759";
const NS = "http://www.w3.org/2000/svg";
const GiB = 2 ** 30;

function el(name, attrs = {}, text = null) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== null) e.textContent = text;
  return e;
}

export function gib(n) {
  return n >= GiB / 10 ? `${(n / GiB).toFixed(2)} GiB` : `${(n / 2 ** 20).toFixed(1)} MiB`;
}

/** One colour per model label, in order of first appearance (as the Python SVG does). */
export function colours(timeline) {
  const byLabel = new Map();
  for (const m of Object.values(timeline.models)) {
    if (!byLabel.has(m.label)) byLabel.set(m.label, PALETTE[byLabel.size % PALETTE.length]);
  }
  return byLabel;
}

function stepName(step, planStep) {
  if (planStep && planStep.kind === "run") return `#${planStep.node}`;
  return step.kind;
}

/**
 * Draw `timeline` into `svg`. opts: {plan (the plan JSON, for node ids), current (step index or null),
 * reached (number of steps done, or null when nothing runs), width (px available)}.
 * The vertical scale is the budget; when the peak is under a quarter of it the scale is the peak and
 * the budget line is drawn at the top with its value ("above").
 */
export function drawTimeline(svg, timeline, opts = {}) {
  const steps = timeline.steps || [];
  const planSteps = (opts.plan && opts.plan.steps) || [];
  const colour = colours(timeline);
  const left = 58, top = 34, plotH = 200, bottom = 78, legendW = 150;
  const avail = Math.max(360, (opts.width || 640) - left - legendW - 10);
  const col = Math.max(18, Math.min(56, Math.floor(avail / Math.max(steps.length, 1))));
  const width = left + col * Math.max(steps.length, 1) + legendW;
  const height = top + plotH + bottom;
  const budget = timeline.budget, peak = timeline.peak;
  const zoomed = peak > 0 && peak < budget / 4;
  const scale = zoomed ? peak * 1.25 : Math.max(budget, peak, 1) * 1.08;
  const y = (n) => top + plotH - (plotH * n) / scale;

  svg.replaceChildren();
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.appendChild(el("rect", { width, height, fill: "white" }));

  // highlight and fade
  steps.forEach((st, i) => {
    if (opts.current === i) {
      const g = el("g", { class: "current", "data-step": i });
      g.appendChild(el("rect", { class: "hl", x: left + i * col, y: top, width: col, height: plotH, fill: "#ffe9a8" }));
      svg.appendChild(g);
    }
  });

  // y axis in GiB (or MiB when small)
  const unit = scale >= GiB ? GiB : 2 ** 20;
  const unitName = unit === GiB ? "GiB" : "MiB";
  const ticks = 6;
  const stepVal = Math.max(1, Math.ceil(scale / unit / ticks));
  for (let k = 0; k * stepVal * unit <= scale; k++) {
    const v = k * stepVal * unit;
    svg.appendChild(el("line", { x1: left - 4, x2: left, y1: y(v), y2: y(v), stroke: "#444" }));
    svg.appendChild(el("text", { x: left - 7, y: y(v) + 3, "text-anchor": "end" }, String(k * stepVal)));
  }
  svg.appendChild(el("text", { x: 12, y: top + plotH / 2, transform: `rotate(-90 12 ${top + plotH / 2})`,
    "text-anchor": "middle" }, `GPU ${unitName}`));

  // stacked bands, one group per model
  const base = steps.map(() => 0);
  for (const [key, m] of Object.entries(timeline.models)) {
    const g = el("g", { class: "band", "data-model": key, fill: colour.get(m.label) });
    g.appendChild(el("title", {}, `${m.label}: ${gib(m.nbytes)}`));
    steps.forEach((st, i) => {
      const nb = (st.models || {})[key] || 0;
      if (!nb) return;
      const h = Math.max(2, y(base[i]) - y(base[i] + nb));
      const r = el("rect", { x: left + i * col + 3, y: y(base[i]) - h, width: col - 6, height: h });
      if (opts.reached != null && i > opts.reached) r.setAttribute("fill-opacity", "0.35");
      g.appendChild(r);
      base[i] += nb;
    });
    svg.appendChild(g);
  }
  const acts = el("g", { class: "activation", fill: ACTIVATION, "fill-opacity": "0.75" });
  acts.appendChild(el("title", {}, "activations"));
  steps.forEach((st, i) => {
    if (!st.activation) return;
    const h = Math.max(1, y(base[i]) - y(base[i] + st.activation));
    acts.appendChild(el("rect", { x: left + i * col + 3, y: y(base[i]) - h, width: col - 6, height: h }));
  });
  svg.appendChild(acts);

  // budget line
  const right = left + col * Math.max(steps.length, 1);
  const by = zoomed ? top - 6 : y(budget);
  svg.appendChild(el("line", { class: "budget", x1: left, x2: right, y1: by, y2: by, stroke: "black",
    "stroke-width": 1.5, "stroke-dasharray": "6 3" }));
  svg.appendChild(el("text", { x: left + 4, y: by - 4 }, `budget ${gib(budget)}${zoomed ? " (above this scale)" : ""}`));
  svg.appendChild(el("line", { x1: left, x2: left, y1: top, y2: top + plotH, stroke: "#444" }));
  svg.appendChild(el("line", { x1: left, x2: right, y1: top + plotH, y2: top + plotH, stroke: "#444" }));

  // load / unload marks and step labels
  steps.forEach((st, i) => {
    const cx = left + i * col + col / 2;
    const ps = planSteps[i];
    if (st.kind === "load" || st.kind === "unload") {
      const load = st.kind === "load";
      const fill = load ? "#2a7a2a" : "#b22222";
      const model = ps && timeline.models[ps.model] ? timeline.models[ps.model].label : "";
      const g = el("g", { class: `mark ${st.kind}` });
      g.appendChild(el("line", { x1: cx, x2: cx, y1: top, y2: top + plotH, stroke: fill, "stroke-dasharray": "2 2" }));
      g.appendChild(el("text", { x: cx, y: top - 10 - (i % 2) * 10, "text-anchor": "middle", fill },
        `${load ? "+" : "\u2212"}${model}`));
      svg.appendChild(g);
    }
    const ly = top + plotH + 12;
    const t = el("text", { x: cx, y: ly, "text-anchor": "end", transform: `rotate(-50 ${cx} ${ly})` },
      `${i + 1} ${stepName(st, ps)}`);
    t.appendChild(el("title", {}, st.label + (st.note ? ` (${st.note})` : "")));
    if (opts.current === i) t.setAttribute("font-weight", "bold");
    svg.appendChild(t);
  });

  // legend
  const lx = right + 12;
  [...colour.entries(), ["activation", ACTIVATION]].forEach(([label, c], k) => {
    const ly = top + 30 + 16 * k;
    svg.appendChild(el("rect", { x: lx, y: ly - 9, width: 10, height: 10, fill: c }));
    svg.appendChild(el("text", { x: lx + 14, y: ly }, label));
  });
  return svg;
}

/** The index of the plan step that runs `node`, or null. */
export function stepOfNode(plan, node) {
  if (!plan) return null;
  const i = plan.steps.findIndex((s) => s.kind === "run" && s.node === node);
  return i < 0 ? null : i;
}
