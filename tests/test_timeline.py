"""The plan's picture (graph/draw/timeline.py): one SVG for `vramgraph plan --svg`, the web page and the ComfyUI panel.

Every check reads the SVG back with xml.etree: each text element's box (from x, y, font-size, anchor, rotation and
the estimated width) overlaps no other text's box and lies inside the viewBox; the title names the card and the
image size; there is one lane per model. Sizes are FLUX.2-klein-4B's (as in test_planner.py).
"""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path
from xml.etree import ElementTree

import networkx as nx
import pytest
from vramgraph.cli import main
from vramgraph.graph.draw.timeline import ASCENT, DESCENT, LANE_H, image_sizes, text_width, timeline_svg
from vramgraph.graph.plan.planner import Budget, GiB, Load, ModelCost, NodeCost, Plan, Residency, Run, Unload, plan
from vramgraph.graph.workflow.queue import merge
from vramgraph.nodes.types import Variant

ROOT = Path(__file__).resolve().parents[1]
NS = "{http://www.w3.org/2000/svg}"
MiB = 2**20
MODELS = {k: ModelCost(k, round(w * GiB), label) for k, w, label in
          (("te", 5.80, "text encoder"), ("dit", 7.22, "transformer"), ("vae", 0.09, "vae"))}


# ------------------------------------------------------------------------------------------- reading an SVG


def text_boxes(svg: str) -> list[tuple[str, tuple[float, float, float, float]]]:
    """(text, (x0, y0, x1, y1)) of every <text>, in document order. Only rotate(-90 cx cy) is understood (the
    drawing uses no other transform on text); anything else fails the test."""
    root = ElementTree.fromstring(svg)
    default = float(root.get("font-size", "16"))
    out = []
    for t in root.iter(f"{NS}text"):
        s = "".join(t.itertext())
        size = float(t.get("font-size", default))
        w = text_width(s, size, t.get("font-weight") == "bold")
        x, y = float(t.get("x", "0")), float(t.get("y", "0"))
        x0 = x - {"start": 0.0, "middle": w / 2, "end": w}[t.get("text-anchor", "start")]
        box = (x0, y - ASCENT * size, x0 + w, y + DESCENT * size)
        if t.get("transform"):
            m = re.fullmatch(r"rotate\(-90 ([-\d.]+) ([-\d.]+)\)", t.get("transform", ""))
            assert m, f"unexpected transform {t.get('transform')!r} on {s!r}"
            cx, cy = float(m.group(1)), float(m.group(2))
            pts = [(cx + (py - cy), cy - (px - cx)) for px in (box[0], box[2]) for py in (box[1], box[3])]
            box = (min(p[0] for p in pts), min(p[1] for p in pts), max(p[0] for p in pts), max(p[1] for p in pts))
        out.append((s, box))
    return out


def overlapping(boxes: list[tuple[str, tuple[float, float, float, float]]]) -> list[tuple[str, str]]:
    """Pairs of texts whose boxes overlap."""
    bad = []
    for i, (a, (ax0, ay0, ax1, ay1)) in enumerate(boxes):
        for b, (bx0, by0, bx1, by1) in boxes[i + 1:]:
            if ax0 < bx1 and bx0 < ax1 and ay0 < by1 and by0 < ay1:
                bad.append((a, b))
    return bad


def check_readable(svg: str) -> ElementTree.Element:
    """No two labels overlap and none leaves the viewBox; returns the parsed root."""
    root = ElementTree.fromstring(svg)
    x0, y0, w, h = (float(v) for v in root.get("viewBox", "").split())
    assert (w, h) == (float(root.get("width", "0")), float(root.get("height", "0")))
    boxes = text_boxes(svg)
    assert boxes
    assert overlapping(boxes) == []
    outside = [(s, b) for s, b in boxes if b[0] < x0 or b[1] < y0 or b[2] > x0 + w or b[3] > y0 + h]
    assert outside == []
    return root


def title(root: ElementTree.Element) -> str:
    return " ".join("".join(t.itertext()) for t in root.iter(f"{NS}text") if t.get("class") == "title")


def lanes(root: ElementTree.Element) -> list[str]:
    return [g.get("data-model", "") for g in root.iter(f"{NS}g") if g.get("class") == "lane"]


def lane_labels(root: ElementTree.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{NS}text") if t.get("class") == "lane-label"]


def step_labels(root: ElementTree.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{NS}text") if t.get("class") == "step"]


def marks(root: ElementTree.Element, kind: str) -> list[tuple[int, str]]:
    return [(int(g.get("data-step", "-1")), g.get("data-model", "")) for g in root.iter(f"{NS}g")
            if g.get("class") == f"mark {kind}"]


# ------------------------------------------------------------------------------------------- plans


def chains(n: int, side: int = 1024) -> tuple[nx.DiGraph, dict[str, NodeCost]]:
    """n prompts, each load ──► enc ──► sample ──► decode ──► save (the loader and the saver run on the host)."""
    act = {1024: (0.2, 0.57, 2.38), 1536: (0.2, 1.2, 5.35), 2048: (0.2, 2.3, 9.5)}[side]
    host = (Variant("host", (), 0, 0.0),)
    dag, costs = nx.DiGraph(), {}
    for i in range(n):
        ids = [f"q{i}:{k}" for k in ("1", "4", "6", "7", "8")]
        nx.add_path(dag, ids)
        costs[ids[0]] = NodeCost(ids[0], "VGEmptyLatent", host)
        costs[ids[1]] = NodeCost(ids[1], "VGTextEncode", (Variant("gpu", ("te",), round(act[0] * GiB), 0.033),),
                                 host_bytes=8 * MiB)
        costs[ids[2]] = NodeCost(ids[2], "VGSampler", (Variant("gpu", ("dit",), round(act[1] * GiB), 0.33),),
                                 host_bytes=MiB)
        costs[ids[3]] = NodeCost(ids[3], "VGVAEDecode", (Variant("gpu", ("vae",), round(act[2] * GiB), 0.09),
                                                         Variant("tiled", ("vae",), GiB // 2, 0.4, "in tiles")),
                                 host_bytes=12 * MiB)
        costs[ids[4]] = NodeCost(ids[4], "VGSaveImage", host)
    return dag, costs


def dense_plan() -> Plan:
    """A queue of 8 prompts on a 12 GiB card with host RAM for two prompts' outputs and no pinned copies: the
    queue runs in four rounds, each unloading and reloading the text encoder and the transformer from the file.

        q0:1 ──► q0:4 ──► q0:6 ──► q0:7 ──► q0:8
        ...
        q7:1 ──► q7:4 ──► q7:6 ──► q7:7 ──► q7:8
    """
    dag, costs = chains(8, side=1536)
    return plan(dag, costs, MODELS, Budget(round(11.4 * GiB), 21 * MiB), repeat=False)


def test_dense_plan_reads_at_a_glance():
    p = dense_plan()
    assert len(p.steps) > 50 and sum(isinstance(s.step, Unload) for s in p.steps) >= 6  # dense: many steps, swaps
    svg = timeline_svg(p, "queue.json", card=12 * GiB)
    root = check_readable(svg)
    assert title(root) == "queue · 12 GiB card"
    assert lanes(root) == ["te", "dit", "vae"]
    assert lane_labels(root) == ["text encoder · 5.80 GiB", "transformer · 7.22 GiB", "vae · 92.2 MiB"]
    # every step has its label under its column, in order: node id and class for a run
    labels = step_labels(root)
    assert len(labels) == len(p.steps)
    for s, label in zip(p.steps, labels, strict=True):
        assert label == (f"{s.step.node} {p.classes[s.step.node]}" + (" [tiled]" if s.step.variant == "tiled" else "")
                         if isinstance(s.step, Run) else s.step.kind)
    assert marks(root, "load") == [(i, s.step.model) for i, s in enumerate(p.steps) if isinstance(s.step, Load)]
    assert marks(root, "unload") == [(i, s.step.model) for i, s in enumerate(p.steps) if isinstance(s.step, Unload)]
    ids = {e.get("id") for e in root.iter() if e.get("id")}
    assert {f"vg-step-{i}" for i in range(len(p.steps))} <= ids  # the page finds each step by id / data-step


def test_simple_plan_from_the_cli(tmp_path: Path) -> None:
    """`vramgraph plan` on the shipped text-to-image workflow: title with the workflow, the card and the size."""
    svg = tmp_path / "plan.svg"
    assert main(["plan", str(ROOT / "workflows" / "text_to_image.json"), "--vram", "8GiB", "--models",
                 str(tmp_path / "none"), "--svg", str(svg)]) == 0
    root = check_readable(svg.read_text(encoding="utf-8"))
    assert title(root) == "text_to_image · 8 GiB card · 1024×1024"
    assert [lb.split(" · ")[0] for lb in lane_labels(root)] == ["text encoder", "transformer", "vae"]
    assert len(lanes(root)) == 3
    # the transformer does not fit on the card: the encoder leaves, the sampler keeps 11 of its 25 blocks and
    # streams the rest
    assert "6 VGSampler [stream 11/25]" in step_labels(root) and "7 VGVAEDecode" in step_labels(root)
    assert len(marks(root, "load")) == 2 and len(marks(root, "unload")) == 1
    words = " ".join("".join(t.itertext()) for t in root.iter(f"{NS}text"))
    assert "17.50 GiB streamed" in words
    # after the sampler its 11 resident blocks stay (a kept part): drawn in the transformer's lane, named in the key
    assert "its kept part on the GPU" in words
    transformer = next(g for g in root.iter(f"{NS}g") if g.get("class") == "lane"
                       and g.get("data-model", "").startswith("transformer:"))
    cells = {r.get("data-step"): r for r in transformer.iter(f"{NS}rect") if r.get("data-step") is not None}
    last = cells[str(max(int(k) for k in cells))]  # the save, the last step: the lower half of the lane filled
    assert float(last.get("height")) == LANE_H / 2 - 1
    ticks = ["".join(t.itertext()) for t in root.iter(f"{NS}text") if t.get("class") == "tick"]
    assert ticks == ["0", "2", "4", "6"]  # the budget: 7.02 GiB of the 8 GiB card
    assert [t.text for t in root.iter(f"{NS}text") if t.get("class") == "axis"] == ["GPU memory (GiB)"]


def test_dense_queue_from_the_cli(tmp_path: Path) -> None:
    """Eight queued prompts at three sizes on an 11 GiB card (the 2048² decodes are tiled), planned by the CLI with
    the budget the GPU run computes (on a 10 GiB card the 2048² sampler does not fit)."""
    wf = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    prompts = []
    for i in range(8):
        p = copy.deepcopy(wf)
        p["6"]["inputs"]["seed"], p["4"]["inputs"]["text"] = i, f"prompt {i}"
        side = (1024, 1536, 2048)[i % 3]
        p["5"]["inputs"].update(width=side, height=side)
        prompts.append(p)
    path = tmp_path / "queue_of_8.json"
    path.write_text(json.dumps(merge(prompts, frozenset({"VGSaveImage"})).prompt))
    svg = tmp_path / "plan.svg"
    assert main(["plan", str(path), "--vram", "11GiB", "--models", str(tmp_path / "none"), "--svg", str(svg)]) == 0
    root = check_readable(svg.read_text(encoding="utf-8"))
    assert title(root) == "queue_of_8 · 11 GiB card · 8 images, 1024×1024, 1536×1536 and 2048×2048"
    assert len(lanes(root)) == 3
    assert sum("[tiled]" in s for s in step_labels(root)) >= 2


@pytest.mark.parametrize("seed", range(6))
def test_random_plans_never_overlap(seed: int) -> None:
    """Queues of 1..14 prompts at random sizes, cards and host RAM, with long node ids: still no overlap."""
    rng = random.Random(seed)
    n = rng.randint(1, 14)
    dag, costs = chains(n, side=rng.choice((1024, 1536, 2048)))
    if rng.random() < 0.5:
        costs = {f"{k}-with-a-long-name": NodeCost(f"{k}-with-a-long-name", c.class_type, c.variants, c.host_bytes)
                 for k, c in costs.items()}
        dag = nx.relabel_nodes(dag, {k: f"{k}-with-a-long-name" for k in list(dag.nodes)})
    budget = Budget(round(rng.choice((10, 12, 16, 24, 80)) * GiB), rng.choice((21 * MiB, 64 * GiB)))
    p = plan(dag, costs, MODELS, budget, repeat=rng.random() < 0.5)
    root = check_readable(timeline_svg(p, "x" * rng.randint(0, 120), card=budget.gpu + GiB // 2))
    assert len(step_labels(root)) == len(p.steps) and len(lanes(root)) == 3


def test_streamed_and_pinned_lanes_and_a_budget_above_the_scale():
    """The text encoder streamed from host RAM (outline in its lane), kept pinned after; an 80 GiB budget far above
    a small peak puts the budget line at the top, said in its label.

        enc ──► sample
    """
    dag = nx.DiGraph([("enc", "sample")])
    costs = {"enc": NodeCost("enc", "VGTextEncode", (Variant("stream", (), GiB // 4, 0.1, streams=("te",)),)),
             "sample": NodeCost("sample", "VGSampler", (Variant("gpu", ("dit",), GiB // 2, 0.3),))}
    p = plan(dag, costs, MODELS, Budget(80 * GiB, 64 * GiB))
    assert p.steps[0].streams == ("te",)
    root = check_readable(timeline_svg(p))
    assert title(root) == "80.00 GiB budget"  # no card size given: the budget
    assert lanes(root) == ["te", "dit"]
    lane = next(g for g in root.iter(f"{NS}g") if g.get("data-model") == "te" and g.get("class") == "lane")
    cells = {r.get("data-step"): r for r in lane.iter(f"{NS}rect") if r.get("data-step")}
    assert cells["0"].get("stroke-dasharray") and cells["0"].get("fill") == "white"  # streamed while enc runs
    assert cells[str(len(p.steps) - 1)].get("height") == "4"  # its pinned host copy stays
    texts = ["".join(t.itertext()) for t in root.iter(f"{NS}text")]
    assert "budget 80.00 GiB (above this scale)" in texts and "streamed from host RAM" in texts


def test_a_plan_with_nothing_to_run():
    """Every node cached: no steps; the text encoder left on the GPU by the last run still has its lane."""
    p = plan(nx.DiGraph(), {}, MODELS, Budget(12 * GiB, GiB), start=Residency(frozenset({"te"})))
    assert p.steps == ()
    root = check_readable(timeline_svg(p, "cached.json", card=12 * GiB + GiB // 2))
    assert title(root) == "cached · 12.5 GiB card" and lanes(root) == ["te"] and step_labels(root) == []


def test_tiny_models_get_a_mib_axis():
    models = {"m": ModelCost("m", 3 * MiB, "tiny")}
    dag = nx.DiGraph()
    dag.add_node("a")
    p = plan(dag, {"a": NodeCost("a", "Tiny", (Variant("gpu", ("m",), MiB, 0.0),))}, models, Budget(5 * MiB, GiB))
    root = check_readable(timeline_svg(p, card=6 * MiB))
    assert [t.text for t in root.iter(f"{NS}text") if t.get("class") == "axis"] == ["GPU memory (MiB)"]
    assert title(root) == "6 MiB card"
    ticks = [float(t.text or "") for t in root.iter(f"{NS}text") if t.get("class") == "tick"]
    assert ticks == sorted(set(ticks)) and ticks[0] == 0 and ticks[-1] >= 5


def test_image_sizes_follow_primitive_links():
    prompt = {"w": {"class_type": "PrimitiveInt", "inputs": {"value": 768}},
              "l": {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": ["w", 0], "height": 512}},
              "s": {"class_type": "SaveImage", "inputs": {"images": ["d", 0]}}}
    assert image_sizes(prompt) == "768×512"
    assert image_sizes({}) == "" and image_sizes(None) == ""


def test_width_estimate_bounds_dejavu_sans():
    """The layout's widths are at least the real ones of the font the SVG asks for first (where it is installed)."""
    from PIL import ImageFont

    fonts = {False: Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"),
             True: Path("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf")}
    if not all(f.is_file() for f in fonts.values()):
        pytest.skip("DejaVu Sans is not installed")
    samples = [t for t, _ in text_boxes(timeline_svg(dense_plan(), "queue.json", card=12 * GiB))]
    samples += ["".join(chr(c) for c in range(32, 127)), "8 images, 1024×1024 · 12 GiB card"]
    for bold, path in fonts.items():
        font = ImageFont.truetype(str(path), 110)
        for s in samples:
            assert text_width(s, 11, bold) >= font.getlength(s) / 10, s
