"""A plan's GPU memory over its steps: as JSON numbers (for the web page) and as a standalone SVG.

x = steps; stacked bands of GPU memory, one per model (coloured by label), plus an activation band on Run
steps; a horizontal line at the budget; marks at Load (+) and Unload (-) steps. No dependencies.
"""

from __future__ import annotations

from html import escape
from typing import Any

from .planner import GiB, Load, Plan, Run, Unload

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#bab0ac")
_ACTIVATION = "#e15759"


def _model_order(plan: Plan) -> list[str]:
    """Models in order of first appearance (resident at the start, then loaded); stacking order."""
    seen = dict.fromkeys(sorted(plan.start.gpu))
    for s in plan.steps:
        seen.update(dict.fromkeys(s.resident))
    return list(seen)


def timeline_data(plan: Plan) -> dict[str, Any]:
    """Per step: the label, the bytes of each resident model, the activation bytes; plus budget and models."""
    steps = []
    for i, s in enumerate(plan.steps):
        name, what, how = plan.describe(s)
        per_model = {m: plan.models[m].nbytes for m in s.resident}
        steps.append({
            "index": i,
            "kind": s.step.kind,
            "label": f"{name} {what} [{how}]",
            "models": per_model,
            "activation": s.gpu_bytes - sum(per_model.values()) if isinstance(s.step, Run) else 0,
            "gpu_bytes": s.gpu_bytes,
            "seconds": s.seconds,
            "note": s.note,
        })
    return {
        "budget": plan.budget.gpu,
        "peak": plan.peak,
        "models": {m: {"label": plan.label(m), "nbytes": plan.models[m].nbytes} for m in _model_order(plan)},
        "steps": steps,
    }


def timeline_svg(plan: Plan, title: str = "") -> str:
    """An SVG document of the plan's GPU memory per step (see the module docstring)."""
    data = timeline_data(plan)
    steps = data["steps"]
    order = _model_order(plan)
    colour: dict[str, str] = {}
    for m in order:  # one colour per label: two keys with one label share it
        colour.setdefault(plan.label(m), _PALETTE[len(colour) % len(_PALETTE)])

    col, left, top, plot_h, bottom = 56, 64, 40, 260, 110
    width = left + col * max(len(steps), 1) + 170
    height = top + plot_h + bottom
    scale = max(plan.budget.gpu, plan.peak, 1) * 1.08
    def y(nbytes: float) -> float:
        return top + plot_h - plot_h * nbytes / scale

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    if title:
        out.append(f'<text x="{left}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>')
    for k in range(0, int(scale / GiB) + 1, max(1, int(scale / GiB / 8))):  # y axis, GiB
        out.append(f'<line x1="{left - 4}" x2="{left}" y1="{y(k * GiB):.1f}" y2="{y(k * GiB):.1f}" stroke="#444"/>'
                   f'<text x="{left - 8}" y="{y(k * GiB) + 4:.1f}" text-anchor="end">{k}</text>')
    out.append(f'<text x="14" y="{top + plot_h / 2}" transform="rotate(-90 14 {top + plot_h / 2})" '
               'text-anchor="middle">GPU GiB</text>')

    base = [0] * len(steps)  # stacked bands: one <g class="band"> per model, one rect per step it is resident
    for m in order:
        rects = []
        for i, st in enumerate(steps):
            nb = st["models"].get(m, 0)
            if nb:
                rects.append(f'<rect x="{left + i * col + 4}" y="{y(base[i] + nb):.1f}" width="{col - 8}" '
                             f'height="{y(base[i]) - y(base[i] + nb):.1f}"/>')
                base[i] += nb
        out.append(f'<g class="band" data-model="{escape(m)}" fill="{colour[plan.label(m)]}">'
                   f'<title>{escape(plan.label(m))}: {plan.models[m].nbytes / GiB:.2f} GiB</title>{"".join(rects)}</g>')
    acts = [f'<rect x="{left + i * col + 4}" y="{y(base[i] + st["activation"]):.1f}" width="{col - 8}" '
            f'height="{y(base[i]) - y(base[i] + st["activation"]):.1f}"/>'
            for i, st in enumerate(steps) if st["activation"]]
    out.append(f'<g class="activation" fill="{_ACTIVATION}" fill-opacity="0.7"><title>activations</title>'
               f'{"".join(acts)}</g>')

    by = y(plan.budget.gpu)
    out.append(f'<line class="budget" x1="{left}" x2="{left + col * len(steps)}" y1="{by:.1f}" y2="{by:.1f}" '
               f'stroke="black" stroke-dasharray="6 3"/><text x="{left + col * len(steps) + 4}" y="{by + 4:.1f}">'
               f'budget {plan.budget.gpu / GiB:.2f} GiB</text>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}" stroke="#444"/>'
               f'<line x1="{left}" x2="{left + col * len(steps)}" y1="{top + plot_h}" y2="{top + plot_h}" '
               'stroke="#444"/>')

    for i, (s, st) in enumerate(zip(plan.steps, steps, strict=True)):  # step labels and load/unload marks
        cx = left + i * col + col / 2
        if isinstance(s.step, (Load, Unload)):
            load = isinstance(s.step, Load)
            sign, fill = ("+", "#2a7a2a") if load else ("\u2212", "#b22222")
            out.append(f'<g class="mark {s.step.kind}"><line x1="{cx:.1f}" x2="{cx:.1f}" y1="{top}" '
                       f'y2="{top + plot_h}" stroke="{fill}" stroke-dasharray="2 2"/><text x="{cx:.1f}" '
                       f'y="{top - 4}" text-anchor="middle" fill="{fill}">{sign}{escape(plan.label(s.step.model))}'
                       '</text></g>')
        short = s.step.node if isinstance(s.step, Run) else s.step.kind
        ly = top + plot_h + 14
        out.append(f'<text x="{cx:.1f}" y="{ly}" text-anchor="end" transform="rotate(-50 {cx:.1f} {ly})">'
                   f'<title>{escape(st["label"])}</title>{i + 1} {escape(short)}</text>')

    lx = left + col * len(steps) + 12  # legend
    for k, (label, c) in enumerate([*colour.items(), ("activation", _ACTIVATION)]):
        ly = top + 24 + 16 * k
        out.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{lx + 14}" y="{ly}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out)
