"""The plan's view of a LoRA at klein-4B's real sizes (built-in specs, no weights; a rank-2 LoRA file on every
transformer layer): `vramgraph plan` and its timeline show what it costs, and a merge an earlier prompt left on the
resident weights counts as done only while the plan keeps the model resident until its node.

    1 UNETLoader ─► 21 LoraLoaderModelOnly ─► 6 CFGGuider ─► 11 SamplerCustomAdvanced ─► 12 VAEDecode ─► 13 SaveImage
    2 CLIPLoader ─► 4 CLIPTextEncode ─────────────►┘
"""

from __future__ import annotations

import json
import re
from html import unescape
from pathlib import Path

import pytest
from test_engine import core_text_to_image
from vramgraph.cli.main import main
from vramgraph.graph.engine.planning import Planning, merges_lost, prepare
from vramgraph.graph.plan import planner
from vramgraph.models import flux2_config
from vramgraph.models.headers import read_header
from vramgraph.models.lora_make import transformer_modules, write_lora
from vramgraph.nodes.catalog import ModelCatalog
from vramgraph.nodes.files import Folders
from vramgraph.nodes.lora import merge_signature

GiB = 2**30


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora_plan") / "models"
    write_lora(root / "loras" / "r2.safetensors", transformer_modules(flux2_config.KLEIN_4B, "bfl"), rank=2)
    return root


def graph(steps: int, text: str = "a fox") -> dict:
    g = core_text_to_image(text, seed=1, steps=steps, size=1024)
    g["21"] = {"class_type": "LoraLoaderModelOnly",
               "inputs": {"model": ["1", 0], "lora_name": "r2.safetensors", "strength_model": 0.8}}
    g["6"]["inputs"]["model"] = ["21", 0]
    return g


def _planning(models: Path, vram: int) -> Planning:
    folders = Folders(models=(models,))
    return Planning(folders, ModelCatalog(folders, "bf16", allow_builtin=True),
                    planner.Budget(gpu=vram * GiB, host=64 * GiB))


def _chosen(prep, node: str):
    name = prep.plan.variant_of(node)
    return next(v for v in prep.costs[node].variants if v.name == name)


def test_plan_command_and_timeline_show_the_lora(models, tmp_path, capsys):
    """One 4-step image on a 16 GiB card takes the LoRA on the fly: its adapter bytes (the file's tensors) and
    activation are in the sampler's note, in the table, the JSON and the timeline's tooltip; at 50 steps it merges."""
    adapters = sum(i.nbytes for i in read_header(models / "loras" / "r2.safetensors")[0].values())
    for steps, said in ((4, f"1 LoRA(s) on the fly ({adapters / 2**20:.1f} MiB of adapters, "),
                        (50, f"1 LoRA(s) merged into 89 layers ({adapters / 2**20:.1f} MiB of adapters; ")):
        wf, svg = tmp_path / f"lora{steps}.json", tmp_path / f"plan{steps}.svg"
        wf.write_text(json.dumps(graph(steps)))
        args = ["plan", str(wf), "--vram", "16GiB", "--models", str(models), "--host", "64GiB", "--svg", str(svg)]
        assert main(args) == 0
        row = next(r for r in capsys.readouterr().out.splitlines() if "11 (SamplerCustomAdvanced)" in r)
        assert said in row and ("MiB activation" in row) == (steps == 4)
        assert said in unescape(svg.read_text())
        assert main([*args[:-2], "--svg", "", "--json"]) == 0
        step = next(s for s in json.loads(capsys.readouterr().out)["steps"] if s.get("node") == "11")
        assert said in step["note"]


def test_a_merge_counts_as_done_only_while_its_model_stays_resident(models):
    """The next prompt (another text) with the transformer resident and the same LoRA merged into it: the sampler's
    LoRA costs nothing. Not resident at the start (its Load gives it the host copy's base weights): charged again."""
    pl = _planning(models, 16)
    first = pl.prepare(graph(50))
    v = _chosen(first, "11")
    assert v.lora_mode == "merged" and not v.lora.warm and v.seconds > v.lora.base.seconds
    key, merged = v.lora.chain[0], {v.lora.chain[0]: merge_signature(v.lora)}
    again = graph(50, "a cat")
    at = planner.Residency(frozenset({key}), frozenset({key}))
    warm = prepare(again, pl.nodes, pl.folders, pl.catalog, pl.budget, pl.cost, start=at, merged=merged)
    w = _chosen(warm, "11")
    assert w.lora.warm and (w.seconds, w.activation) == (w.lora.base.seconds, w.lora.base.activation)
    assert warm.plan.seconds < first.plan.seconds and "already" in w.note
    cold = prepare(again, pl.nodes, pl.folders, pl.catalog, pl.budget, pl.cost, merged=merged)
    c = _chosen(cold, "11")
    assert any(s.step.kind == "load" and s.step.model == key for s in cold.plan.steps)
    assert not c.lora.warm and c.seconds == v.seconds and merges_lost(cold.plan, cold.costs) == set()
    # the same plan with the credit kept would count on a merge its Load undid
    credited = prepare(again, pl.nodes, pl.folders, pl.catalog, pl.budget, pl.cost, start=at, merged=merged)
    moved = planner.Plan((planner.PlannedStep(planner.Load(key, "pinned"), 0, (key,), 0.0),
                          *(s for s in credited.plan.steps)), credited.plan.budget, credited.plan.models,
                         credited.plan.end)
    assert merges_lost(moved, credited.costs) == {key}


def test_a_different_strength_is_not_the_merge_on_the_weights(models):
    pl = _planning(models, 16)
    v = _chosen(pl.prepare(graph(50)), "11")
    key = v.lora.chain[0]
    other = graph(50, "a cat")
    other["21"]["inputs"]["strength_model"] = 0.5
    at = planner.Residency(frozenset({key}), frozenset({key}))
    prep = prepare(other, pl.nodes, pl.folders, pl.catalog, pl.budget, pl.cost, start=at,
                   merged={key: merge_signature(v.lora)})
    w = _chosen(prep, "11")
    assert w.lora_mode == "merged" and not w.lora.warm and re.search(r"merged into 89 layers \(", w.note)


def test_the_cost_bench_measures_what_the_plan_predicts(tmp_path, monkeypatch):
    """bench/lora_cost.py (run on the GPU by the lead: `bash bench/run_device.sh lora_cost`), here on the tiny model:
    it measures the layers the LoRA changes and sets each beside the plan's own prediction for them."""
    import importlib

    from vramgraph.models.tiny import TINY_TRANSFORMER
    from vramgraph.nodes import lora as lora_nodes

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    bench = importlib.import_module("lora_cost")
    out = tmp_path / "lora_cost.json"
    assert bench.main([str(out), "--tiny", "--ranks", "2", "--repeats", "1"]) == 0
    report = json.loads(out.read_text())
    shapes = flux2_config.parameter_shapes(TINY_TRANSFORMER)
    linear = {p: s for p, s in shapes.items() if len(s) == 2}
    merge, fly = report["ranks"]["2"]["merge"], report["ranks"]["2"]["fly"]
    assert merge["layer_bytes"] == sum(o * i * 4 for o, i in linear.values())  # every linear layer, fp32
    assert merge["predicted_merge_s"] == pytest.approx(3 * merge["layer_bytes"] / lora_nodes.HBM_BYTES_PER_S)
    assert merge["merge_s"] > 0 and merge["merge_ratio"] == round(merge["merge_s"] / merge["predicted_merge_s"], 3)
    assert fly["layers"] == len(linear) and fly["real"]["predicted_extra_s"] > 0
    assert report["assumed"]["KERNEL_SECONDS"] == lora_nodes.KERNEL_SECONDS and report["suggested"]["KERNEL_SECONDS"]
