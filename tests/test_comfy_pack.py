"""The repository as a ComfyUI custom-node pack, loaded the way ComfyUI's loader does it.

A fake minimal ComfyUI (modules `folder_paths`, `comfy.model_management`, `comfy.utils`, `server` in
sys.modules) stands in for the real one; the repository folder is imported with
`spec_from_file_location(<name>, <repo>/__init__.py, submodule_search_locations=[<repo>])` under a
name that is not `vramgraph`, so only relative imports can work. Our nodes are then called as ComfyUI
calls them: no `vg` argument, so they fall back to the ComfyUI-backed context.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


class Interrupted(Exception):
    """ComfyUI's InterruptProcessingException."""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("comfy") / "models", names=SHIPPED_NAMES)


def _fake_comfyui(root: Path, models: Path, device: str = "cpu") -> tuple[dict, list]:
    """Stub modules of a minimal ComfyUI; returns them by name and the list their calls are recorded in."""
    calls: list = []
    dirs = {"input": root / "input", "output": root / "output", "temp": root / "temp"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    paths = {"diffusion_models": [models / "diffusion_models", models / "unet"],
             "text_encoders": [models / "text_encoders", models / "clip"], "vae": [models / "vae"],
             "loras": [models / "loras"]}  # ComfyUI has a loras folder too

    fp = types.ModuleType("folder_paths")
    fp.models_dir = str(models)
    fp.get_folder_paths = lambda name: [str(p) for p in paths[name]]
    fp.get_filename_list = lambda name: sorted(p.relative_to(d).as_posix() for d in paths[name] if d.is_dir()
                                               for p in d.rglob("*.safetensors"))
    fp.get_full_path = lambda name, f: next((str(d / f) for d in paths.get(name, []) if (d / f).is_file()), None)
    fp.get_input_directory = lambda: str(dirs["input"])
    fp.get_output_directory = lambda: str(dirs["output"])
    fp.get_temp_directory = lambda: str(dirs["temp"])

    mm = types.ModuleType("comfy.model_management")
    mm.interrupted = False
    mm.InterruptProcessingException = Interrupted
    mm.get_torch_device = lambda: torch.device(device)
    mm.minimum_inference_memory = lambda: 1 << 20
    mm.free_memory = lambda needed, dev, keep_loaded=(): calls.append(("free_memory", needed, dev))
    mm.soft_empty_cache = lambda force=False: calls.append(("soft_empty_cache",))

    def throw() -> None:
        if mm.interrupted:
            mm.interrupted = False
            raise Interrupted("interrupted")

    mm.throw_exception_if_processing_interrupted = throw

    utils = types.ModuleType("comfy.utils")

    class ProgressBar:
        def __init__(self, total: int, node_id: str | None = None) -> None:
            self.total = total

        def update_absolute(self, value: int, total: int | None = None, preview: object = None) -> None:
            calls.append(("progress", value, total))

    utils.ProgressBar = ProgressBar
    comfy = types.ModuleType("comfy")
    comfy.model_management, comfy.utils = mm, utils

    from aiohttp import web

    server = types.ModuleType("server")
    server.PromptServer = type("PromptServer", (), {"instance": types.SimpleNamespace(routes=web.RouteTableDef())})

    class ImageScaleBy:  # ComfyUI's own node classes, declared as ComfyUI declares them (INPUT_TYPES() takes nothing)
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"image": ("IMAGE",), "upscale_method": (["nearest-exact", "bilinear"],),
                                 "scale_by": ("FLOAT", {"default": 1.0, "min": 0.01, "max": 8.0})}}

        RETURN_TYPES = ("IMAGE",)
        FUNCTION = "upscale"

    class SaveAnimatedWEBP:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"images": ("IMAGE",), "filename_prefix": ("STRING", {"default": "ComfyUI"})},
                    "hidden": {"prompt": "PROMPT"}}

        RETURN_TYPES = ()
        OUTPUT_NODE = True
        FUNCTION = "save"

    class ModelSamplingAuraFlow:  # a MODEL patch vramgraph does not implement (LoRA loaders it does)
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"model": ("MODEL",), "shift": ("FLOAT", {"default": 1.73})}}

        RETURN_TYPES = ("MODEL",)
        FUNCTION = "patch_aura"

    class Broken:
        @classmethod
        def INPUT_TYPES(cls):
            raise RuntimeError("needs more of ComfyUI")

    nodes = types.ModuleType("nodes")  # ComfyUI's nodes.py: its core nodes and every loaded pack's, ours too
    nodes.NODE_CLASS_MAPPINGS = {"ImageScaleBy": ImageScaleBy, "SaveAnimatedWEBP": SaveAnimatedWEBP, "Broken": Broken,
                                 "ModelSamplingAuraFlow": ModelSamplingAuraFlow,
                                 "SaveImage": SaveAnimatedWEBP}  # a core type we implement is planned as ours
    return {"folder_paths": fp, "comfy": comfy, "comfy.model_management": mm, "comfy.utils": utils,
            "server": server, "nodes": nodes}, calls


def _load_pack(name: str) -> types.ModuleType:
    """ComfyUI's nodes.load_custom_node for a folder: the folder's __init__.py as a package named `name`."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["vramgraph_pack", str(ROOT).replace(".", "_x_")], ids=["plain-name", "comfyui-path-name"])
def pack(request, tmp_path, models, monkeypatch):
    stubs, calls = _fake_comfyui(tmp_path, models)
    for k, v in stubs.items():
        monkeypatch.setitem(sys.modules, k, v)
    name = request.param
    module = _load_pack(name)
    module.calls, module.stubs, module.root = calls, stubs, tmp_path
    yield module
    for k in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[k]


def test_pack_exports_only_vg_nodes_in_one_category(pack):
    mappings, names = pack.NODE_CLASS_MAPPINGS, pack.NODE_DISPLAY_NAME_MAPPINGS
    assert mappings and all(k.startswith("VG") for k in mappings)
    assert {cls.CATEGORY for cls in mappings.values()} == {"vramgraph"}
    assert set(names) == set(mappings)
    assert all(v.endswith("(vramgraph)") and len(v) > len("(vramgraph)") for v in names.values())
    for name, cls in mappings.items():  # ComfyUI calls INPUT_TYPES() without arguments
        types_ = cls.INPUT_TYPES()
        assert "required" in types_, name
        assert cls.FUNCTION and hasattr(cls, cls.FUNCTION)
    # file lists come from ComfyUI's folder_paths
    assert "flux-2-klein-4b.safetensors" in mappings["VGLoadTransformer"].INPUT_TYPES()["required"]["file"][0]
    # the classes are the pack's own copies, imported relatively under the pack's name
    assert mappings["VGSampler"].__module__.startswith(pack.__name__ + ".")


def test_web_directory_holds_one_extension(pack):
    web = (ROOT / pack.WEB_DIRECTORY).resolve()
    assert web.is_dir()
    found = [Path(p).relative_to(web).as_posix() for p in glob.glob(str(web / "**" / "*.js"), recursive=True)]
    assert found == ["vramgraph_panel.js"], "ComfyUI would load every .js file here as an extension"
    text = (web / "vramgraph_panel.js").read_text()
    assert 'from "../../scripts/app.js"' in text and "app.registerExtension(" in text
    assert "/vramgraph/plan" in text
    assert (web / "timeline.mjs").is_file() and (web / "app.mjs").is_file()


def test_plan_route_is_added_to_comfyui_server(pack):
    from aiohttp import web

    routes = pack.stubs["server"].PromptServer.instance.routes
    posts = [r.path for r in routes if isinstance(r, web.RouteDef) and r.method == "POST"]
    assert posts == ["/vramgraph/plan"]
    app = web.Application()
    app.add_routes(routes)
    prompt = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    prompt["5"]["inputs"].update(width=64, height=64)
    import requests

    with sys.modules[pack.__name__ + ".server.app"].ServerThread(app) as srv:
        r = requests.post(srv.url + "/vramgraph/plan", json={"prompt": prompt}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert {s["kind"] for s in body["plan"]["steps"]} >= {"run", "load"}
        assert len(body["timeline"]["models"]) == 3
        assert body["unplanned"] == []
        bad = requests.post(srv.url + "/vramgraph/plan", json={"prompt": {"1": {"class_type": "Nope", "inputs": {}}}},
                            timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "missing_node_type"


def test_plan_panel_builds_no_engine_and_plans_within_comfyuis_free_memory(pack, monkeypatch):
    """The panel plans torch-free (graph/engine/planning.py `Planning`): it builds no Engine, which would cap
    ComfyUI's allocator and probe its GPU, and on CUDA plans within what ComfyUI says is free, less the margins."""
    import importlib

    from aiohttp import web

    executor = importlib.import_module(pack.__name__ + ".graph.engine.executor")

    def refused(*args, **kwargs):
        raise AssertionError("the panel built an Engine")

    monkeypatch.setattr(executor.Engine, "__init__", refused)
    app = web.Application()
    app.add_routes(pack.stubs["server"].PromptServer.instance.routes)
    prompt = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    prompt["5"]["inputs"].update(width=64, height=64)
    import requests

    server_app = sys.modules[pack.__name__ + ".server.app"]
    with server_app.ServerThread(app) as srv:
        r = requests.post(srv.url + "/vramgraph/plan", json={"prompt": prompt}, timeout=60)
        assert r.status_code == 200, r.text
    budget = importlib.import_module(pack.__name__ + ".graph.engine.budget")
    asked = []

    def free(dev=None):
        asked.append(dev)
        return 9 * 2**30

    monkeypatch.setattr(pack.stubs["comfy.model_management"], "get_free_memory", free, raising=False)
    got = server_app._comfy_budget("cuda:0")
    assert asked and got.card is None
    assert got.gpu == 9 * 2**30 - budget.CARD_MARGIN - budget.DEFAULT_RESERVE


def test_plan_panel_plans_graphs_that_mix_vg_and_comfyui_nodes(pack):
    """VG nodes beside ComfyUI's: the core types we implement (LoadImage, SaveImage, PreviewImage, ...) are planned
    as ours, the others by stand-ins from ComfyUI's declarations, and the answer names them."""
    from aiohttp import web

    app = web.Application()
    app.add_routes(pack.stubs["server"].PromptServer.instance.routes)
    prompt = json.loads((ROOT / "workflows" / "edit.json").read_text())
    prompt["5"]["inputs"].update(width=64, height=64)
    Image.new("RGB", (48, 32), (200, 40, 40)).save(pack.root / "input" / "ref.png")
    prompt["10"] = {"class_type": "LoadImage", "inputs": {"image": "ref.png"}}  # core, ours
    prompt["12"] = {"class_type": "ImageScaleBy", "inputs": {"image": ["10", 0], "upscale_method": "bilinear",
                                                             "scale_by": 1.0}}  # ComfyUI's only
    prompt["11"]["inputs"]["image"] = ["12", 0]
    prompt["8"] = {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "mixed"}}
    prompt["13"] = {"class_type": "PreviewImage", "inputs": {"images": ["7", 0]}}
    prompt["14"] = {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["7", 0], "filename_prefix": "anim"}}
    import requests

    with sys.modules[pack.__name__ + ".server.app"].ServerThread(app) as srv:
        r = requests.post(srv.url + "/vramgraph/plan", json={"prompt": prompt}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [(u["node"], u["class_type"]) for u in body["unplanned"]] == [("12", "ImageScaleBy"),
                                                                            ("14", "SaveAnimatedWEBP")]
        assert all("not in this plan" in u["note"] for u in body["unplanned"])
        ran = {s["node"] for s in body["plan"]["steps"] if s["kind"] == "run"}
        assert ran >= {"6", "7", "8", "10", "11", "12", "13", "14"}
        assert len(body["timeline"]["models"]) == 3
        # ComfyUI's declarations are checked as ComfyUI would check them
        prompt["12"]["inputs"]["scale_by"] = 99
        bad = requests.post(srv.url + "/vramgraph/plan", json={"prompt": prompt}, timeout=60)
        assert bad.status_code == 400
        assert bad.json()["node_errors"]["12"]["errors"][0]["type"] == "value_bigger_than_max"
        prompt["12"]["inputs"]["scale_by"] = 1.0
        prompt["12"]["class_type"] = "Broken"  # a declaration that cannot be read: a missing type, as before
        bad = requests.post(srv.url + "/vramgraph/plan", json={"prompt": prompt}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "missing_node_type"
        # ComfyUI's node between our loader and our sampler: our sampler cannot be sized, and the answer says why
        core = json.loads((ROOT / "workflows" / "core_text_to_image.json").read_text())
        core["20"] = {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["1", 0], "shift": 1.73}}
        core["6"]["inputs"]["model"] = ["20", 0]
        bad = requests.post(srv.url + "/vramgraph/plan", json={"prompt": core}, timeout=60)
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["extra_info"]["node_id"] == "6"
        assert "comes from node 20 (ModelSamplingAuraFlow), ComfyUI's own node" in error["message"]


def _heavy(pack, fn, *args, **kwargs):
    """Call a node function and return (result, the calls it made into ComfyUI)."""
    pack.calls.clear()
    out = fn(*args, **kwargs)
    return out, list(pack.calls)


def test_vg_graph_runs_inside_comfyui_and_cooperates(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (tr,) = m["VGLoadTransformer"]().load(file="flux-2-klein-4b.safetensors")
    (te,) = m["VGLoadTextEncoder"]().load(file="qwen_3_4b.safetensors")
    (vae,) = m["VGLoadVAE"]().load(file="flux2-vae.safetensors")
    assert not pack.calls, "loaders read headers only: nothing to free, nothing loaded"

    (cond,), calls = _heavy(pack, m["VGTextEncode"]().encode, text_encoder=te, text="a hedgehog")
    assert calls[0] == ("free_memory", te.info.nbytes + (1 << 20), torch.device("cpu"))
    assert calls[-1] == ("soft_empty_cache",), "the encoder goes back to the CPU when the node returns"

    (latent,) = m["VGEmptyLatent"]().generate(width=64, height=64, batch_size=1)
    (sampled,), calls = _heavy(pack, m["VGSampler"]().sample, model=tr, positive=cond, latent=latent, seed=3,
                               steps=2, guidance=1.0)
    assert calls[0] == ("free_memory", tr.info.nbytes + (1 << 20), torch.device("cpu"))
    assert [c for c in calls if c[0] == "progress"] == [("progress", 1, 2), ("progress", 2, 2)]
    assert calls[-1] == ("soft_empty_cache",)
    assert sampled["samples"].shape == (1, 128, 4, 4)

    (image,), calls = _heavy(pack, m["VGVAEDecode"]().decode, samples=sampled, vae=vae)
    assert calls[0][0] == "free_memory" and calls[0][1] >= vae.info.nbytes
    assert calls[-1] == ("soft_empty_cache",)
    # ComfyUI's IMAGE: float (B, H, W, 3) in 0..1 on the CPU, which its SaveImage turns into PNGs like this
    assert image.shape == (1, 64, 64, 3) and image.dtype == torch.float32 and image.device.type == "cpu"
    assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0
    for i in image:
        pil = Image.fromarray(np.clip(255.0 * i.cpu().numpy(), 0, 255).astype(np.uint8))
        assert pil.size == (64, 64)
    assert len(pil.getcolors(1 << 16)) > 50

    # our save node writes into ComfyUI's output folder and answers ComfyUI's ui dict
    ui = m["VGSaveImage"]().save_images(images=image, filename_prefix="vg/test", prompt={"1": {}})
    saved = ui["ui"]["images"][0]
    assert saved["type"] == "output" and saved["subfolder"] == "vg"
    assert (pack.root / "output" / "vg" / saved["filename"]).is_file()

    # an edit: ComfyUI's input image -> IMAGE and MASK -> reference -> sampling with it
    pil.save(pack.root / "input" / "ref.png")
    ref, mask = m["VGLoadImage"]().load_image(image="ref.png")
    assert ref.shape == (1, 64, 64, 3) and mask.shape[-2:] == (64, 64)
    (cond2,), calls = _heavy(pack, m["VGReferenceImage"]().reference, conditioning=cond, vae=vae, image=ref)
    assert calls[0][0] == "free_memory" and calls[-1] == ("soft_empty_cache",)
    (edited,) = m["VGSampler"]().sample(model=tr, positive=cond2, latent=latent, seed=3, steps=1, guidance=1.0)
    assert edited["samples"].shape == (1, 128, 4, 4)
    (lat,) = m["VGVAEEncode"]().encode(pixels=ref, vae=vae)
    assert lat["samples"].shape == (1, 128, 4, 4)

    # the cache keeps the three models in host RAM; none stays registered as on the device
    rt = sys.modules[pack.__name__ + ".nodes.comfy"].runtime()
    assert len(rt.modules) == 3 and not rt.on_device


def test_interrupt_reaches_our_sampler(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (tr,) = m["VGLoadTransformer"]().load(file="flux-2-klein-4b.safetensors")
    (te,) = m["VGLoadTextEncoder"]().load(file="qwen_3_4b.safetensors")
    (cond,) = m["VGTextEncode"]().encode(text_encoder=te, text="x")
    (latent,) = m["VGEmptyLatent"]().generate(width=32, height=32, batch_size=1)
    pack.stubs["comfy.model_management"].interrupted = True
    with pytest.raises(Interrupted):
        m["VGSampler"]().sample(model=tr, positive=cond, latent=latent, seed=0, steps=3, guidance=1.0)
    pack.calls.clear()
    m["VGTextEncode"]().encode(text_encoder=te, text="y")  # the next node still runs, and releases the last
    assert pack.calls[-1] == ("soft_empty_cache",)


def test_missing_model_names_the_folder(pack):
    with pytest.raises(FileNotFoundError, match="diffusion_models"):
        pack.NODE_CLASS_MAPPINGS["VGLoadTransformer"]().load(file="absent.safetensors")


@pytest.mark.gpu
def test_models_leave_the_gpu_after_each_node(tmp_path, models, monkeypatch):
    stubs, _ = _fake_comfyui(tmp_path, models, device="cuda")
    for k, v in stubs.items():
        monkeypatch.setitem(sys.modules, k, v)
    pack = _load_pack("vramgraph_pack_gpu")
    try:
        m = pack.NODE_CLASS_MAPPINGS
        (te,) = m["VGLoadTextEncoder"]().load(file="qwen_3_4b.safetensors")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        (cond,) = m["VGTextEncode"]().encode(text_encoder=te, text="a hedgehog")
        torch.cuda.synchronize()
        rt = sys.modules["vramgraph_pack_gpu.nodes.comfy"].runtime()
        assert all(p.device.type == "cpu" for mod in rt.modules.values() for p in mod.parameters())
        # the weights went back to the CPU; what stays is cuBLAS's workspace for this thread (32 MiB on the H200)
        assert torch.cuda.memory_allocated() - before < 64 << 20
        assert cond[0][0].device.type == "cpu"
    finally:
        for k in [k for k in sys.modules if k.startswith("vramgraph_pack_gpu")]:
            del sys.modules[k]


def test_checkpoints_come_from_comfyuis_folders_only(pack, models, tmp_path, monkeypatch):
    """VGLoadCheckpoint lists the model folders in ComfyUI's diffusers/ (and checkpoints/) folders and loads only
    those: a path is not a value it takes."""
    import shutil

    diffusers = tmp_path / "diffusers"
    (diffusers / "klein").mkdir(parents=True)
    for rel in ("diffusion_models/flux-2-klein-4b.safetensors", "text_encoders/qwen_3_4b.safetensors",
                "vae/flux2-vae.safetensors"):
        shutil.copy(models / rel, diffusers / "klein" / Path(rel).name)
    fp = pack.stubs["folder_paths"]
    listed = fp.get_folder_paths  # raises KeyError for names it lacks, as ComfyUI's does
    monkeypatch.setattr(fp, "get_folder_paths", lambda name: [str(diffusers)] if name == "diffusers" else listed(name))
    cls = pack.NODE_CLASS_MAPPINGS["VGLoadCheckpoint"]
    assert cls.INPUT_TYPES()["required"]["checkpoint"][0] == ["klein"]
    model, text_encoder, vae = cls().load("klein")
    assert (model.info.kind, text_encoder.info.kind, vae.info.kind) == ("transformer", "text_encoder", "vae")
    for bad in ("/etc", str(diffusers / "klein"), "../diffusers/klein"):
        with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
            cls().load(bad)


def test_loaders_refuse_unrun_quantisations_at_comfyui_validation(pack, models):
    """Inside ComfyUI, which calls VALIDATE_INPUTS with the file input alone (and then skips its own list check for
    it): a file we run passes, a name not in the folder is refused, and a file with an nvfp4 layer is refused from its
    header, naming the file, the layer and the format."""
    from safetensors.torch import load_file, save_file

    loader = pack.NODE_CLASS_MAPPINGS["VGLoadTransformer"]
    good = models / "diffusion_models" / "flux-2-klein-4b.safetensors"
    assert loader.VALIDATE_INPUTS(file=good.name) is True
    assert "not in diffusion_models" in loader.VALIDATE_INPUTS(file="nowhere.safetensors")
    tensors = load_file(str(good))
    key = next(k for k, v in tensors.items() if k.endswith(".weight") and v.ndim == 2)
    layer = key.removesuffix(".weight")
    bad = good.with_name("klein-nvfp4-pack.safetensors")
    save_file(tensors, str(bad), metadata={"_quantization_metadata": json.dumps(
        {"format_version": "1.0", "layers": {layer: {"format": "nvfp4"}}})})
    try:
        msg = loader.VALIDATE_INPUTS(file=bad.name)
    finally:
        bad.unlink()
    assert isinstance(msg, str) and msg.startswith(f"{bad.name}: layer ") and "it is quantised as 'nvfp4'" in msg


def test_vg_lora_loader_inside_comfyui(pack, models):
    """VGLoraLoader inside ComfyUI: the file from ComfyUI's loras folder, applied on the fly (ComfyUI moves our
    modules between devices), the cached host weights left as they were."""
    from vramgraph.models.lora_make import text_encoder_modules, transformer_modules, write_lora
    from vramgraph.models.tiny import TINY_QWEN3, TINY_TRANSFORMER

    write_lora(models / "loras" / "style.safetensors", transformer_modules(TINY_TRANSFORMER, "kohya") +
               text_encoder_modules(TINY_QWEN3, "comfy_te"), rank=4, scale=0.3)
    m = pack.NODE_CLASS_MAPPINGS
    assert "style.safetensors" in m["VGLoraLoader"].INPUT_TYPES()["required"]["lora_name"][0]
    (tr,) = m["VGLoadTransformer"]().load(file="flux-2-klein-4b.safetensors")
    (te,) = m["VGLoadTextEncoder"]().load(file="qwen_3_4b.safetensors")
    tr2, te2 = m["VGLoraLoader"]().load_lora(model=tr, clip=te, lora_name="style.safetensors", strength_model=1.0,
                                             strength_clip=1.0)
    assert len(tr2.info.loras) == 1 and len(te2.info.loras) == 1 and tr2.key == tr.key
    (latent,) = m["VGEmptyLatent"]().generate(width=64, height=64, batch_size=1)
    outs = []
    for model, clip in ((tr, te), (tr2, te2), (tr, te)):
        (cond,) = m["VGTextEncode"]().encode(text_encoder=clip, text="a hedgehog")
        (s,) = m["VGSampler"]().sample(model=model, positive=cond, latent=latent, seed=3, steps=1, guidance=1.0)
        outs.append(s["samples"])
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
