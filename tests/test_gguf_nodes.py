"""GGUF files through the engine: ComfyUI-GGUF's loader nodes (nodes/gguf.py) in an unchanged workflow, the VG
loaders, the plan at the files' real bytes, refusals at validation, and `vramgraph inspect`'s quant mix."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import save
from PIL import Image
from safetensors.torch import load_file
from test_engine import core_text_to_image, folders_for
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.workflow.errors import ValidationFailed
from vramgraph.models import loading
from vramgraph.models.gguf_write import write_gguf
from vramgraph.models.tiny import write_tiny_models

NAMES = {"transformer": "flux-2-klein-4b.safetensors", "text_encoder": "qwen_3_4b.safetensors",
         "vae": "flux2-vae.safetensors"}
TR_GGUF, TE_GGUF = "flux-2-klein-4b-Q8_0.gguf", "Qwen3-4B-Q8_0.gguf"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two models folders: GGUF files (Q8_0: the transformer under ComfyUI-GGUF's prefix, the text encoder with
    llama.cpp's names) and, under the core graph's names, safetensors files holding the same weights dequantized."""
    root = tmp_path_factory.mktemp("gguf")
    plain = write_tiny_models(root / "plain", names=NAMES)
    quant = root / "quant"
    (quant / "vae").mkdir(parents=True)
    shutil.copy(plain / "vae" / NAMES["vae"], quant / "vae" / NAMES["vae"])
    tr = {"model.diffusion_model." + k: v for k, v in load_file(str(plain / "diffusion_models" /
                                                                     NAMES["transformer"])).items()}
    held = write_gguf(quant / "diffusion_models" / TR_GGUF, tr, "Q8_0")
    save({k.removeprefix("model.diffusion_model."): v for k, v in held.items()},
         plain / "diffusion_models" / NAMES["transformer"])
    te = load_file(str(plain / "text_encoders" / NAMES["text_encoder"]))
    held = write_gguf(quant / "text_encoders" / TE_GGUF, te, "Q8_0", arch="qwen3", llama_names=True)
    save(held, plain / "text_encoders" / NAMES["text_encoder"])
    return plain, quant


def _gguf_graph(unet: str = TR_GGUF, clip: str = TE_GGUF) -> dict:
    """The core graph as a ComfyUI-GGUF user saves it: UnetLoaderGGUF and CLIPLoaderGGUF for the two loaders."""
    g = core_text_to_image("a kite", seed=1, steps=2, size=64)
    g["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": unet}}
    g["2"] = {"class_type": "CLIPLoaderGGUF", "inputs": {"clip_name": clip, "type": "flux2"}}
    return g


def _pixels(paths: list[Path]) -> np.ndarray:
    (p,) = paths
    return np.asarray(Image.open(p)).astype(np.int16)


def test_comfyui_gguf_workflow_runs_as_on_the_dequantized_weights(pair, input_dir, tmp_path):
    plain, quant = pair
    engine = Engine(folders_for(quant, input_dir, tmp_path / "q"), device="cpu")
    graph = _gguf_graph()
    assert set(engine.nodes["UnetLoaderGGUF"].INPUT_TYPES(engine.folders)["required"]["unet_name"][0]) == {TR_GGUF}
    prepared = engine.prepare(graph)
    sizes = {m.label: m.nbytes for m in prepared.plan.models.values()}
    spec = loading.inspect(quant)
    assert sizes["transformer"] == spec.transformer.nbytes("fp32") < spec.transformer.params * 4  # CPU runs fp32
    assert sizes["text encoder"] == spec.text_encoder.nbytes("fp32") < spec.text_encoder.params * 4
    got = _pixels(engine.run(graph).images)
    ref = Engine(folders_for(plain, input_dir, tmp_path / "p"), device="cpu")
    want = _pixels(ref.run(core_text_to_image("a kite", seed=1, steps=2, size=64)).images)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1  # same weights: the same picture


def test_vg_loaders_and_advanced_loader_take_gguf(pair, input_dir, tmp_path):
    _, quant = pair
    engine = Engine(folders_for(quant, input_dir, tmp_path), device="cpu")
    assert TR_GGUF in engine.nodes["VGLoadTransformer"].INPUT_TYPES(engine.folders)["required"]["file"][0]
    graph = _gguf_graph()
    graph["1"] = {"class_type": "UnetLoaderGGUFAdvanced", "inputs": {
        "unet_name": TR_GGUF, "dequant_dtype": "float16", "patch_dtype": "default", "patch_on_device": False}}
    assert engine.prepare(graph).plan is not None
    vg = json.loads((Path(__file__).parents[1] / "workflows" / "text_to_image.json").read_text())
    vg["1"]["inputs"]["file"], vg["2"]["inputs"]["file"] = TR_GGUF, TE_GGUF
    vg["5"]["inputs"].update(width=64, height=64)
    vg["6"]["inputs"]["steps"] = 1
    assert len(engine.run(vg).images) == 1


def test_bad_gguf_files_are_refused_at_validation(pair, input_dir, tmp_path):
    _, quant = pair
    models = tmp_path / "models"
    shutil.copytree(quant, models)
    raw = (quant / "diffusion_models" / TR_GGUF).read_bytes()
    (models / "diffusion_models" / "cut-Q8_0.gguf").write_bytes(raw[:-4096])
    engine = Engine(folders_for(models, input_dir, tmp_path), device="cpu")
    with pytest.raises(ValidationFailed) as info:
        engine.prepare(_gguf_graph(unet="cut-Q8_0.gguf"))
    (err,) = info.value.response["node_errors"]["1"]["errors"]
    assert err["type"] == "custom_validation_failed" and err["extra_info"]["input_name"] == "unet_name"
    assert "cut-Q8_0.gguf" in err["details"] and "truncated" in err["details"]
    with pytest.raises(ValidationFailed) as info:
        engine.prepare(_gguf_graph(unet=NAMES["transformer"]))
    (err,) = info.value.response["node_errors"]["1"]["errors"]
    assert "'flux-2-klein-4b.safetensors' not in ['cut-Q8_0.gguf', 'flux-2-klein-4b-Q8_0.gguf']" in err["details"]
    assert "UnetLoaderGGUF loads .gguf files" in engine.nodes["UnetLoaderGGUF"].VALIDATE_INPUTS(
        unet_name=NAMES["transformer"], folders=engine.folders)["unet_name"]


def test_inspect_prints_the_quant_mix(pair):
    _, quant = pair
    out = subprocess.run([sys.executable, "-m", "vramgraph", "inspect", str(quant)], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent)
    found = json.loads(out.stdout)
    spec = loading.inspect(quant)
    for kind in ("transformer", "text_encoder"):
        c = found[kind]
        assert c["dtype_mix"] == dict(getattr(spec, kind).dtype_mix) and "Q8_0" in c["dtype_mix"]
        assert c["gguf_types"]["Q8_0"] == getattr(spec, kind).quant_layers > 0
        plain = getattr(spec, kind).params - sum(n for _, n, _ in getattr(spec, kind).quant_blocks)
        assert c["bytes"] == c["dtype_mix"]["Q8_0"] + 2 * plain  # blocks as stored, F32 norms loaded as bf16
    assert found["text_encoder"]["tokenizer"].endswith("the Qwen3 tokenizer shipped with vramgraph is used (the "
                                                       "file's copy is not read)")


def test_blocks_stream_at_their_stored_bytes_and_change_the_plan(tmp_path, input_dir):
    """A 10-block tiny transformer: 44 MiB in fp32 (the CPU's compute dtype), 6 MiB as Q4_0 blocks. With 45 MiB the
    fp32 file must stream while the GGUF one stays resident; with 30 MiB the fp32 file cannot run at all and the GGUF
    one streams its blocks at their stored bytes, giving the picture the roomy engine gives, bit for bit."""
    from vramgraph.graph.engine.budget import Budget
    from vramgraph.graph.plan.planner import PlanError
    from vramgraph.models.flux2 import Flux2Transformer
    from vramgraph.models.tiny import TINY_TRANSFORMER

    models = write_tiny_models(tmp_path / "models", names=NAMES)
    torch.manual_seed(3)
    deep = Flux2Transformer(dataclasses.replace(TINY_TRANSFORMER, depth_double=2, depth_single=8))
    sd = {k: v.contiguous() for k, v in deep.state_dict().items()}
    save(sd, models / "diffusion_models" / NAMES["transformer"])
    write_gguf(models / "diffusion_models" / "deep-Q4_0.gguf", sd, "Q4_0")
    spec = loading.inspect(models / "diffusion_models" / "deep-Q4_0.gguf").transformer
    assert spec.nbytes("fp32") * 7 < loading.inspect(models / "diffusion_models" / NAMES["transformer"]
                                                     ).transformer.nbytes("fp32")

    def engine(mib: int | None, out: str) -> Engine:
        budget = Budget(gpu=mib * 2**20, host=8 * 2**30) if mib else None
        return Engine(folders_for(models, input_dir, tmp_path / out), device="cpu",
                      **({"budget": budget} if budget else {}))

    def graph(unet: str) -> dict:
        g = core_text_to_image("a kite", seed=1, steps=2, size=64)
        if unet.endswith(".gguf"):
            g["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": unet}}
        return g

    assert engine(45, "a").prepare(graph(NAMES["transformer"])).plan.variant_of("11") == "stream"
    assert engine(45, "b").prepare(graph("deep-Q4_0.gguf")).plan.variant_of("11") == "gpu"
    with pytest.raises(PlanError, match=r"needs .* GiB of GPU memory"):
        engine(30, "c").prepare(graph(NAMES["transformer"]))
    small = engine(30, "d")
    got = small.run(graph("deep-Q4_0.gguf"))
    (step,) = [s for s in got.plan.steps if s.blocks is not None and s.blocks.model.startswith("transformer")]
    sizes = [b for name, b in spec.block_bytes("fp32").items() if name.startswith(("double_", "single_"))]
    assert step.blocks.streamed and step.blocks.streamed_bytes == sum(sizes[i] for i in step.blocks.streamed)
    want = engine(None, "e").run(graph("deep-Q4_0.gguf"))
    assert np.array_equal(_pixels(got.images), _pixels(want.images))


def test_plans_without_files_size_gguf_names_by_their_type(tmp_path):
    """`vramgraph plan` without the files (built-in specs by name): a Q4_K_M klein-9B is planned at its block bytes,
    about 1/3.5 of bf16, so its blocks stream far less; names without a type we run fall back to bf16 sizes."""
    from vramgraph.models.flux2_config import KLEIN_9B, parameter_shapes
    from vramgraph.models.gguf import builtin_bytes, type_from_name
    from vramgraph.nodes.catalog import ModelCatalog
    from vramgraph.nodes.files import Folders

    assert [type_from_name(n) for n in ("flux-2-klein-9b-Q4_K_M.gguf", "qwen3-4b-q8_0.gguf", "x-Q5_K_S.gguf",
                                        "x-BF16.gguf", "x-IQ4_XS.gguf", "x.gguf", "x-Q4_K.safetensors")] == \
        ["Q4_K", "Q8_0", "Q5_K", "BF16", None, None, None]
    catalog = ModelCatalog(Folders(models=(tmp_path,)), dtype="bf16", allow_builtin=True)
    q4 = catalog.model_info("transformer", "flux-2-klein-9b-Q4_K_M.gguf")
    bf = catalog.model_info("transformer", "flux-2-klein-9b.safetensors")
    shapes = parameter_shapes(KLEIN_9B)
    assert q4.nbytes == builtin_bytes(shapes, "Q4_K", 2)
    assert 3.4 < bf.nbytes / q4.nbytes < 3.6
    assert catalog.model_info("transformer", "flux-2-klein-9b-IQ4_XS.gguf").nbytes == bf.nbytes
