// The workflow graph: an SVG drawing of the API-format prompt (nodes in columns by depth, links as
// curves, widget values inside the boxes) and a form per node whose widgets edit the prompt.

const NS = "http://www.w3.org/2000/svg";
const W = 210, HEAD = 34, ROW = 16, GAPX = 48, GAPY = 18, PAD = 14;
export const WIDGET_TYPES = new Set(["INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"]);

function el(name, attrs = {}, text = null) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== null) e.textContent = text;
  return e;
}

export function isLink(v) {
  return Array.isArray(v) && v.length === 2 && (typeof v[0] === "string" || typeof v[0] === "number")
    && Number.isInteger(v[1]);
}

function byId(a, b) {
  const na = Number(a), nb = Number(b);
  return Number.isNaN(na) || Number.isNaN(nb) ? String(a).localeCompare(String(b)) : na - nb;
}

/** The declared inputs of a class: [{name, type, opts, widget, options}] in declaration order. */
export function declared(info) {
  const out = [];
  for (const section of ["required", "optional"]) {
    for (const [name, spec] of Object.entries((info && info.input && info.input[section]) || {})) {
      const t = Array.isArray(spec) ? spec[0] : spec;
      const opts = (Array.isArray(spec) && spec[1] && typeof spec[1] === "object") ? spec[1] : {};
      const combo = Array.isArray(t);
      const type = combo ? "COMBO" : String(t);
      const options = combo ? t : (type === "COMBO" ? opts.options || [] : null);
      out.push({ name, type, opts, options, optional: section === "optional",
        widget: WIDGET_TYPES.has(type) && !opts.forceInput });
    }
  }
  return out;
}

/** Nodes in topological order (ties by id), or by id when there is a cycle. */
export function topoOrder(prompt) {
  const ids = Object.keys(prompt).sort(byId);
  const indeg = Object.fromEntries(ids.map((i) => [i, 0]));
  const succ = Object.fromEntries(ids.map((i) => [i, []]));
  for (const id of ids) {
    for (const v of Object.values(prompt[id].inputs || {})) {
      if (isLink(v) && String(v[0]) in succ) { succ[String(v[0])].push(id); indeg[id]++; }
    }
  }
  const ready = ids.filter((i) => indeg[i] === 0);
  const order = [];
  while (ready.length) {
    ready.sort(byId);
    const n = ready.shift();
    order.push(n);
    for (const s of succ[n]) if (--indeg[s] === 0) ready.push(s);
  }
  return order.length === ids.length ? order : ids;
}

export function title(prompt, id) {
  const n = prompt[id];
  return (n._meta && n._meta.title) || n.class_type;
}

function short(v, n = 24) {
  const s = typeof v === "string" ? v : JSON.stringify(v);
  return s.length > n ? s.slice(0, n - 1) + "\u2026" : s;
}

function layout(prompt, infos) {
  const order = topoOrder(prompt);
  const depth = {};
  for (const id of order) {
    let d = 0;
    for (const v of Object.values(prompt[id].inputs || {})) {
      if (isLink(v) && String(v[0]) in depth) d = Math.max(d, depth[String(v[0])] + 1);
    }
    depth[id] = d;
  }
  const colY = {};
  const boxes = {};
  for (const id of order) {
    const n = prompt[id];
    const entries = Object.entries(n.inputs || {});
    const outs = ((infos[n.class_type] || {}).output || []).length;
    const rows = Math.max(entries.length, outs, 1);
    const h = HEAD + rows * ROW + 8;
    const c = depth[id];
    const y = colY[c] ?? PAD;
    colY[c] = y + h + GAPY;
    boxes[id] = { x: PAD + c * (W + GAPX), y, w: W, h, rows: entries.map(([k]) => k) };
  }
  const width = Math.max(...Object.values(boxes).map((b) => b.x + b.w), 100) + PAD;
  const height = Math.max(...Object.values(boxes).map((b) => b.y + b.h), 60) + PAD;
  return { boxes, width, height };
}

/** Draw the prompt into `svg`; state: {status: {id: "running"|"done"|"cached"|"error"}, selected, onSelect}. */
export function drawGraph(svg, prompt, infos, state = {}) {
  svg.replaceChildren();
  if (!prompt) return;
  const { boxes, width, height } = layout(prompt, infos);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const links = el("g", { class: "links" });
  svg.appendChild(links);
  for (const [id, n] of Object.entries(prompt)) {
    const b = boxes[id];
    const cls = ["node", (state.status || {})[id] || "", state.selected === id ? "selected" : ""].join(" ").trim();
    const g = el("g", { class: cls, "data-node": id, transform: `translate(${b.x},${b.y})` });
    g.appendChild(el("rect", { class: "box", width: b.w, height: b.h, rx: 6 }));
    g.appendChild(el("rect", { class: "head", x: 1, y: 1, width: b.w - 2, height: HEAD - 4, rx: 5 }));
    g.appendChild(el("text", { class: "title", x: 8, y: 14 }, `#${id} ${short(title(prompt, id))}`));
    g.appendChild(el("text", { class: "kind", x: 8, y: 27 }, n.class_type));
    const outs = (infos[n.class_type] || {}).output || [];
    b.rows.forEach((name, r) => {
      const v = n.inputs[name];
      const ry = HEAD + r * ROW + 11;
      const room = r < outs.length ? Math.max(4, 26 - name.length - String(outs[r]).length) : 28 - name.length;
      if (isLink(v)) {
        g.appendChild(el("circle", { class: "port", cx: 0, cy: ry - 4, r: 3.5 }));
        g.appendChild(el("text", { x: 8, y: ry }, name));
      } else {
        g.appendChild(el("text", { x: 8, y: ry }, `${name}: ${short(v, room)}`));
      }
    });
    outs.forEach((t, s) => {
      const ry = HEAD + s * ROW + 11;
      g.appendChild(el("circle", { class: "port", cx: b.w, cy: ry - 4, r: 3.5 }));
      g.appendChild(el("text", { x: b.w - 8, y: ry, "text-anchor": "end", class: "kind" }, t));
    });
    g.addEventListener("click", () => state.onSelect && state.onSelect(id));
    svg.appendChild(g);
  }
  for (const [id, n] of Object.entries(prompt)) {
    const b = boxes[id];
    b.rows.forEach((name, r) => {
      const v = n.inputs[name];
      if (!isLink(v) || !(String(v[0]) in boxes)) return;
      const s = boxes[String(v[0])];
      const x1 = s.x + s.w, y1 = s.y + HEAD + v[1] * ROW + 7;
      const x2 = b.x, y2 = b.y + HEAD + r * ROW + 7;
      const dx = Math.max(30, (x2 - x1) / 2);
      links.appendChild(el("path", { class: "link", d: `M${x1},${y1} C${x1 + dx},${y1} ${x2 - dx},${y2} ${x2},${y2}` }));
    });
  }
}

function control(spec, value, onInput) {
  let input;
  if (spec && spec.type === "BOOLEAN") {
    input = document.createElement("input");
    input.type = "checkbox";
    input.checked = Boolean(value);
    input.addEventListener("change", () => onInput(input.checked));
  } else if (spec && spec.options) {
    input = document.createElement("select");
    const opts = spec.options.includes(value) ? spec.options : [value, ...spec.options];
    for (const o of opts) {
      const op = document.createElement("option");
      op.value = o; op.textContent = o;
      if (!spec.options.includes(o)) op.textContent += " (missing)";
      input.appendChild(op);
    }
    input.value = value;
    input.addEventListener("change", () => onInput(input.value));
  } else if (spec && (spec.type === "INT" || spec.type === "FLOAT")) {
    input = document.createElement("input");
    input.type = "number";
    for (const k of ["min", "max", "step"]) {
      if (spec.opts[k] !== undefined && Math.abs(spec.opts[k]) < 1e15) input[k] = spec.opts[k];
    }
    if (spec.type === "FLOAT" && spec.opts.step === undefined) input.step = "any";
    if (spec.type === "INT" && spec.opts.step === undefined) input.step = 1;
    input.value = value;
    input.addEventListener("change", () => {
      const n = spec.type === "INT" ? parseInt(input.value, 10) : parseFloat(input.value);
      onInput(Number.isNaN(n) ? input.value : n);
    });
  } else if (spec && spec.opts && spec.opts.multiline) {
    input = document.createElement("textarea");
    input.value = value ?? "";
    input.addEventListener("change", () => onInput(input.value));
  } else {
    input = document.createElement("input");
    input.type = "text";
    input.value = typeof value === "string" ? value : JSON.stringify(value);
    input.addEventListener("change", () => {
      if (typeof value === "string") return onInput(input.value);
      try { onInput(JSON.parse(input.value)); } catch { onInput(input.value); }
    });
  }
  return input;
}

/** A card per node with its widgets; `onChange(id, name, value)` on every edit. errors: {id: [messages]}. */
export function renderForms(container, prompt, infos, { onChange, onSelect, errors = {}, selected = null } = {}) {
  container.replaceChildren();
  if (!prompt) return;
  for (const id of topoOrder(prompt)) {
    const n = prompt[id];
    const specs = Object.fromEntries(declared(infos[n.class_type]).map((d) => [d.name, d]));
    const card = document.createElement("div");
    card.className = "card" + (errors[id] ? " error" : "") + (selected === id ? " selected" : "");
    card.dataset.node = id;
    const h = document.createElement("h3");
    h.textContent = `#${id} ${title(prompt, id)} `;
    const small = document.createElement("small");
    small.textContent = (infos[n.class_type] || {}).display_name || n.class_type;
    h.appendChild(small);
    h.addEventListener("click", () => onSelect && onSelect(id));
    card.appendChild(h);
    const names = [...Object.keys(specs).filter((k) => k in (n.inputs || {})),
      ...Object.keys(n.inputs || {}).filter((k) => !(k in specs))];
    for (const name of names) {
      const v = n.inputs[name];
      if (isLink(v)) {
        const d = document.createElement("div");
        d.className = "link";
        const src = prompt[String(v[0])];
        d.textContent = `${name} \u2190 #${v[0]} ${src ? title(prompt, String(v[0])) : "(missing)"} [${v[1]}]`;
        card.appendChild(d);
        continue;
      }
      const label = document.createElement("label");
      const span = document.createElement("span");
      span.textContent = name;
      span.title = name;
      label.appendChild(span);
      const input = control(specs[name], v, (value) => onChange && onChange(id, name, value));
      input.name = `${id}.${name}`;
      label.appendChild(input);
      card.appendChild(label);
    }
    for (const msg of errors[id] || []) {
      const e = document.createElement("div");
      e.className = "err";
      e.textContent = msg;
      card.appendChild(e);
    }
    container.appendChild(card);
  }
}
