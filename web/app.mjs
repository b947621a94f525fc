// The standalone page: open a workflow (API or UI format), edit its widgets, queue it, follow it over
// ComfyUI's websocket, see the results and the VRAM plan as a timeline that follows the run.
// Plain ES modules served by `vramgraph serve`; no build step, nothing fetched from elsewhere.

import { drawGraph, renderForms, title } from "./graph.mjs";
import { gib, showTimeline, stepOfNode } from "./timeline.mjs";

const $ = (id) => document.getElementById(id);
const clientId = (globalThis.crypto && crypto.randomUUID ? crypto.randomUUID() : String(Math.random()).slice(2))
  .replace(/-/g, "");

const S = {
  infos: {}, prompt: null, ui: null, name: "workflow", status: {}, errors: {}, selected: null,
  plan: null, timeline: null, svg: null, live: false, current: null, reached: null, mine: new Set(), runs: 0, done: 0,
};

// ------------------------------------------------------------------------------------------- helpers

async function api(path, body = undefined) {
  const init = body === undefined ? {} : { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body) };
  const res = await fetch(path, init);
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!res.ok) {
    const err = new Error((data && data.error && (data.error.message || data.error)) || `${path}: HTTP ${res.status}`);
    err.body = data;
    throw err;
  }
  return data;
}

function log(text, cls = "") {
  const li = document.createElement("li");
  li.textContent = `${new Date().toLocaleTimeString()} ${text}`;
  if (cls) li.className = cls;
  $("log").prepend(li);
}

function download(text, name) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  a.download = name;
  document.body.appendChild(a);
  a.click();
  setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
}

// ------------------------------------------------------------------------------------------- drawing

function redrawGraph() {
  drawGraph($("graph"), S.prompt, S.infos, { status: S.status, selected: S.selected, onSelect: select });
}

function redrawForms() {
  renderForms($("nodes"), S.prompt, S.infos, { onChange: edit, onSelect: select, errors: S.errors,
    selected: S.selected });
}

function redraw() {
  redrawGraph();
  redrawForms();
}

function select(id) {
  S.selected = S.selected === id ? null : id;
  redraw();
  const card = document.querySelector(`.card[data-node="${CSS.escape(String(id))}"]`);
  if (card && S.selected) card.scrollIntoView({ block: "nearest", behavior: "smooth" });
}

function drawPlan() {
  if (!S.timeline || !S.svg) return;
  showTimeline($("timeline-wrap"), S.svg, { id: "timeline", current: S.current, reached: S.live ? S.reached : null });
  const steps = S.plan ? S.plan.steps : [];
  const loads = steps.filter((s) => s.kind === "load").length;
  const unloads = steps.filter((s) => s.kind === "unload").length;
  $("plan-summary").textContent = `${steps.length} steps: ${loads} loads, ${unloads} unloads; peak ` +
    `${gib(S.timeline.peak)} of a ${gib(S.timeline.budget)} budget` +
    (S.plan ? `; ${S.plan.seconds.toFixed(3)} s predicted` : "");
  $("plan-summary").classList.remove("muted");
}

function setBars(node = null, value = 0, max = 0) {
  const total = S.plan ? S.plan.steps.filter((s) => s.kind === "run").length : 0;
  $("bar-all").style.width = total ? `${Math.min(100, (100 * S.done) / total)}%` : "0%";
  $("bar-node").style.width = max ? `${(100 * value) / max}%` : "0%";
  let text = S.live ? `${S.done}/${total} nodes` : "idle";
  if (node !== null && S.prompt && S.prompt[node]) {
    text += ` \u00b7 #${node} ${title(S.prompt, node)}` + (max ? ` step ${value}/${max}` : "");
  }
  $("bar-text").textContent = text;
}

function addImage(node, img) {
  const params = new URLSearchParams({ filename: img.filename, subfolder: img.subfolder || "", type: img.type || "output" });
  const fig = document.createElement("figure");
  const a = document.createElement("a");
  a.href = `/view?${params}`;
  a.target = "_blank";
  const im = document.createElement("img");
  im.src = `/view?${params}`;
  im.alt = img.filename;
  a.appendChild(im);
  fig.appendChild(a);
  const cap = document.createElement("figcaption");
  cap.textContent = `#${node} ${img.filename}`;
  fig.appendChild(cap);
  $("gallery").prepend(fig);
}

// ------------------------------------------------------------------------------------------- actions

let planTimer = null;
function schedulePlan() {
  clearTimeout(planTimer);
  planTimer = setTimeout(previewPlan, 250);
}

async function previewPlan() {
  if (!S.prompt || S.live) return;
  try {
    const r = await api("/vramgraph/plan", { prompt: S.prompt, name: S.name });
    if (S.live) return;
    S.plan = r.plan; S.timeline = r.timeline; S.svg = r.svg; S.current = null; S.reached = null;
    $("plan-kind").textContent = "(preview, before running)";
    drawPlan();
  } catch (e) {
    $("plan-summary").textContent = `no plan: ${e.message}` + (e.body && e.body.error && e.body.error.details
      ? ` (${e.body.error.details})` : "");
  }
}

function setWorkflow(prompt, ui, name) {
  S.prompt = prompt; S.ui = ui; S.name = name.replace(/\.json$/i, "");
  S.status = {}; S.errors = {}; S.selected = null;
  $("wf-name").textContent = `${S.name} (${Object.keys(prompt).length} nodes, ${ui ? "UI" : "API"} format)`;
  $("errors").hidden = true;
  for (const b of ["queue", "save-api", "save-ui"]) $(b).disabled = false;
  redraw();
  schedulePlan();
  log(`opened ${name}`);
}

async function openJson(data, name) {
  try {
    const r = await api("/vramgraph/convert", { workflow: data });
    setWorkflow(r.prompt, r.workflow, name);
  } catch (e) {
    log(`cannot open ${name}: ${e.message}`, "error");
  }
}

async function openFile(file) {
  let data;
  try { data = JSON.parse(await file.text()); } catch (e) { log(`${file.name} is not JSON: ${e.message}`, "error"); return; }
  await openJson(data, file.name);
}

function edit(id, name, value) {
  S.prompt[id].inputs[name] = value;
  delete S.errors[id];
  redrawGraph();
  schedulePlan();
}

async function queue() {
  if (!S.prompt) return;
  const body = { prompt: S.prompt, client_id: clientId, extra_data: { preview_method: "auto", workflow_name: S.name } };
  if (S.ui) body.extra_data.extra_pnginfo = { workflow: S.ui };
  try {
    const r = await api("/prompt", body);
    S.mine.add(r.prompt_id);
    S.errors = {};
    $("errors").hidden = true;
    redrawForms();
    log(`queued ${r.prompt_id.slice(0, 8)} (#${r.number})`);
  } catch (e) {
    const b = e.body || {};
    S.errors = {};
    for (const [id, ne] of Object.entries(b.node_errors || {})) {
      S.errors[id] = (ne.errors || []).map((x) => `${x.message}: ${x.details}`);
    }
    $("errors").textContent = b.error ? `${b.error.message}\n${b.error.details || ""}` : e.message;
    $("errors").hidden = false;
    redrawForms();
    log(`not queued: ${e.message}`, "error");
  }
}

// ------------------------------------------------------------------------------------------- websocket

const handlers = {
  status(d) {
    const n = d.status.exec_info.queue_remaining;
    $("status").textContent = n ? `running, ${n} in queue` : "idle";
  },
  execution_start(d) {
    S.live = true; S.status = {}; S.done = 0; S.current = null; S.reached = -1; S.runs++;
    $("plan-kind").textContent = `(running ${d.prompt_id.slice(0, 8)})`;
    redrawGraph();
    setBars();
  },
  "vramgraph.plan"(d) {
    S.plan = d.plan; S.timeline = d.timeline; S.svg = d.svg; S.live = true; S.reached = -1; S.current = null;
    S.members = d.members || null;  // a batch: prompt id -> (its node id -> node id in the merged plan)
    $("plan-kind").textContent = `(live: ${d.prompt_id.slice(0, 8)})`;
    drawPlan();
    setBars();
  },
  "vramgraph.step"(d) {
    S.current = d.step; S.reached = Math.max(S.reached ?? -1, d.step);
    const label = S.timeline && S.timeline.models[d.model] ? S.timeline.models[d.model].label : d.model;
    log(`${d.kind} ${label}${d.kind === "unload" ? ` (to ${d.to})` : ` (from ${d.source})`}`);
    drawPlan();
  },
  execution_cached(d) {
    for (const n of d.nodes) S.status[n] = "cached";
    if (d.nodes.length) log(`cached: ${d.nodes.join(", ")}`);
    redrawGraph();
  },
  executing(d) {
    for (const [n, s] of Object.entries(S.status)) if (s === "running") S.status[n] = "done";
    if (d.node === null || d.node === undefined) {
      S.current = null;
      if (S.timeline) S.reached = S.timeline.steps.length;
      redrawGraph();
      drawPlan();
      return;
    }
    S.status[d.node] = "running";
    const merged = S.members && S.members[d.prompt_id] ? S.members[d.prompt_id][d.node] : null;
    const i = stepOfNode(S.plan, merged || d.node);
    if (i !== null) { S.current = i; S.reached = Math.max(S.reached ?? -1, i); }
    redrawGraph();
    drawPlan();
    setBars(d.node);
  },
  progress(d) { setBars(d.node, d.value, d.max); },
  executed(d) {
    S.status[d.node] = "done";
    S.done++;
    for (const img of (d.output && d.output.images) || []) addImage(d.node, img);
    redrawGraph();
    setBars();
  },
  execution_success(d) {
    S.done = S.plan ? S.plan.steps.filter((s) => s.kind === "run").length : S.done;
    setBars();
    $("bar-text").textContent = `done (${d.prompt_id.slice(0, 8)})`;
    log(`finished ${d.prompt_id.slice(0, 8)}`);
    S.live = false;
  },
  execution_error(d) {
    S.status[d.node_id] = "error";
    S.errors[d.node_id] = [`${d.exception_type}: ${d.exception_message}`];
    redraw();
    log(`error in #${d.node_id} (${d.node_type}): ${d.exception_message}`, "error");
    S.live = false;
  },
  execution_interrupted(d) {
    log(`interrupted at #${d.node_id}`, "error");
    S.live = false;
  },
};

function showPreview(buf) {
  const view = new DataView(buf);
  if (view.getUint32(0) !== 1) return;
  const type = view.getUint32(4) === 2 ? "image/png" : "image/jpeg";
  const img = $("preview");
  if (img.src.startsWith("blob:")) URL.revokeObjectURL(img.src);
  img.src = URL.createObjectURL(new Blob([buf.slice(8)], { type }));
  img.hidden = false;
}

function connect() {
  const proto = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${proto}://${location.host}/ws?clientId=${clientId}`);
  ws.binaryType = "arraybuffer";
  ws.onmessage = (ev) => {
    if (typeof ev.data !== "string") { showPreview(ev.data); return; }
    const msg = JSON.parse(ev.data);
    const h = handlers[msg.type];
    if (h) {
      try { h(msg.data); } catch (e) { console.error(msg.type, e); }
    }
  };
  ws.onclose = () => { $("status").textContent = "disconnected; retrying"; setTimeout(connect, 1000); };
}

// ------------------------------------------------------------------------------------------- start

async function start() {
  $("open-file").addEventListener("change", (ev) => { if (ev.target.files[0]) openFile(ev.target.files[0]); });
  $("queue").addEventListener("click", queue);
  $("interrupt").addEventListener("click", () => api("/interrupt", {}).then(() => log("stop asked")));
  $("save-api").addEventListener("click", () => download(JSON.stringify(S.prompt, null, 1), `${S.name}_api.json`));
  $("save-ui").addEventListener("click", async () => {
    try {
      const ui = await api("/vramgraph/ui", { prompt: S.prompt, workflow: S.ui });
      download(JSON.stringify(ui, null, 1), `${S.name}.json`);
    } catch (e) { log(`cannot save UI format: ${e.message}`, "error"); }
  });
  $("examples").addEventListener("change", async (ev) => {
    const name = ev.target.value;
    ev.target.value = "";
    if (name) await openJson(await api(`/vramgraph/workflows/${encodeURIComponent(name)}`), `${name}.json`);
  });
  connect();
  try {
    S.infos = await api("/object_info");
    for (const name of await api("/vramgraph/workflows")) {
      const o = document.createElement("option");
      o.value = name; o.textContent = name;
      $("examples").appendChild(o);
    }
  } catch (e) {
    log(`server not answering: ${e.message}`, "error");
  }
  document.body.dataset.ready = "1";
}

start();
