"""A plan's picture: one SVG drawing, made here in pure Python, for `vramgraph plan --svg`, the web page and
the ComfyUI panel (the server sends it with the plan; the browser inserts it and only marks the running step).
`timeline_data` gives the same plan as JSON numbers (the page's summary line reads it).

Top to bottom, every column one step of the plan:
- a title: the workflow, the card (or the budget) and the image size(s); a line of totals under it; a key;
- GPU memory after each step: stacked bars, one colour per model, activations on top, the budget line;
- one lane per model: on the GPU (filled), only its kept part on the GPU (the lower half filled: what a node
  that streamed it left there, graph/plan/residency.py), pinned copy in host RAM (thin bar), streamed from host RAM
  (outline), not loaded (grey line); a green triangle where it is loaded, a red one where it (or its kept part) is
  unloaded;
- the steps in order, under their columns: node id and class of each Run, "load" / "unload" of the others.

Labels never overlap, by construction: text widths are measured with DejaVu Sans's advance widths (the font
the SVG asks for first; the usual fallbacks are narrower), rows of text are at least a line apart, a column is
wider than a line of text is tall, step labels turn vertical when one does not fit across its column, and the
canvas grows to hold every label. Every element drawn for step i carries data-step="i"; the page marks the
running step ("current") and those not reached yet ("pending") through it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from html import escape
from typing import Any

from ..plan.planner import GiB, Load, Plan, Run, Unload
from ..plan.residency import part_of

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#bab0ac")
_ACTIVATION = "#e15759"
_LOAD, _UNLOAD = "#1f7a1f", "#c0392b"
FONT = "DejaVu Sans, Verdana, Geneva, sans-serif"

# advance widths of DejaVu Sans (Book, Bold) for the characters 32..126, in hundredths of an em
_REGULAR = (32, 40, 46, 84, 64, 95, 78, 27, 39, 39, 50, 84, 32, 36, 32, 34, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64,
            34, 34, 84, 84, 84, 53, 100, 68, 69, 70, 77, 63, 58, 77, 75, 29, 29, 66, 56, 86, 75, 79, 60, 79, 69, 63,
            61, 73, 68, 99, 69, 61, 69, 39, 34, 39, 84, 50, 50, 61, 63, 55, 63, 62, 35, 63, 63, 28, 28, 58, 28, 97,
            63, 61, 63, 63, 41, 52, 39, 63, 59, 82, 59, 59, 52, 64, 34, 64, 84)
_BOLD = (35, 46, 52, 84, 70, 100, 87, 31, 46, 46, 52, 84, 38, 42, 38, 37, 70, 70, 70, 70, 70, 70, 70, 70, 70, 70, 40,
         40, 84, 84, 84, 58, 100, 77, 76, 73, 83, 68, 68, 82, 84, 37, 37, 77, 64, 100, 84, 85, 73, 85, 77, 72, 68, 81,
         77, 110, 77, 72, 73, 46, 37, 46, 84, 50, 50, 67, 72, 59, 72, 68, 44, 72, 71, 34, 34, 67, 34, 104, 71, 69, 72,
         72, 49, 60, 48, 71, 65, 92, 65, 65, 58, 71, 37, 71, 84)
_OTHER = {"×": 84, "·": 38, "−": 84, "²": 44, "…": 100, "–": 50, "—": 100}  # the widest of the two weights
SLACK = 1.04  # widths are taken 4 % wider than measured
ASCENT, DESCENT = 0.93, 0.24  # of the em, above and below the baseline (DejaVu Sans; browsers' text boxes use them)

FS, FS_TITLE = 11, 15  # font sizes of labels and of the title
PAD, GAP = 12, 6  # canvas margin, gap between a label and what it labels
PLOT_H = 170  # height of the memory chart
LANE_H, LANE_GAP = 18, 4
COL_MIN, COL_MAX, COL_WIDE = 20, 44, 150  # column widths: vertical labels between MIN and MAX, horizontal up to WIDE
PLOT_W = 900  # the width the columns aim to fill


def text_width(text: str, size: float, bold: bool = False) -> float:
    """Estimated width in px of `text` at font size `size` (an upper bound for DejaVu Sans and narrower fonts)."""
    table = _BOLD if bold else _REGULAR
    em = sum(table[o - 32] if 32 <= (o := ord(c)) < 127 else _OTHER.get(c, 100) for c in text)
    return em * size / 100 * SLACK


def _lane(key: str) -> str:
    """The model whose lane and band a key is drawn in: a kept part in its model's."""
    return part_of(key) or key


def _model_order(plan: Plan) -> list[str]:
    """Models in order of first appearance (resident at the start, then loaded or streamed); stacking order."""
    seen = dict.fromkeys(_lane(m) for m in sorted(plan.start.gpu))
    for s in plan.steps:
        seen.update(dict.fromkeys(_lane(m) for m in s.resident))
        seen.update(dict.fromkeys(s.streams))
    return [m for m in seen if m in plan.models]


def _on_gpu(plan: Plan, s: Any) -> dict[str, int]:
    """GPU bytes of each model after step s, a kept part counted in its model's."""
    out: dict[str, int] = {}
    for m in s.resident:
        out[_lane(m)] = out.get(_lane(m), 0) + plan.models[m].nbytes
    return out


def timeline_data(plan: Plan) -> dict[str, Any]:
    """Per step: the label, the bytes of each resident model, the activation bytes; plus budget and models."""
    steps = []
    for i, s in enumerate(plan.steps):
        name, what, how = plan.describe(s)
        per_model = _on_gpu(plan, s)
        steps.append({
            "index": i,
            "kind": s.step.kind,
            "label": f"{name} {what} [{how}]",
            "models": per_model,
            "activation": s.gpu_bytes - sum(per_model.values()) if isinstance(s.step, Run) else 0,
            "gpu_bytes": s.gpu_bytes,
            "seconds": s.seconds,
            "note": s.note,
            **({"blocks": s.blocks.to_json(), "streaming": s.blocks.describe(plan.label(s.blocks.model))}
               if s.blocks is not None else {}),
        })
    return {
        "budget": plan.budget.gpu,
        "peak": plan.peak,
        "models": {**{m: {"label": plan.label(m), "nbytes": plan.models[m].nbytes} for m in _model_order(plan)},
                   **{m: {"label": plan.label(m), "nbytes": plan.models[m].nbytes, "part_of": part_of(m)}
                      for m in plan.models if part_of(m)}},  # (kept parts, for the names of their unloads)
        "steps": steps,
        "streamed_bytes": plan.streamed_bytes,
    }


# ------------------------------------------------------------------------------------------- words


def size_text(nbytes: float) -> str:
    """'11.75 GiB', '86.0 MiB', '12 KiB'."""
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.0f} KiB"


def card_text(nbytes: int) -> str:
    """A card size as people say it: '12 GiB', '11.5 GiB', '768 MiB'."""
    for unit, name in ((GiB, "GiB"), (2**20, "MiB")):
        if nbytes >= unit:
            return f"{nbytes / unit:.2f}".rstrip("0").rstrip(".") + f" {name}"
    return f"{nbytes} bytes"


def _literal(prompt: Mapping[str, Any], v: Any) -> Any:
    """An input's value, following a link to a primitive node's "value"."""
    if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str):
        src = prompt.get(v[0])
        return src.get("inputs", {}).get("value") if isinstance(src, dict) else None
    return v


def image_sizes(prompt: Mapping[str, Any] | None) -> str:
    """'1024×1024', '8 images, 1024×1024', '2 images, 512×512 and 1024×768': the empty latents' sizes and the number
    of saved or previewed images of an API-format prompt ('' when it has no empty latent)."""
    if not prompt:
        return ""
    sizes: Counter[str] = Counter()
    outputs = 0
    for spec in prompt.values():
        if not isinstance(spec, dict):
            continue
        cls, inputs = str(spec.get("class_type", "")), spec.get("inputs", {})
        if "SaveImage" in cls or "PreviewImage" in cls:
            outputs += 1
        if "Empty" in cls and "Latent" in cls:
            w, h = _literal(prompt, inputs.get("width")), _literal(prompt, inputs.get("height"))
            if isinstance(w, int) and isinstance(h, int):
                sizes[f"{w}×{h}"] += 1
    if not sizes:
        return ""
    names = list(sizes)
    text = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{outputs} images, {text}" if outputs > 1 else text


def _step_label(plan: Plan, i: int) -> tuple[str, str]:
    """(text, colour) of step i's label: 'node class [variant]' for a Run, 'load' / 'unload' for the others."""
    st = plan.steps[i].step
    if isinstance(st, Load):
        return "load", _LOAD
    if isinstance(st, Unload):
        return "unload", _UNLOAD
    cls = plan.classes.get(st.node, "")
    text = f"{st.node} {cls}" if cls else st.node
    blocks = plan.steps[i].blocks
    if blocks is not None:  # e.g. '6 VGSampler [stream 11/25]': the blocks the plan keeps on the GPU for it
        text += f" [{st.variant} {len(blocks.resident)}/{blocks.n}]"
    elif st.variant not in ("gpu", "host"):
        text += f" [{st.variant}]"
    return text, {"host": "#777", "cpu": "#b35c00"}.get(st.variant, "#222")  # grey: no GPU; orange: the CPU fallback


def _wrap(pieces: list[str], size: float, width: float, bold: bool = False) -> list[str]:
    """Greedy lines of pieces joined by ' · ', each at most `width` wide unless one piece alone is wider."""
    lines: list[str] = []
    for p in pieces:
        if lines and text_width(f"{lines[-1]} · {p}", size, bold) <= width:
            lines[-1] = f"{lines[-1]} · {p}"
        else:
            lines.append(p)
    return lines


def _nice_step(top: float, max_ticks: int) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that puts at most max_ticks intervals below `top`."""
    k = math.floor(math.log10(max(top, 1e-9) / max_ticks))
    while True:
        for m in (1, 2, 2.5, 5):
            step = m * 10**k
            if top / step <= max_ticks:
                return step
        k += 1


def _num(v: float, step: float) -> str:
    decimals = next((d for d in range(9) if abs(step * 10**d - round(step * 10**d)) < 1e-6), 9)
    return f"{v:.{decimals}f}"


# ------------------------------------------------------------------------------------------- drawing


def _text(x: float, y: float, s: str, size: float = FS, anchor: str = "start", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
            f"{escape(s, quote=False)}</text>")


def _key_symbol(kind: str, x: float, y: float) -> str:
    """A 14x10 symbol of the key with its top-left corner at (x, y)."""
    if kind == "gpu":
        return f'<rect x="{x}" y="{y}" width="14" height="10" fill="#888"/>'
    if kind == "host":
        return f'<rect x="{x}" y="{y + 3}" width="14" height="4" fill="#888" fill-opacity="0.5"/>'
    if kind == "kept":
        return f'<rect x="{x}" y="{y + 5}" width="14" height="5" fill="#888"/>'
    if kind == "stream":
        return (f'<rect x="{x + 0.5}" y="{y + 0.5}" width="13" height="9" fill="white" stroke="#888" '
                'stroke-dasharray="3 2"/>')
    if kind == "activation":
        return f'<rect x="{x}" y="{y}" width="14" height="10" fill="{_ACTIVATION}" fill-opacity="0.75"/>'
    if kind == "budget":
        return f'<line x1="{x}" x2="{x + 14}" y1="{y + 5}" y2="{y + 5}" stroke="black" stroke-dasharray="4 2"/>'
    return _triangle(kind == "load", x + 7, y + 5)


def _triangle(up: bool, cx: float, cy: float) -> str:
    d = 1 if up else -1  # up: the point at the top
    pts = ((cx - 5, cy + 4 * d), (cx + 5, cy + 4 * d), (cx, cy - 5 * d))
    return (f'<polygon points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in pts)}" fill="{_LOAD if up else _UNLOAD}" '
            'stroke="white" stroke-width="1"/>')


_STYLE = ("<style>.vg-timeline rect.col.current{fill:#ffe08a}.vg-timeline .pending{opacity:.35}"
          ".vg-timeline text.current{fill:#8a5a00}</style>")


class _Layout:
    """Where everything of one plan's picture goes: the columns, the memory scale, the widths, and (once the heading
    is drawn, `place`) the heights of the plot, the lanes and the step labels."""

    def __init__(self, plan: Plan, title: str, card: int | None, prompt: Mapping[str, Any] | None) -> None:
        self.n = n = len(plan.steps)
        self.order = order = _model_order(plan)
        self.colour: dict[str, str] = {}
        for m in order:  # one colour per label: two keys with one label share it
            self.colour.setdefault(plan.label(m), _PALETTE[len(self.colour) % len(_PALETTE)])
        seen: Counter[str] = Counter()
        self.lane_names = []
        for m in order:
            seen[plan.label(m)] += 1
            k = seen[plan.label(m)]
            self.lane_names.append(f"{plan.label(m)}{f' ({k})' if k > 1 else ''} · {size_text(plan.models[m].nbytes)}")
        self._columns(plan)
        self._scale(plan)
        # widths: the left column holds the lane labels, the axis and the "steps" caption
        self.left = math.ceil(max(PAD + 14 + 4 + max((text_width(t, FS) for t in self.lane_names), default=0) + GAP,
                                  PAD + self.line_h + GAP + self.tick_w + 4 + GAP,
                                  PAD + text_width("steps", FS) + GAP, 80))
        self.plot_w = self.col * max(n, 1)
        width = self.left + self.plot_w + math.ceil(GAP + text_width(self.budget_label, FS) + PAD)
        self._heading(plan, title, card, prompt)
        self.width = math.ceil(max(width, 2 * PAD + max(text_width(p, FS_TITLE, True) for p in self.heading),
                                   2 * PAD + max(text_width(p, FS) for p in self.totals), 2 * PAD + max(self.key_w)))
        self.inner = self.width - 2 * PAD

    def _columns(self, plan: Plan) -> None:
        """One column per step, wide enough for its label written across, or narrow with the label turned."""
        self.labels = [_step_label(plan, i) for i in range(self.n)]
        self.label_w = max((text_width(t, FS) for t, _ in self.labels), default=0.0)
        self.line_h = (ASCENT + DESCENT) * FS
        self.horizontal = (self.n * (self.label_w + 2 * GAP) <= PLOT_W and self.label_w + 2 * GAP <= COL_WIDE)
        if self.horizontal:
            self.col = max(COL_MIN, math.ceil(self.label_w + 2 * GAP))
        else:
            self.col = max(COL_MIN, min(COL_MAX, PLOT_W // max(self.n, 1)), math.ceil(self.line_h + 4))

    def _scale(self, plan: Plan) -> None:
        """The memory scale: up to the budget, or zoomed in on the peak when it is under a quarter of it."""
        self.budget, self.peak = budget, peak = plan.budget.gpu, plan.peak
        self.zoomed = 0 < peak < budget / 4
        self.top_bytes = top = peak * 1.15 if self.zoomed else max(budget, peak, 1) * 1.05
        self.unit, unit_name = next(((u, nm) for u, nm in ((GiB, "GiB"), (2**20, "MiB")) if top >= 2 * u),
                                    (1024, "KiB"))
        self.step = _nice_step(top / self.unit, PLOT_H // 24)
        self.ticks = [k * self.step for k in range(int(top / self.unit / self.step + 1e-9) + 1)]
        self.tick_w = max(text_width(_num(t, self.step), FS) for t in self.ticks)
        self.axis_title = f"GPU memory ({unit_name})"
        self.plot_h = max(PLOT_H, math.ceil(text_width(self.axis_title, FS)) + 10)
        self.budget_label = f"budget {size_text(budget)}" + (" (above this scale)" if self.zoomed else "")

    def _heading(self, plan: Plan, title: str, card: int | None, prompt: Mapping[str, Any] | None) -> None:
        """The title line, the totals line and the key's entries."""
        budget = self.budget
        self.heading = [p for p in (title.removesuffix(".json"), f"{card_text(card)} card" if card else
                                    f"{size_text(budget)} budget", image_sizes(prompt)) if p]
        unloads = sum(1 for s in plan.steps if isinstance(s.step, Unload))
        self.totals = [f"budget {size_text(budget)}", f"peak {size_text(self.peak)}",
                       f"{plan.loads} loads ({size_text(plan.bytes_moved)} moved), {unloads} unloads",
                       *([f"{size_text(plan.streamed_bytes)} streamed"] if plan.streamed_bytes else []),
                       f"{plan.seconds:.2f} s predicted"]
        self.key = [("gpu", "on the GPU"), ("host", "pinned copy in host RAM")]
        if any(s.streams for s in plan.steps):
            self.key.append(("stream", "streamed from host RAM"))
        if any(part_of(m) for s in plan.steps for m in s.resident):
            self.key.append(("kept", "its kept part on the GPU"))
        self.key += [("load", "load"), ("unload", "unload"), ("activation", "activations"), ("budget", "budget")]
        self.key_w = [14 + 4 + text_width(t, FS) for _, t in self.key]

    def place(self, y: float) -> None:
        """The vertical layout below the heading, which ends at `y`."""
        self.top = y + FS  # room for the top tick's label and the budget label above the plot
        self.bottom = self.top + self.plot_h
        self.lanes_top = self.bottom + FS + 4
        self.labels_top = self.lanes_top + len(self.order) * (LANE_H + LANE_GAP) + 4
        self.labels_h = self.line_h if self.horizontal else self.label_w
        self.height = math.ceil(self.labels_top + self.labels_h + PAD)

    def ypx(self, nbytes: float) -> float:
        return self.bottom - self.plot_h * nbytes / self.top_bytes

    def cx(self, i: int) -> float:
        return self.left + i * self.col + self.col / 2


def timeline_svg(plan: Plan, title: str = "", *, card: int | None = None, prompt: Mapping[str, Any] | None = None
                 ) -> str:
    """The plan's picture as an SVG document (see the module docstring).

    `title`: the workflow's name; `card`: the card size the budget was made for (--vram), if any; `prompt`: the
    API-format prompt planned, for the image sizes in the title.
    """
    lay = _Layout(plan, title, card, prompt)
    out: list[str] = []
    lay.place(_draw_heading(lay, out))
    held = [_on_gpu(plan, s) for s in plan.steps]
    out.insert(0, _draw_columns(plan, lay))
    out += _draw_axis(lay)
    out += _draw_bars(plan, lay, held)
    out += _draw_lanes(plan, lay, held)
    out += _draw_step_labels(lay)
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="vg-timeline" width="{lay.width}" height="{lay.height}" '
            f'viewBox="0 0 {lay.width} {lay.height}" font-family="{FONT}" font-size="{FS}" fill="#222">{_STYLE}'
            f'<rect class="background" width="{lay.width}" height="{lay.height}" fill="white"/>')
    return "\n".join([head, *out, "</svg>"])


def _draw_heading(lay: _Layout, out: list[str]) -> float:
    """The title, the totals and the key, in rows; returns where they end."""
    y = PAD
    for line in _wrap(lay.heading, FS_TITLE, lay.inner, True):
        out.append(_text(PAD, y + ASCENT * FS_TITLE, line, FS_TITLE, extra=' font-weight="bold" class="title"'))
        y += 1.3 * FS_TITLE
    for line in _wrap(lay.totals, FS, lay.inner):
        out.append(_text(PAD, y + ASCENT * FS, line, extra=' fill="#444" class="totals"'))
        y += 1.3 * FS
    y += 4
    x = PAD
    for (kind, text), w in zip(lay.key, lay.key_w, strict=True):
        if x > PAD and x + w > PAD + lay.inner:
            x, y = PAD, y + 18
        out.append(f'<g class="key {kind}">{_key_symbol(kind, x, y + 3)}{_text(x + 18, y + 3 + 5 + 0.35 * FS, text)}'
                   "</g>")
        x += w + 16
    return y + 18 + 10


def _draw_columns(plan: Plan, lay: _Layout) -> str:
    """Step columns: tinted for loads and unloads, striped otherwise; the page colours the running one."""
    cols = []
    for i, s in enumerate(plan.steps):
        fill = {"load": "#e8f4e8", "unload": "#fae8e6"}.get(s.step.kind, "#f4f5f7" if i % 2 else "#ffffff")
        name, what, how = plan.describe(s)
        tip = f"{i + 1}. {name} {what} [{how}]: {size_text(s.gpu_bytes)} on the GPU" + (f"; {s.note}" if s.note else "")
        cols.append(f'<rect class="col {s.step.kind}" id="vg-step-{i}" data-step="{i}" x="{lay.left + i * lay.col}" '
                    f'y="{lay.top}" width="{lay.col}" height="{lay.labels_top + lay.labels_h - lay.top:.1f}" '
                    f'fill="{fill}"><title>{escape(tip, quote=False)}</title></rect>')
    return f'<g class="columns">{"".join(cols)}</g>'


def _draw_axis(lay: _Layout) -> list[str]:
    """The y axis: grid lines, tick labels and the axis title."""
    out = []
    for t in lay.ticks:
        ty = lay.ypx(t * lay.unit)
        out.append(f'<line x1="{lay.left - 4}" x2="{lay.left + lay.plot_w}" y1="{ty:.1f}" y2="{ty:.1f}" stroke="#000" '
                   f'stroke-opacity="{0.6 if t == 0 else 0.08}"/>')
        out.append(_text(lay.left - 4 - GAP, ty + 0.35 * FS, _num(t, lay.step), anchor="end", extra=' class="tick"'))
    ay, ax = (lay.top + lay.bottom) / 2, PAD + ASCENT * FS
    out.append(_text(ax, ay, lay.axis_title, anchor="middle",
                     extra=f' transform="rotate(-90 {ax:.1f} {ay:.1f})" class="axis"'))
    return out


def _draw_bars(plan: Plan, lay: _Layout, held: list[dict[str, int]]) -> list[str]:
    """Stacked bars, one group per model, then the activations and the budget line."""
    out = []
    base = [0] * lay.n
    for m in lay.order:
        rects = []
        for i in range(lay.n):
            if m in held[i]:
                nb = held[i][m]
                y0, y1 = lay.ypx(base[i] + nb), lay.ypx(base[i])
                rects.append(f'<rect data-step="{i}" x="{lay.left + i * lay.col + 2}" y="{min(y0, y1 - 1):.1f}" '
                             f'width="{lay.col - 4}" height="{max(1.0, y1 - y0):.1f}"/>')
                base[i] += nb
        out.append(f'<g class="band" data-model="{escape(m)}" fill="{lay.colour[plan.label(m)]}">{"".join(rects)}</g>')
    acts = []
    for i, s in enumerate(plan.steps):
        act = s.gpu_bytes - base[i] if isinstance(s.step, Run) else 0
        if act > 0:
            y0, y1 = lay.ypx(base[i] + act), lay.ypx(base[i])
            acts.append(f'<rect data-step="{i}" x="{lay.left + i * lay.col + 2}" y="{min(y0, y1 - 1):.1f}" '
                        f'width="{lay.col - 4}" height="{max(1.0, y1 - y0):.1f}"/>')
    out.append(f'<g class="activation" fill="{_ACTIVATION}" fill-opacity="0.75">{"".join(acts)}</g>')
    by = lay.top if lay.zoomed else lay.ypx(lay.budget)
    out.append(f'<line class="budget" x1="{lay.left}" x2="{lay.left + lay.plot_w}" y1="{by:.1f}" y2="{by:.1f}" '
               'stroke="black" stroke-width="1.5" stroke-dasharray="6 3"/>')
    out.append(_text(lay.left + lay.plot_w + GAP, by + 0.35 * FS, lay.budget_label, extra=' class="budget-label"'))
    return out


def _lane_states(plan: Plan, order: list[str], held: list[dict[str, int]]) -> list[list[str]]:
    """Per model, per step: on the GPU, its kept part, streamed, a pinned host copy, or nothing."""
    pinned = set(plan.start.pinned)
    states: list[list[str]] = [[] for _ in order]
    for i, s in enumerate(plan.steps):
        if isinstance(s.step, Load) and s.step.pin:
            pinned.add(s.step.model)
        pinned.update(s.streams)
        for k, m in enumerate(order):
            states[k].append("gpu" if m in s.resident else "kept" if m in held[i] else
                             "stream" if m in s.streams else "host" if m in pinned else "none")
    return states


def _lane_cell(state: str, i: int, x0: float, ly: float, col: int, c: str) -> str | None:
    """One step's cell of a model's lane."""
    if state == "gpu":
        return f'<rect data-step="{i}" x="{x0}" y="{ly + 1}" width="{col}" height="{LANE_H - 2}" fill="{c}"/>'
    if state == "kept":
        return (f'<rect data-step="{i}" x="{x0}" y="{ly + LANE_H / 2}" width="{col}" height="{LANE_H / 2 - 1}" '
                f'fill="{c}"/>')
    if state == "host":
        return (f'<rect data-step="{i}" x="{x0}" y="{ly + LANE_H / 2 - 2}" width="{col}" height="4" '
                f'fill="{c}" fill-opacity="0.5"/>')
    if state == "stream":
        return (f'<rect data-step="{i}" x="{x0 + 1.5}" y="{ly + 1.5}" width="{col - 3}" height="{LANE_H - 3}" '
                f'fill="white" stroke="{c}" stroke-width="1.5" stroke-dasharray="3 2"/>')
    return None


def _draw_lanes(plan: Plan, lay: _Layout, held: list[dict[str, int]]) -> list[str]:
    """One lane per model, its label, and the load and unload marks."""
    out = []
    for k, (m, states) in enumerate(zip(lay.order, _lane_states(plan, lay.order, held), strict=True)):
        ly = lay.lanes_top + k * (LANE_H + LANE_GAP)
        c = lay.colour[plan.label(m)]
        cells = [f'<rect x="{lay.left}" y="{ly + LANE_H / 2 - 0.5}" width="{lay.plot_w}" height="1" fill="#c8c8c8"/>']
        cells += [cell for i, st in enumerate(states)
                  if (cell := _lane_cell(st, i, lay.left + i * lay.col, ly, lay.col, c)) is not None]
        out.append(f'<g class="lane" id="vg-lane-{k}" data-model="{escape(m)}">{"".join(cells)}</g>')
        out.append(f'<rect x="{PAD}" y="{ly + LANE_H / 2 - 5}" width="14" height="10" fill="{c}"/>')
        out.append(_text(PAD + 18, ly + LANE_H / 2 + 0.35 * FS, lay.lane_names[k], extra=' class="lane-label"'))
    for i, s in enumerate(plan.steps):  # load and unload marks
        if isinstance(s.step, (Load, Unload)) and _lane(s.step.model) in lay.order:
            ly = lay.lanes_top + lay.order.index(_lane(s.step.model)) * (LANE_H + LANE_GAP)
            out.append(f'<g class="mark {s.step.kind}" data-step="{i}" data-model="{escape(s.step.model)}">'
                       f"{_triangle(isinstance(s.step, Load), lay.cx(i), ly + LANE_H / 2)}</g>")
    return out


def _draw_step_labels(lay: _Layout) -> list[str]:
    """The step labels under the lanes: across the columns, or turned where the columns are narrow."""
    out = [_text(lay.left - GAP, lay.labels_top + ASCENT * FS, "steps", anchor="end", extra=' fill="#777"')]
    for i, (text, fill) in enumerate(lay.labels):
        attrs = f' fill="{fill}" class="step" id="vg-label-{i}" data-step="{i}"'
        if lay.horizontal:
            out.append(_text(lay.cx(i), lay.labels_top + ASCENT * FS, text, anchor="middle", extra=attrs))
        else:
            px = lay.cx(i) + (ASCENT - DESCENT) / 2 * FS
            out.append(_text(px, lay.labels_top, text, anchor="end",
                             extra=f'{attrs} transform="rotate(-90 {px:.1f} {lay.labels_top:.1f})"'))
    return out
