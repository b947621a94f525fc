"""ComfyUI's six FLUX.2 [klein] templates (PyPI: comfyui-workflow-templates-json) validate, plan and run unchanged.

Each template file is copied as it ships (UI format with subgraphs, bypassed alternatives, notes) and run on tiny
random-weight models placed under the file names it references, with the input images it loads written as small
PNGs/JPEGs under their names. Only sizes and step counts are overridden (`--set` with the flattened subgraph ids,
e.g. `75:62` = node 62 inside subgraph instance 75), to keep the runs fast. Every template runs from the command line
and through the server (its /prompt, with the API prompt ComfyUI's front end would send), and `vramgraph plan`
plans each one from header-only files of the real sizes under the same names (no weights read).

The fp8 / fp8mixed file names (five of the six templates load one) are real fp8 files: the tiny models' weights
quantised per tensor to e4m3 (conftest.TINY_FP8), each of ComfyUI's three markings (header `_quantization_metadata`,
per-layer `.comfy_quant`, legacy `scaled_fp8`) serving at least one template; every run checks that the models it
computed with hold exactly the file's fp8 layers, in fp8, with the file's scales. The header-only files of the plans
are quantised the same way (fp8 headers of the real sizes). The small decoder (full_encoder_small_decoder) and the
klein-9B-kv FluxKVCache template are real too: a narrower tiny decoder, and the kv sampling path.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import torch
from conftest import INPUT_IMAGES, TINY_FP8
from PIL import Image
from vramgraph.cli import main
from vramgraph.graph.workflow.parse import ui_to_api
from vramgraph.models import fp8, loading
from vramgraph.models.tiny import MARKINGS, TINY_SMALL_DECODER_VAE
from vramgraph.nodes import ENGINE_NODES, estimates

CORE_T2I = {"UNETLoader", "CLIPLoader", "VAELoader", "CLIPTextEncode", "CFGGuider", "KSamplerSelect",
            "Flux2Scheduler", "RandomNoise", "EmptyFlux2LatentImage", "SamplerCustomAdvanced", "VAEDecode",
            "SaveImage"}
CORE_EDIT = CORE_T2I | {"LoadImage", "ImageScaleToTotalPixels", "GetImageSize", "VAEEncode", "ReferenceLatent"}
# the edit templates scale the reference to megapixels; 0.01 MP in steps of 16 gives small pictures
SMALL_EDIT = ["75:80.megapixels=0.01", "75:80.resolution_steps=16"]
SMALL_KV = ["130.megapixels=0.01", "130.resolution_steps=16", "131.megapixels=0.01", "131.resolution_steps=16"]
T2I_MODELS = {"flux-2-klein-base-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"}

TEMPLATES = {  # file -> (--set values, node types that must run with their counts, (width, height), seed, models)
    "image_flux2_klein_text_to_image.json": (
        ["75:68.value=64", "75:69.value=64", "75:62.steps=2"],  # Width, Height primitives; 20 base steps -> 2
        Counter({**dict.fromkeys(CORE_T2I, 1), "CLIPTextEncode": 2, "PrimitiveInt": 2,
                 "PrimitiveStringMultiline": 1}),
        (64, 64), 0, T2I_MODELS),
    "image_flux2_klein_image_edit_4b_distilled.json": (
        SMALL_EDIT,
        Counter({**dict.fromkeys(CORE_EDIT, 1), "ReferenceLatent": 2, "ConditioningZeroOut": 1}),
        (112, 96), 43301611940728,  # handbag_white.png 80x64 at 0.01 MP in steps of 16
        {"flux-2-klein-4b-fp8.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"}),
    "image_flux2_klein_image_edit_4b_base.json": (
        [*SMALL_EDIT, "75:62.steps=2"],
        Counter({**dict.fromkeys(CORE_EDIT, 1), "ReferenceLatent": 2, "CLIPTextEncode": 2}),
        (96, 112), 1111443136920027,  # robed_women.png 64x80 likewise
        {"flux-2-klein-base-4b-fp8.safetensors", "qwen_3_4b.safetensors", "full_encoder_small_decoder.safetensors"}),
    "image_flux2_klein_image_edit_9b_distilled.json": (
        SMALL_EDIT,
        Counter({**dict.fromkeys(CORE_EDIT, 1), "ReferenceLatent": 2, "ConditioningZeroOut": 1}),
        (96, 112), 26416064315367,  # bold_outfit_woman.jpeg 64x80 likewise (the two-image variant is bypassed)
        {"flux-2-klein-9b-fp8.safetensors", "qwen_3_8b_fp8mixed.safetensors",
         "full_encoder_small_decoder.safetensors"}),
    "image_flux2_klein_image_edit_9b_base.json": (
        [*SMALL_EDIT, "75:62.steps=2"],
        Counter({**dict.fromkeys(CORE_EDIT, 1), "ReferenceLatent": 2, "CLIPTextEncode": 2}),
        (112, 96), 192774551144773,  # car_interior_white.jpeg 80x64 likewise
        {"flux-2-klein-base-9b-fp8.safetensors", "qwen_3_8b_fp8mixed.safetensors",
         "full_encoder_small_decoder.safetensors"}),
    "image_flux2_klein_9b_kv_image_edit.json": (
        SMALL_KV,
        Counter({**dict.fromkeys(CORE_EDIT, 1), "LoadImage": 2, "ImageScaleToTotalPixels": 2, "VAEEncode": 2,
                 "ReferenceLatent": 4, "ConditioningZeroOut": 1, "FluxKVCache": 1}),
        (112, 96), 720512742793301,  # man_in_street.png 80x64 likewise, safari_outfit.png too (the 2nd reference)
        {"flux-2-klein-9b-kv-fp8.safetensors", "qwen_3_8b_fp8mixed.safetensors", "flux2-vae.safetensors"}),
}

def test_all_six_templates_are_covered() -> None:
    root = template("image_flux2_klein_text_to_image.json").parent
    assert {p.name for p in root.glob("image_flux2_klein_*.json")} == set(TEMPLATES)
    uses_fp8 = {n for n in TEMPLATES if referenced_files(json.loads(template(n).read_text())) & set(TINY_FP8)}
    assert len(uses_fp8) == 5 and "image_flux2_klein_text_to_image.json" not in uses_fp8
    assert {f for n in TEMPLATES for f in TEMPLATES[n][4]} >= set(TINY_FP8)  # every fp8 file serves a template
    assert {TINY_FP8[f]["marking"] for n in TEMPLATES for f in TEMPLATES[n][4] if f in TINY_FP8} == set(MARKINGS)


def template(name: str) -> Path:
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    assert spec is not None and spec.submodule_search_locations, "pip install comfyui-workflow-templates-json"
    return Path(next(iter(spec.submodule_search_locations))) / "templates" / name


def referenced_files(ui: dict) -> set[str]:
    """Every model file and image a template's nodes name in their widgets (subgraphs included)."""
    nodes = list(ui["nodes"]) + [n for sg in ui.get("definitions", {}).get("subgraphs", []) for n in sg["nodes"]]
    return {v for n in nodes for v in n.get("widgets_values") or [] if isinstance(v, str)
            and v.endswith((".safetensors", ".png", ".jpeg"))}


def fp8_layers(module: torch.nn.Module) -> dict[str, tuple[torch.dtype, float | None, float | None]]:
    """The fp8 layers a loaded model computes with: {layer: (weight dtype in memory, weight scale, input scale)}."""
    return {n: (m.weight.dtype, *(float(getattr(m, b)) if hasattr(m, b) else None for b in ("weight_scale",
                                                                                           "input_scale")))
            for n, m in module.named_modules() if isinstance(m, fp8.FP8Linear)}


def stored_fp8_layers(path: Path) -> dict[str, tuple[torch.dtype, float | None, float | None]]:
    """The same, read from the file with safetensors itself: its fp8 weights with their scales (either naming),
    by layer name without the file's prefix."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        for k in keys:
            if not (k.endswith(".weight") and f.get_slice(k).get_dtype() == "F8_E4M3"):
                continue
            layer = k.removesuffix(".weight")
            scales = [next((float(f.get_tensor(f"{layer}.{n}")) for n in names if f"{layer}.{n}" in keys), None)
                      for names in (("weight_scale", "scale_weight"), ("input_scale", "scale_input"))]
            name = layer.removeprefix("model.diffusion_model.").removeprefix("model.")
            out[name] = (torch.float8_e4m3fn, *scales)
    return out


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.nn.Module]:
    """Every model built from a file while the test runs (models.loading.load), by the file's name."""
    seen, real = {}, loading.load

    def spy(spec, **kwargs):
        seen[spec.files[0].name] = module = real(spec, **kwargs)
        return module

    monkeypatch.setattr(loading, "load", spy)
    return seen


def assert_ran_as_stored(models: set[str], modules: dict[str, torch.nn.Module], root: Path) -> None:
    """The models a template ran on computed with exactly their files' fp8 layers, kept in fp8, with the files'
    scales; the fp8 names hold fp8 layers (not stand-ins), the others none. The fp8mixed encoder is mixed, the
    small decoder narrower than its encoder (the widths of the tiny one)."""
    for name in models:
        (path,) = root.rglob(name)
        stored = stored_fp8_layers(path)
        assert bool(stored) == (name in TINY_FP8), name
        assert fp8_layers(modules[name]) == stored, name
        if "fp8mixed" in name:
            assert any(isinstance(m, torch.nn.Linear) for m in modules[name].layers[0].modules()), name
        if name == "full_encoder_small_decoder.safetensors":
            cfg = modules[name].cfg
            assert cfg.decoder_widths == TINY_SMALL_DECODER_VAE.decoder_channels != cfg.channels


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_comfyui_template_runs_unchanged(name: str, tiny_models: Path, input_dir: Path, tmp_path: Path,
                                         loaded: dict[str, torch.nn.Module]) -> None:
    sets, ran, size, seed, models = TEMPLATES[name]
    src = tmp_path / name
    shutil.copy(template(name), src)
    ui = json.loads(src.read_text())
    have = {p.name for p in tiny_models.rglob("*.safetensors")} | {p.name for p in input_dir.glob("*.*")}
    assert referenced_files(ui) <= have  # every file it names exists under that name (the fixtures' lists)
    assert main(["validate", str(src), "--models", str(tiny_models), "--input", str(input_dir)]) == 0

    out, report = tmp_path / "out", tmp_path / "report.json"
    args = ["run", str(src), "--models", str(tiny_models), "--input", str(input_dir), "-o", str(out),
            "--report", str(report)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert json.loads(src.read_text()) == ui  # the file itself is left as it was

    (png,) = sorted(out.rglob("*.png"))
    with Image.open(png) as im:
        assert im.size == size
        text = dict(im.text)
    prompt = json.loads(text["prompt"])
    workflow, shipped = json.loads(text["workflow"]), json.loads(template(name).read_text())
    converted = ui_to_api(workflow, ENGINE_NODES)  # the template UI JSON with the --set values that ran
    assert {k: v for k, v in converted.items() if k in prompt} == prompt  # (the prompt: the nodes that ran)
    touched = {str(x.split(".")[0].split(":")[0]) for x in sets}  # top-level nodes (or subgraph instances) --set
    assert {k: v for k, v in workflow.items() if k not in ("definitions", "nodes")} == {
        k: v for k, v in shipped.items() if k not in ("definitions", "nodes")}
    assert [n for n in workflow["nodes"] if str(n["id"]) not in touched] == [
        n for n in shipped["nodes"] if str(n["id"]) not in touched]
    assert text["seed"] == str(seed)

    rep = json.loads(report.read_text())
    assert Counter(n["class_type"] for n in rep["nodes"]) == ran  # ComfyUI's core nodes, none of ours
    assert {n["class_type"] for n in prompt.values()} == set(ran)
    used = {Path(k.split(":", 1)[1].rsplit(":", 1)[0]).name for k in rep["plan"]["models"]}  # kind:path:dtype
    assert used == models
    assert_ran_as_stored(models, loaded, tiny_models)


# ------------------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server(tiny_models: Path, input_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.nodes import ENGINE_NODES
    from vramgraph.nodes.files import Folders
    from vramgraph.server.app import ServerThread, make_app

    tmp = tmp_path_factory.mktemp("templates-server")
    folders = Folders(models=(tiny_models,), input=input_dir, output=tmp / "output", temp=tmp / "temp")
    for d in (folders.output, folders.temp):
        d.mkdir(parents=True)
    engine = Engine(folders, nodes=ENGINE_NODES, device="cpu")
    with ServerThread(make_app(engine)) as srv:
        yield srv, engine


def _set(prompt: dict, assignment: str) -> None:
    target, value = assignment.split("=", 1)
    node, name = target.rsplit(".", 1)
    prompt[node]["inputs"][name] = json.loads(value)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_template_runs_from_the_server(name: str, server) -> None:
    """As ComfyUI's front end sends it: the UI file converted to an API prompt (here by our /vramgraph/convert),
    the workflow in extra_pnginfo; the picture comes back through /history and /view."""
    import time

    srv, engine = server
    sets, ran, size, seed, models = TEMPLATES[name]
    ui = json.loads(template(name).read_text())
    conv = requests.post(srv.url + "/vramgraph/convert", json={"workflow": ui}, timeout=60)
    assert conv.status_code == 200, conv.text
    prompt = conv.json()["prompt"]
    for s in sets:
        _set(prompt, s)
    r = requests.post(srv.url + "/prompt", json={"prompt": prompt, "extra_data": {"extra_pnginfo": {"workflow": ui}}},
                      timeout=60)
    assert r.status_code == 200, r.text
    pid = r.json()["prompt_id"]
    end = time.monotonic() + 600
    while not (h := requests.get(f"{srv.url}/history/{pid}", timeout=30).json()) and time.monotonic() < end:
        time.sleep(0.2)
    entry = h[pid]
    assert entry["status"]["status_str"] == "success", entry["status"]
    (image,) = [im for out in entry["outputs"].values() for im in out.get("images", [])]
    got = requests.get(srv.url + "/view", params=image, timeout=30)
    assert got.status_code == 200
    from io import BytesIO

    with Image.open(BytesIO(got.content)) as im:
        assert im.size == size
        assert im.text["seed"] == str(seed) and json.loads(im.text["workflow"]) == ui
    assert {n["class_type"] for n in prompt.values()} == set(ran)
    # the server's models of this prompt, kept after it (read for it, or cached from an earlier one)
    held = {Path(e.info.spec.files[0]).name: e.module for e in engine.ledger.entries.values()}
    assert_ran_as_stored(models, held, engine.folders.models[0])


# ---------------------------------------------------------------------------------- plans at the real sizes


def _header_only_models(root: Path) -> Path:
    """Every model file the six templates name, as a header-only file with the real tensors' shapes and dtypes
    (no data: a plan reads headers only). The fp8 names are quantised as the tiny files are (TINY_FP8: their
    markings, fp8 block linears, bf16 rest; only the small marker tensors hold bytes); the others are bf16, the VAEs
    fp32 as shipped, the small decoder with its own widths."""
    from test_loading import header_of, header_only, real_shapes, shapes_of
    from vramgraph.models import flux2, qwen3, vae, vae_config
    from vramgraph.models.tiny import quantize_fp8

    tr4, te4, ae = real_shapes(flux2.KLEIN_4B, qwen3.Qwen3Config())
    tr9, te8, _ = real_shapes(flux2.KLEIN_9B, qwen3.QWEN3_8B)
    with torch.device("meta"):
        small = shapes_of(vae.Flux2VAE(vae_config.SMALL_DECODER))
    files = {
        "diffusion_models": {"flux-2-klein-4b": tr4, "flux-2-klein-base-4b": tr4, "flux-2-klein-4b-fp8": tr4,
                             "flux-2-klein-base-4b-fp8": tr4, "flux-2-klein-9b-fp8": tr9,
                             "flux-2-klein-base-9b-fp8": tr9, "flux-2-klein-9b-kv-fp8": tr9},
        "text_encoders": {"qwen_3_4b": te4, "qwen_3_8b_fp8mixed": te8},
    }
    for folder, named in files.items():
        for stem, shapes in named.items():
            path = root / folder / f"{stem}.safetensors"
            if path.name in TINY_FP8:
                meta = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes.items()}
                header_of(path, *quantize_fp8(meta, **TINY_FP8[path.name]))
            else:
                header_only(path, shapes)
    header_only(root / "vae" / "flux2-vae.safetensors", ae, "F32")
    header_only(root / "vae" / "full_encoder_small_decoder.safetensors", small, "F32")
    return root


@pytest.fixture(scope="module")
def full_size_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _header_only_models(tmp_path_factory.mktemp("full") / "models")


GiB = 2**30
# klein-4B 3,875,544,576 and klein-9B 9,078,581,248 parameters (diffusers Flux2Transformer2DModel at those configs)
TRANSFORMER_PARAMS = {"4b": 3_875_544_576, "9b": 9_078_581_248}
# Their block linears, fp8 in the fp8 files: (layers, elements). Hidden size h: a double block has per stream qkv 3h^2,
# proj h^2, the gated mlp 6h^2 and 3h^2 (8 linears, 26h^2 in all), a single block linear1 9h^2 and linear2 4h^2;
# klein-4B 5 double + 20 single blocks at h = 3072, klein-9B 8 + 24 at h = 4096.
BLOCK_LINEARS = {"4b": (5 * 8 + 20 * 2, (5 * 26 + 20 * 13) * 3072**2),
                 "9b": (8 * 8 + 24 * 2, (8 * 26 + 24 * 13) * 4096**2)}
# BFL's flux-2-klein-4b-fp8.safetensors, in bytes (shared/reference/checkpoint-formats.md 1e): its tensors and header
FP8_4B_FILE = 4_070_624_520


def stored(path: Path, reads: Callable[[str], bool]) -> tuple[int, int]:
    """(bytes, elements) a file stores for the tensors `reads` names, from its header alone; the quantisation
    markers (`.comfy_quant`, `scaled_fp8`) are not weights."""
    raw = path.read_bytes()
    table = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    picked = [t for k, t in table.items() if k != "__metadata__" and not k.endswith((".comfy_quant", "scaled_fp8"))
              and reads(k)]
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for t in picked), sum(math.prod(t["shape"]) for t in picked)


def qwen3_reads(key: str) -> bool:
    """What the klein conditioning reads of a Qwen3 encoder: the embedding and layers 0-26 (the input of layer 27 is
    the last hidden state it takes)."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return key.startswith("model.embed_tokens.") or (m is not None and int(m[1]) < 27)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_plan_at_full_size_from_headers(name: str, full_size_models: Path, input_dir: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    """`vramgraph plan` of the unchanged template over header-only files of the real sizes: exit 0, the models it
    names with their real sizes, the small decoder's own (smaller) decode and the kv sampler's cache."""
    src = tmp_path / name
    shutil.copy(template(name), src)
    code = main(["plan", str(src), "--models", str(full_size_models), "--input", str(input_dir), "--vram", "40GiB",
                 "--json", "--svg", str(tmp_path / "plan.svg")])
    out = capsys.readouterr().out
    assert code == 0, out
    plan = json.loads(out)
    models = TEMPLATES[name][4]
    names = {Path(k.split(":", 1)[1].rsplit(":", 1)[0]).name: m for k, m in plan["models"].items()}
    assert set(names) == models
    tr = next(n for n in names if n.startswith("flux-2-klein"))
    size = "9b" if "9b" in tr else "4b"
    params, (layers, elements) = TRANSFORMER_PARAMS[size], BLOCK_LINEARS[size]
    if tr in TINY_FP8:  # the bf16 rest, 1 byte per fp8 element and fp32 weight and input scales
        assert names[tr]["nbytes"] == 2 * (params - elements) + elements + 8 * layers
        if size == "4b":  # the real file's bytes, less its header (tens of KiB)
            assert 0 < FP8_4B_FILE - names[tr]["nbytes"] < 64 * 2**10
    else:
        assert names[tr]["nbytes"] == 2 * params
    te = next(n for n in names if n.startswith("qwen"))  # the bytes its header gives what it reads
    nbytes, elements = stored(full_size_models / "text_encoders" / te, qwen3_reads)
    assert names[te]["nbytes"] == nbytes
    assert nbytes < 1.2 * elements if te in TINY_FP8 else nbytes == 2 * elements  # fp8mixed: mostly fp8
    assert (tmp_path / "plan.svg").read_text().startswith("<svg")
    runs = {s["node"]: s for s in plan["steps"] if s["kind"] == "run"}
    assert len(runs) == sum(TEMPLATES[name][1].values())
    if "kv" in name:  # SamplerCustomAdvanced (node 123): step 0 over every token plus the K/V cache of both references
        sampler = runs["123"]
        act = sampler["gpu_bytes"] - sum(plan["models"][m]["nbytes"] for m in sampler["resident"])
        # man_in_street.png (the target's size too) and safari_outfit.png, each scaled to 1 MP
        (w1, h1), (w2, h2) = (estimates.scaled_size(*INPUT_IMAGES[f], 1.0) for f in ("man_in_street.png",
                                                                                    "safari_outfit.png"))
        ref = (h1 // 16) * (w1 // 16) + (h2 // 16) * (w2 // 16)
        step0 = estimates.sampling_bytes(1, 512 + (h1 // 16) * (w1 // 16) + ref, 4096, 2)
        cache = estimates.kv_cache_bytes(1, ref, 4096, 32, 2)
        assert cache > 3.9 * GiB
        dequantized = 2 * 9 * 4096**2  # the fp8 file's largest layer (a single block's linear1) in bf16, one at a time
        assert act == pytest.approx(estimates.MARGIN * (step0 + cache + dequantized), rel=0.01)  # (+ the preview)
