"""Our pack inside ComfyUI beside ComfyUI-GGUF (city96/ComfyUI-GGUF): no clash, whichever loads first.

The minimal fake ComfyUI of test_comfy_pack.py, plus what loading ComfyUI-GGUF does to a ComfyUI (its nodes.py at
import): it registers its six loader node names and adds the folder keys `unet_gguf` and `clip_gguf` (ComfyUI's
diffusion_models and text_encoders folders, listing .gguf files) to folder_paths, and imports the PyPI `gguf`
package. Our pack must register none of its names, leave folder_paths, ComfyUI's node table and `gguf` as they are,
and still read .gguf files with its own loaders; its plan panel plans a workflow saved with ComfyUI-GGUF.
"""

from __future__ import annotations

import json
import sys
import types

import gguf
import pytest
import torch
from safetensors.torch import load_file
from test_comfy_pack import ROOT, _fake_comfyui, _load_pack
from vramgraph.models.gguf_write import write_gguf
from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models

# city96/ComfyUI-GGUF nodes.py NODE_CLASS_MAPPINGS and their TITLEs
COMFYUI_GGUF = {"UnetLoaderGGUF": "Unet Loader (GGUF)", "CLIPLoaderGGUF": "CLIPLoader (GGUF)",
                "DualCLIPLoaderGGUF": "DualCLIPLoader (GGUF)", "TripleCLIPLoaderGGUF": "TripleCLIPLoader (GGUF)",
                "QuadrupleCLIPLoaderGGUF": "QuadrupleCLIPLoader (GGUF)",
                "UnetLoaderGGUFAdvanced": "Unet Loader (GGUF/Advanced)"}
TR, TE = "flux-2-klein-4b-Q8_0.gguf", "qwen3-4b-Q8_0.gguf"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    models = write_tiny_models(tmp_path_factory.mktemp("comfy-gguf") / "models", names=SHIPPED_NAMES)
    tr = load_file(str(models / "diffusion_models" / SHIPPED_NAMES["transformer"][0]))
    write_gguf(models / "diffusion_models" / TR, {"model.diffusion_model." + k: v for k, v in tr.items()}, "Q8_0")
    te = load_file(str(models / "text_encoders" / SHIPPED_NAMES["text_encoder"]))
    write_gguf(models / "text_encoders" / TE, te, "Q8_0", arch="qwen3", llama_names=True)
    return models


def _folder_table(stubs: dict, models) -> None:
    """folder_paths.folder_names_and_paths as ComfyUI has it, and file lists that honour its extensions."""
    fp = stubs["folder_paths"]
    fp.folder_names_and_paths = {
        "diffusion_models": ([str(models / "diffusion_models"), str(models / "unet")], {".safetensors", ".sft"}),
        "text_encoders": ([str(models / "text_encoders"), str(models / "clip")], {".safetensors", ".sft"}),
        "vae": ([str(models / "vae")], {".safetensors", ".sft"})}

    def listing(name: str) -> list[str]:
        from pathlib import Path

        dirs, exts = fp.folder_names_and_paths[name]
        return sorted(p.relative_to(d).as_posix() for d in map(Path, dirs) if d.is_dir() for p in d.rglob("*")
                      if p.suffix in exts)

    fp.get_folder_paths = lambda name: list(fp.folder_names_and_paths[name][0])
    fp.get_filename_list = listing


def _load_comfyui_gguf(stubs: dict) -> types.ModuleType:
    """A stand-in for ComfyUI-GGUF's import: its node names (classes of its shape), its folder keys, `import gguf`."""
    fp, nodes = stubs["folder_paths"], stubs["nodes"]
    for key, targets in (("unet_gguf", "diffusion_models"), ("clip_gguf", "text_encoders")):
        fp.folder_names_and_paths[key] = (fp.folder_names_and_paths[targets][0], {".gguf"})
    pack = types.ModuleType("ComfyUI-GGUF")
    pack.gguf = gguf
    pack.NODE_CLASS_MAPPINGS = {n: type(n, (), {"TITLE": t, "CATEGORY": "bootleg", "FUNCTION": "load"})
                                for n, t in COMFYUI_GGUF.items()}
    pack.NODE_DISPLAY_NAME_MAPPINGS = dict(COMFYUI_GGUF)
    nodes.NODE_CLASS_MAPPINGS.update(pack.NODE_CLASS_MAPPINGS)
    return pack


@pytest.fixture(params=["ours-first", "theirs-first"])
def both(request, tmp_path, models, monkeypatch):
    stubs, calls = _fake_comfyui(tmp_path, models)
    _folder_table(stubs, models)
    for k, v in stubs.items():
        monkeypatch.setitem(sys.modules, k, v)
    theirs = _load_comfyui_gguf(stubs) if request.param == "theirs-first" else None
    before = {"folders": {k: (list(v[0]), set(v[1])) for k, v in stubs["folder_paths"].folder_names_and_paths.items()},
              "nodes": dict(stubs["nodes"].NODE_CLASS_MAPPINGS), "gguf": sys.modules["gguf"]}
    ours = _load_pack("vramgraph_beside_gguf")
    after = {"folders": {k: (list(v[0]), set(v[1])) for k, v in stubs["folder_paths"].folder_names_and_paths.items()},
             "nodes": dict(stubs["nodes"].NODE_CLASS_MAPPINGS), "gguf": sys.modules["gguf"]}
    theirs = theirs or _load_comfyui_gguf(stubs)
    ours.stubs, ours.root, ours.calls = stubs, tmp_path, calls
    yield ours, theirs, before, after
    for k in [k for k in sys.modules if k == ours.__name__ or k.startswith(ours.__name__ + ".")]:
        del sys.modules[k]


def test_no_clash_with_comfyui_gguf(both):
    ours, theirs, before, after = both
    assert not set(ours.NODE_CLASS_MAPPINGS) & set(theirs.NODE_CLASS_MAPPINGS)
    assert not set(ours.NODE_DISPLAY_NAME_MAPPINGS.values()) & set(theirs.NODE_DISPLAY_NAME_MAPPINGS.values())
    assert after == before  # our import touched neither folder_paths, nor ComfyUI's node table, nor `gguf`
    fp = ours.stubs["folder_paths"]
    assert fp.get_filename_list("unet_gguf") == [TR] and fp.get_filename_list("clip_gguf") == [TE]
    # our loaders list and take the .gguf files that ComfyUI's own lists lack
    assert TR not in fp.get_filename_list("diffusion_models")
    loader = ours.NODE_CLASS_MAPPINGS["VGLoadTransformer"]
    assert TR in loader.INPUT_TYPES()["required"]["file"][0] and loader.VALIDATE_INPUTS(file=TR) is True
    assert ours.NODE_CLASS_MAPPINGS["VGLoadTextEncoder"].VALIDATE_INPUTS(file=TE) is True


def test_vg_nodes_run_gguf_files_inside_comfyui(both):
    ours, *_ = both
    m = ours.NODE_CLASS_MAPPINGS
    (tr,) = m["VGLoadTransformer"]().load(file=TR)
    (te,) = m["VGLoadTextEncoder"]().load(file=TE)
    assert tr.info.nbytes < tr.info.spec.params * 4 and te.info.nbytes < te.info.spec.params * 4
    (cond,) = m["VGTextEncode"]().encode(text_encoder=te, text="a hedgehog")
    (latent,) = m["VGEmptyLatent"]().generate(width=32, height=32, batch_size=1)
    (sampled,) = m["VGSampler"]().sample(model=tr, positive=cond, latent=latent, seed=3, steps=1, guidance=1.0)
    assert sampled["samples"].shape == (1, 128, 2, 2) and torch.isfinite(sampled["samples"]).all()
    assert sys.modules["gguf"] is gguf  # reading GGUF files used the same `gguf` package ComfyUI-GGUF imports
    assert set(ours.stubs["folder_paths"].folder_names_and_paths) == {"diffusion_models", "text_encoders", "vae",
                                                                     "unet_gguf", "clip_gguf"}


def test_plan_panel_plans_a_comfyui_gguf_workflow(both):
    """A workflow saved with ComfyUI-GGUF (its two loaders and ComfyUI's core nodes) is planned by our panel's route
    as our engine runs it: every node planned, the models at their stored bytes."""
    from aiohttp import web

    ours, *_ = both
    app = web.Application()
    app.add_routes(ours.stubs["server"].PromptServer.instance.routes)
    prompt = json.loads((ROOT / "workflows" / "core_text_to_image.json").read_text())
    prompt["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": TR}}
    prompt["2"] = {"class_type": "CLIPLoaderGGUF", "inputs": {"clip_name": TE, "type": "flux2"}}
    prompt["8"]["inputs"].update(width=64, height=64)
    prompt["10"]["inputs"].update(width=64, height=64)
    import requests

    with sys.modules[ours.__name__ + ".server.app"].ServerThread(app) as srv:
        r = requests.post(srv.url + "/vramgraph/plan", json={"prompt": prompt}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["unplanned"] == []
    ran = {s["node"] for s in body["plan"]["steps"] if s["kind"] == "run"}
    assert {"1", "2", "11", "12"} <= ran
