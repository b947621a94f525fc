// ComfyUI front-end extension of vramgraph: a panel with the VRAM plan of the workflow on the canvas.
// ComfyUI loads every .js file of WEB_DIRECTORY as an extension; this is the only one. `vramgraph serve
// --front-end comfyui` lists it at /extensions too. The "VRAM plan" button opens the panel; while it is open
// and nothing runs, the plan of the graph on the canvas is asked of POST /vramgraph/plan whenever the graph
// changes (a preview, before anything is queued). On vramgraph's own server the panel also follows a run
// live: it subscribes this client to the websocket events vramgraph.plan (the running prompt's plan) and
// vramgraph.step (each load and unload), which the server sends only to pages that subscribe (POST
// /vramgraph/events), and marks the running step. Inside ComfyUI (the pack) there are no such events: the
// panel shows the preview of what was queued. The picture is the route's SVG (the same drawing as the
// standalone page and `vramgraph plan --svg`, inserted by timeline.mjs), else the plan's text table.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const ID = "vramgraph-plan-panel";
const PREVIEW_EVERY_MS = 1500;
const S = { live: null, runs: 0, plan: null, svg: null, table: "", current: null, reached: null, lastKey: null,
  busy: false, subscribedAs: null, ours: false, timer: null };

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
  title.textContent = "vramgraph: VRAM plan ";
  const kind = document.createElement("small");
  kind.className = "vg-kind";
  title.append(kind);
  const close = document.createElement("button");
  close.textContent = "\u00d7";
  close.title = "close";
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

const part = (cls) => panel().querySelector(cls);
const isOpen = () => panel().style.display !== "none";

function describe(data) {
  const plan = data.plan;
  let text = `${plan.steps.length} steps, ${plan.loads} loads, peak ` +
    `${(plan.peak / 2 ** 30).toFixed(2)} of ${(plan.budget.gpu / 2 ** 30).toFixed(2)} GiB`;
  const others = data.unplanned || [];  // ComfyUI's own node types we do not implement: planned as stand-ins
  if (others.length) {
    text += `; not planned (ComfyUI runs them, their GPU memory is not counted): ` +
      others.map((n) => `${n.node} ${n.class_type}`).join(", ");
  }
  return text;
}

async function draw() {
  const picture = part(".vg-picture");
  const table = part("pre");
  if (!S.svg) { picture.replaceChildren(); table.textContent = S.table || ""; return; }
  try {
    const { showTimeline } = await import("./timeline.mjs");
    showTimeline(picture, S.svg, { current: S.current, reached: S.reached });
    table.textContent = "";
  } catch (e) {
    picture.replaceChildren();
    table.textContent = S.table || String(e);
  }
}

/** What the plan of `prompt` depends on, as a string: the prompt without its seeds (a seed set to change after
 * each run, ComfyUI's "control after generate", changes no plan). */
function planKey(prompt) {
  return JSON.stringify(prompt, (k, v) => (k === "seed" || k === "noise_seed" ? undefined : v));
}

/** The plan of the graph on the canvas (a preview): asked again only when the graph changed, unless `force`. */
async function preview(force = false) {
  if (S.busy || S.live) return;
  S.busy = true;
  const runs = S.runs;  // a run that starts while this plans wins: its live plan is shown, not this preview
  try {
    const { output } = await app.graphToPrompt();
    const key = planKey(output);
    if ((!force && key === S.lastKey) || S.live || S.runs !== runs) return;
    S.lastKey = key;
    part(".vg-kind").textContent = "(preview)";
    if (!Object.keys(output).length) {
      part(".vg-summary").textContent = "the graph is empty";
      S.svg = null; S.table = "";
      await draw();
      return;
    }
    part(".vg-summary").textContent = "planning\u2026";
    const res = await api.fetchApi("/vramgraph/plan", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ prompt: output }),
    });
    const data = await res.json();
    if (S.live || S.runs !== runs) return;
    if (!res.ok) {
      const e = data.error || {};
      part(".vg-summary").textContent = `no plan: ${e.message || res.status}${e.details ? ` (${e.details})` : ""}`;
      S.svg = null; S.table = "";
    } else {
      part(".vg-summary").textContent = describe(data);
      S.plan = data.plan; S.svg = data.svg; S.table = data.table; S.current = null; S.reached = null;
    }
    await draw();
  } catch (e) {
    part(".vg-summary").textContent = `no plan: ${e}`;
  } finally {
    S.busy = false;
  }
}

function open() {
  panel().style.display = "block";
  if (!S.live) preview(true);
  if (!S.timer) {
    S.timer = setInterval(() => { if (isOpen()) preview(); }, PREVIEW_EVERY_MS);
  }
}

function stepOf(node) {
  if (!S.plan || node === null || node === undefined) return null;
  const i = S.plan.steps.findIndex((s) => s.kind === "run" && s.node === String(node));
  return i < 0 ? null : i;
}

function onPlan(e) {
  const d = e.detail;
  S.live = d.prompt_id; S.runs += 1; S.plan = d.plan; S.svg = d.svg; S.table = ""; S.current = null; S.reached = -1;
  panel().style.display = "block";
  part(".vg-kind").textContent = `(live: ${String(d.prompt_id).slice(0, 8)})`;
  part(".vg-summary").textContent = describe(d);
  draw();
}

function onStep(e) {
  if (!S.live) return;
  S.current = e.detail.step; S.reached = Math.max(S.reached ?? -1, e.detail.step);
  draw();
}

function onExecuting(e) {
  if (!S.live) return;
  const i = stepOf(e.detail);
  if (i !== null) { S.current = i; S.reached = Math.max(S.reached ?? -1, i); draw(); }
}

function onEnd(e) {
  if (!S.live || (e.detail && e.detail.prompt_id && e.detail.prompt_id !== S.live)) return;
  const how = e.type === "execution_success" ? "done" : e.type === "execution_error" ? "failed" : "interrupted";
  part(".vg-kind").textContent = `(${how}: ${String(S.live).slice(0, 8)})`;
  S.current = null;
  S.reached = S.plan ? S.plan.steps.length : null;
  S.live = null;  // the picture stays until the graph changes (then the preview of the new graph is shown)
  draw();
}

/** On vramgraph's server (its /features say so), ask for our events under this page's client id. */
async function subscribe() {
  const id = api.clientId;
  if (!id || id === S.subscribedAs) return;
  S.subscribedAs = id;
  try {
    const features = await (await api.fetchApi("/features")).json();
    if (!features || !features.vramgraph) return;  // inside ComfyUI: no live events
    S.ours = true;
    await api.fetchApi("/vramgraph/events", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ clientId: id }),
    });
  } catch (e) {
    S.subscribedAs = null;
  }
}

app.registerExtension({
  name: "vramgraph.PlanPanel",
  async setup() {
    const button = document.createElement("button");
    button.textContent = "VRAM plan";
    button.title = "vramgraph: show the memory plan of this workflow";
    Object.assign(button.style, { position: "fixed", right: "12px", bottom: "12px", zIndex: 10000 });
    button.onclick = () => (isOpen() ? (panel().style.display = "none") : open());
    document.body.appendChild(button);
    api.addEventListener("vramgraph.plan", onPlan);
    api.addEventListener("vramgraph.step", onStep);
    api.addEventListener("executing", onExecuting);
    for (const end of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(end, onEnd);
    }
    // queued: on our server the live plan comes as an event; inside ComfyUI the preview of what was queued is shown
    api.addEventListener("promptQueued", () => { if (S.ours) panel().style.display = "block"; else open(); });
    api.addEventListener("status", () => { subscribe(); });
    subscribe();
  },
});
