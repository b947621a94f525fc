// ComfyUI front-end extension of the vramgraph pack: a panel with the VRAM plan of the queued prompt.
// ComfyUI loads every .js file of WEB_DIRECTORY as an extension; this is the only one. It asks the
// pack's route POST /vramgraph/plan (added to ComfyUI's server by the pack) for the plan of the graph
// when a prompt is queued, or when the "VRAM plan" button is pressed, and shows the plan's picture that
// route sends (the same SVG as the standalone page and `vramgraph plan --svg`, inserted by timeline.mjs),
// falling back to the plan's text table.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const ID = "vramgraph-plan-panel";

function panel() {
  let p = document.getElementById(ID);
  if (p) return p;
  p = document.createElement("div");
  p.id = ID;
  Object.assign(p.style, {
    position: "fixed", right: "12px", bottom: "56px", zIndex: 10000, background: "#fff", color: "#222",
    border: "1px solid #888", borderRadius: "8px", padding: "8px 10px", maxWidth: "min(820px, 90vw)",
    maxHeight: "70vh", overflow: "auto", font: "12px sans-serif", boxShadow: "0 2px 12px rgba(0,0,0,.35)",
    display: "none",
  });
  const head = document.createElement("div");
  Object.assign(head.style, { display: "flex", justifyContent: "space-between", gap: "12px", marginBottom: "4px" });
  const title = document.createElement("b");
  title.textContent = "vramgraph: VRAM plan";
  const close = document.createElement("button");
  close.textContent = "\u00d7";
  close.onclick = () => { p.style.display = "none"; };
  head.append(title, close);
  const summary = document.createElement("div");
  summary.className = "vg-summary";
  const picture = document.createElement("div");
  picture.className = "vg-picture";
  const table = document.createElement("pre");
  table.style.margin = "4px 0 0";
  p.append(head, summary, picture, table);
  document.body.appendChild(p);
  return p;
}

async function showPlan() {
  const p = panel();
  p.style.display = "block";
  const [summary, picture, table] = [p.querySelector(".vg-summary"), p.querySelector(".vg-picture"),
    p.querySelector("pre")];
  summary.textContent = "planning\u2026";
  table.textContent = "";
  let data;
  try {
    const { output } = await app.graphToPrompt();
    const res = await api.fetchApi("/vramgraph/plan", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ prompt: output }),
    });
    data = await res.json();
    if (!res.ok) {
      const e = data.error || {};
      summary.textContent = `no plan: ${e.message || res.status}${e.details ? ` (${e.details})` : ""}`;
      return;
    }
  } catch (e) {
    summary.textContent = `no plan: ${e}`;
    return;
  }
  const plan = data.plan;
  summary.textContent = `${plan.steps.length} steps, ${plan.loads} loads, peak ` +
    `${(plan.peak / 2 ** 30).toFixed(2)} of ${(plan.budget.gpu / 2 ** 30).toFixed(2)} GiB`;
  const others = data.unplanned || [];  // ComfyUI's own node types we do not implement: planned as stand-ins
  if (others.length) {
    summary.textContent += `; not planned (ComfyUI runs them, their GPU memory is not counted): ` +
      others.map((n) => `${n.node} ${n.class_type}`).join(", ");
  }
  try {
    const { showTimeline } = await import("./timeline.mjs");
    showTimeline(picture, data.svg);
  } catch (e) {
    picture.replaceChildren();
    table.textContent = data.table;
  }
}

app.registerExtension({
  name: "vramgraph.PlanPanel",
  async setup() {
    const button = document.createElement("button");
    button.textContent = "VRAM plan";
    button.title = "vramgraph: show the memory plan of this workflow";
    Object.assign(button.style, { position: "fixed", right: "12px", bottom: "12px", zIndex: 10000 });
    button.onclick = showPlan;
    document.body.appendChild(button);
    api.addEventListener("promptQueued", () => { showPlan(); });
  },
});
