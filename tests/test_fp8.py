"""fp8 checkpoints as ComfyUI stores them (models/quant.py, models/fp8.py): each of the three markings, e4m3 and
e5m2, uint8-stored weights, mixed files. The reference models (diffusers, transformers) run on the same
dequantized weights our fp8 layers compute with, so our dequantized forward must match them in fp32; what we
do not run is refused from the header, naming the file, the layer and the format."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import rel_l2, save
from refmodels import diffusers_transformer, transformer_to_bfl, transformers_qwen3
from test_flux2 import _inputs, ours_and_reference
from vramgraph.models import common, flux2, fp8, loading
from vramgraph.models.headers import CheckpointError, read_header, strip_prefix
from vramgraph.models.quant import quant_layers
from vramgraph.models.qwen3 import load_qwen3
from vramgraph.models.tiny import FP8_MAX, MARKINGS, quantize_fp8

FORMATS = ("float8_e4m3fn", "float8_e5m2")


def _fake_quant(w: torch.Tensor, fmt: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """w quantised per tensor and back, in fp32 (the values an fp8 layer computes with)."""
    scale = ((w.abs().amax() if amax is None else amax) / FP8_MAX[fmt]).clamp_min(1e-12)
    return (w / scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(getattr(torch, fmt)).float() * scale


def _dequantized_diffusers(sd: dict, fmt: str) -> dict:
    """Every 2-d weight of a diffusers FLUX.2 state dict fake-quantised per tensor; q, k and v of one attention share
    a scale, so that BFL's fused qkv (one tensor, one scale) holds exactly these values."""
    out = dict(sd)
    for k, w in sd.items():
        if k.endswith(".weight") and w.ndim == 2 and not re.search(r"\.(to_[qkv]|add_[qkv]_proj)\.weight$", k):
            out[k] = _fake_quant(w, fmt)
    for k in sd:
        if m := re.fullmatch(r"(.+\.attn\.)(to_q|add_q_proj)\.weight", k):
            group = [m[1] + (f"to_{x}" if m[2] == "to_q" else f"add_{x}_proj") + ".weight" for x in "qkv"]
            amax = max(sd[g].abs().amax() for g in group)
            for g in group:
                out[g] = _fake_quant(sd[g], fmt, amax)
    return out


@pytest.fixture(scope="module")
def transformer_ref(tmp_path_factory):
    """Per format: the diffusers reference on fake-quantised weights, and those weights in BFL layout."""
    out = {}
    for fmt in FORMATS:
        ref = diffusers_transformer(seed=11)
        dq = _dequantized_diffusers(ref.state_dict(), fmt)
        ref.load_state_dict(dq)
        out[fmt] = (ref, transformer_to_bfl(dq))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("marking", MARKINGS)
def test_transformer_matches_diffusers_on_dequantized_weights(transformer_ref, tmp_path, fmt, marking):
    ref, bfl = transformer_ref[fmt]
    prefix = "model.diffusion_model." if marking != "comfy_quant" else ""
    tensors, meta = quantize_fp8(bfl, fmt=fmt, marking=marking, input_scale=1.0 if marking == "metadata" else None,
                                 uint8=marking == "comfy_quant", prefix=prefix)
    path = save(tensors, tmp_path / "flux-2-klein-4b-fp8.safetensors", metadata=meta)
    spec = loading.inspect(path).transformer
    assert spec.quant_layers == sum(1 for k, v in bfl.items() if k.endswith(".weight") and v.ndim == 2)
    storage = "F8_E4M3" if fmt == "float8_e4m3fn" else "F8_E5M2"
    assert spec.dtype == storage.lower()
    model = loading.load(spec, dtype=torch.float32)
    qkv = model.double_blocks[0].img_attn.qkv
    assert isinstance(qkv, fp8.FP8Linear) and qkv.weight.dtype == getattr(torch, fmt)  # stays fp8 in memory
    assert model.dtype == torch.float32 and model.double_blocks[0].img_attn.norm.query_norm.scale.dtype == torch.float32
    got, want, _ = ours_and_reference(model, ref, torch.tensor([0.9, 0.35]))
    assert rel_l2(got, want) < 1e-4


def test_mixed_transformer_bytes_and_host_read(transformer_ref, tmp_path):
    """Only the block linears in fp8 (as BFL's klein fp8 files): bytes count 1 per fp8 element plus the scales, the
    rest in the compute dtype; the fp8 weights are read byte for byte into the host buffer (no conversion)."""
    _, bfl = transformer_ref["float8_e4m3fn"]
    tensors, meta = quantize_fp8(bfl, layers=lambda k: "_blocks." in k, input_scale=1.0)
    path = save(tensors, tmp_path / "mixed.safetensors", metadata=meta)
    spec = loading.inspect(path).transformer
    q = [k for k, v in bfl.items() if "_blocks." in k and k.endswith(".weight") and v.ndim == 2]
    fp8_elems = sum(bfl[k].numel() for k in q)
    plain = spec.params - fp8_elems
    assert spec.nbytes("bf16") == plain * 2 + fp8_elems + 8 * len(q)  # weight_scale + input_scale, fp32 each
    assert spec.nbytes("fp32") == plain * 4 + fp8_elems + 8 * len(q)
    assert sum(spec.block_bytes("bf16").values()) == spec.nbytes("bf16")
    assert dict(spec.dtype_mix) == {"F32": plain * 4 + 8 * len(q), "F8_E4M3": fp8_elems}
    infos = spec.infos
    srcs = flux2.sources(spec.config, infos.keys())
    shape = tuple(infos["double_blocks.0.img_attn.qkv.weight"].shape)
    assert common._byte_spans(srcs["double_blocks.0.img_attn.qkv.weight"], shape, infos, torch.float8_e4m3fn)
    host = loading.load(spec, dtype=torch.bfloat16, device="cpu").state_dict()  # the one-buffer parallel read
    for k in q:
        layer = k.removesuffix(".weight")
        assert host[k].dtype == torch.float8_e4m3fn and torch.equal(host[k].view(torch.uint8),
                                                                    tensors[k].view(torch.uint8)), k
        scale = host[layer + ".weight_scale"]
        assert scale.shape == () and scale == tensors[layer + ".weight_scale"]
    host = loading.load(spec, dtype=torch.bfloat16, device="cpu")
    assert host.img_in.weight.dtype == torch.bfloat16
    assert host.single_blocks[0].linear1.weight.dtype == torch.float8_e4m3fn


def _dequantized(tensors: dict, meta: dict) -> dict:
    """The fp32 values of a `quantize_fp8` output (metadata marking), as the reference gets them."""
    layers = json.loads(meta["_quantization_metadata"])["layers"]
    return {k: (v.float() * tensors[k.removesuffix(".weight") + ".weight_scale"]
                if k.removesuffix(".weight") in layers else v)
            for k, v in tensors.items() if not k.endswith(("_scale", ".comfy_quant"))}


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8mixed_text_encoder_matches_transformers(tmp_path, fmt):
    """Some layers fp8, some not (qwen_3_8b_fp8mixed), the embedding table too in one case; always dequantized."""
    ref = transformers_qwen3(seed=4)
    sd = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}

    def pick(k: str) -> bool:  # the mlp of even layers and the attention of odd ones; the table in e4m3
        m = re.match(r"model\.layers\.(\d+)\.(mlp|self_attn)\.", k)
        return bool(m and (int(m[1]) % 2 == 0) == (m[2] == "mlp")) or (k == "model.embed_tokens.weight" and
                                                                       fmt == "float8_e4m3fn")
    tensors, meta = quantize_fp8(sd, fmt=fmt, layers=pick)
    path = save(tensors, tmp_path / "qwen_3_8b_fp8mixed.safetensors", metadata=meta)
    ref.load_state_dict(_dequantized(tensors, meta), strict=False)
    if fmt == "float8_e4m3fn":
        ref.lm_head.weight = ref.model.embed_tokens.weight
    spec = loading.inspect(path).text_encoder
    assert {d for d, _ in spec.dtype_mix} == {"F32", "F8_E4M3" if fmt == "float8_e4m3fn" else "F8_E5M2"}
    enc = load_qwen3(read_header(path)[0], dtype=torch.float32)
    assert isinstance(enc.layers[0].mlp.up_proj, fp8.FP8Linear) and enc.layers[0].mlp.up_proj.compute == "dequant"
    assert isinstance(enc.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert isinstance(enc.layers[1].self_attn.q_proj, fp8.FP8Linear)
    ids = torch.randint(0, 151936, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 25:] = 0
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        want = torch.cat([out.hidden_states[k] for k in (9, 18, 27)], dim=-1)
        got = enc(ids, mask)
    assert rel_l2(got, want) < 1e-4


UNSUPPORTED = ["nvfp4", "mxfp8", "int8_tensorwise", "convrot_w4a4", "w4a8", "float4_mystery"]


@pytest.mark.parametrize("fmt", UNSUPPORTED)
@pytest.mark.parametrize("marking", ["metadata", "comfy_quant"])
def test_unsupported_formats_are_refused_from_the_header(transformer_ref, tmp_path, fmt, marking):
    _, bfl = transformer_ref["float8_e4m3fn"]
    tensors, meta = quantize_fp8(bfl, marking=marking, layers=lambda k: "single_blocks.1.linear2" in k)
    layer = "single_blocks.1.linear2"
    tensors[layer + ".weight"] = torch.zeros(tensors[layer + ".weight"].shape, dtype=torch.uint8)
    conf = {"format": fmt}
    if fmt == "int8_tensorwise":
        conf |= {"convrot": True, "convrot_groupsize": 256}
        tensors[layer + ".weight"] = tensors[layer + ".weight"].to(torch.int8)
    if marking == "metadata":
        meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {layer: conf}})}
    else:
        tensors[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    path = save(tensors, tmp_path / "weird-fp4.safetensors", metadata=meta)
    msg = rf"weird-fp4\.safetensors: layer single_blocks\.1\.linear2: it is quantised as '{fmt}', which vramgraph " \
          "does not run"
    with pytest.raises(CheckpointError, match=msg):
        loading.inspect(path)
    with pytest.raises(CheckpointError, match=msg):  # and the loader, on its own, before reading any weight
        flux2.load_transformer(strip_prefix(read_header(path)[0], flux2.BFL_PREFIXES))


def test_other_refusals(transformer_ref, tmp_path):
    _, bfl = transformer_ref["float8_e4m3fn"]
    tensors, meta = quantize_fp8(bfl, layers=lambda k: k == "img_in.weight")
    tensors["img_in.weight_scale"] = torch.ones(256)  # per-channel: not what we (or ComfyUI's fp8 GEMM) run
    path = save(tensors, tmp_path / "perchannel.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=r"perchannel\.safetensors: layer img_in: its weight_scale has shape "
                                              r"\[256\]; only per-tensor"):
        loading.inspect(path)
    tensors, meta = quantize_fp8(bfl, layers=lambda k: k == "img_in.weight")
    tensors["img_in.weight"] = bfl["img_in.weight"].to(torch.bfloat16)
    path = save(tensors, tmp_path / "liar.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match="layer img_in: it is marked float8_e4m3fn but its weight is stored as "
                                              "BF16"):
        loading.inspect(path)
    tensors, _ = quantize_fp8(bfl, layers=lambda k: k == "img_in.weight")
    path = save(tensors, tmp_path / "badjson.safetensors", metadata={"_quantization_metadata": "{not json"})
    with pytest.raises(CheckpointError, match=r"badjson\.safetensors: its _quantization_metadata is not JSON"):
        loading.inspect(path)


def test_legacy_scaled_fp8_rules(transformer_ref, tmp_path):
    """ComfyUI's conversion: scale_weight -> weight_scale with format float8_e4m3fn, scale_input -> input_scale, a
    two-element marker means full_precision_matrix_mult; ignored when _quantization_metadata is present."""
    from vramgraph.models.common import infos_from_state_dict

    _, bfl = transformer_ref["float8_e4m3fn"]
    tensors, _ = quantize_fp8(bfl, marking="scaled_fp8", input_scale=0.5, layers=lambda k: "linear1" in k,
                              prefix="model.diffusion_model.")
    tensors["scaled_fp8"] = tensors.pop("model.diffusion_model.scaled_fp8")  # a marker outside the prefix is fine
    infos = strip_prefix(infos_from_state_dict(tensors), flux2.BFL_PREFIXES)
    assert "scaled_fp8" in infos and "single_blocks.0.linear1.weight" in infos
    layers = quant_layers(infos)
    q = layers["single_blocks.0.linear1.weight"]
    assert (q.format, q.marking, q.weight_scale, q.input_scale, q.full_precision) == \
        ("float8_e4m3fn", "scaled_fp8", "single_blocks.0.linear1.scale_weight", "single_blocks.0.linear1.scale_input",
         False)
    tensors["scaled_fp8"] = torch.empty(2, dtype=torch.float8_e4m3fn)
    assert quant_layers(infos_from_state_dict(tensors))[
        "model.diffusion_model.single_blocks.0.linear1.weight"].full_precision
    model = flux2.load_transformer(infos, dtype=torch.float32)
    lin = model.single_blocks[0].linear1
    assert isinstance(lin, fp8.FP8Linear) and float(lin.input_scale) == 0.5
    path = save(tensors, tmp_path / "both.safetensors", metadata={"_quantization_metadata": json.dumps(
        {"format_version": "1.0", "layers": {}})})
    q = quant_layers(read_header(path)[0])["model.diffusion_model.single_blocks.0.linear1.weight"]
    assert (q.marking, q.weight_scale) == ("unmarked", None)  # as in ComfyUI: cast as stored, the scale unused


def test_inspect_prints_dtype_mix_and_real_bytes(transformer_ref, tmp_path):
    _, bfl = transformer_ref["float8_e4m3fn"]
    tensors, meta = quantize_fp8({k: v.to(torch.bfloat16) for k, v in bfl.items()}, layers=lambda k: "_blocks." in k,
                                 prefix="model.diffusion_model.")
    path = save(tensors, tmp_path / "diffusion_models" / "flux-2-klein-4b-fp8.safetensors", metadata=meta)
    out = subprocess.run([sys.executable, "-m", "vramgraph", "inspect", str(path)], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent)
    tr = json.loads(out.stdout)["transformer"]
    spec = loading.inspect(path).transformer
    assert tr["dtype"] == "f8_e4m3" and tr["quantized_layers"] == spec.quant_layers > 0
    assert tr["dtype_mix"] == {"F8_E4M3": dict(spec.dtype_mix)["F8_E4M3"], "BF16": dict(spec.dtype_mix)["BF16"],
                               "F32": dict(spec.dtype_mix)["F32"]}
    assert tr["bytes"] == spec.nbytes("bf16") == sum(tr["dtype_mix"].values())
    assert tr["bytes"] < spec.params * 2


@pytest.mark.gpu
@pytest.mark.parametrize("input_scale", [None, 0.05])
def test_scaled_mm_close_to_dequant_on_gpu(transformer_ref, tmp_path, input_scale):
    """torch._scaled_mm (activations quantised to e4m3, static input scale) against dequantize-then-bf16-matmul, on
    the same fp8 file; the bound is fp8 activation rounding (about 2^-4 relative per element) through 3 blocks.
    Measured on the H200: 0.0377 (no input scale) and 0.0381 (0.05) (bench/results/gpu-tests-fp8.txt); bound 0.08."""
    _, bfl = transformer_ref["float8_e4m3fn"]
    tensors, meta = quantize_fp8(bfl, input_scale=input_scale)
    path = save(tensors, tmp_path / "t.safetensors", metadata=meta)
    spec = loading.inspect(path).transformer
    dev = torch.device("cuda")
    if not fp8.fp8_matmul_supported(dev):
        pytest.skip("this GPU has no fp8 matmul (compute capability < 8.9)")
    img, ctx, ids, n = _inputs()
    rope = flux2.rope_table(spec.config, torch.cat([flux2.text_ids(ctx.shape[1]), ids]), dev)
    outs = {}
    for compute in fp8.COMPUTES:
        model = loading.load(spec, dtype=torch.bfloat16, device=dev, fp8_compute=compute)
        with torch.no_grad():
            outs[compute] = model(img.to(dev), ctx.to(dev), torch.tensor([0.9, 0.35], device=dev), rope, n).float()
    err = rel_l2(outs["scaled_mm"], outs["dequant"])
    print(f"scaled_mm vs dequant rel-L2 (input_scale={input_scale}): {err:.4f}")
    assert 0 < err < 0.08


def test_tiny_models_written_in_fp8_generate(tmp_path):
    """`write_tiny_models(quantize=...)`: the fp8 transformer and the fp8mixed encoder under the templates' names
    are recognised by their headers, sized by their real bytes, and a picture comes out."""
    from vramgraph.models.pipeline import generate, load_models
    from vramgraph.models.tiny import write_tiny_models

    names = {"transformer": "flux-2-klein-4b-fp8.safetensors", "text_encoder": "qwen_3_8b_fp8mixed.safetensors"}
    models = write_tiny_models(tmp_path / "models", names=names, quantize={
        names["transformer"]: {"marking": "scaled_fp8", "prefix": "model.diffusion_model."},
        names["text_encoder"]: {"marking": "comfy_quant", "layers": lambda k: ".mlp." in k}})
    spec = loading.inspect(models)
    assert spec.transformer.quant_layers > 0 and spec.text_encoder.quant_layers == 27 * 3
    assert spec.transformer.nbytes("bf16") < spec.transformer.params * 2
    img = generate(load_models(models, dtype=torch.float32), ["a kite"], width=64, height=48, seed=1)
    assert img.shape[-2:] == (48, 64) and torch.isfinite(img).all()


def test_engine_plans_real_bytes_runs_fp8_and_refuses_nvfp4_at_validation(input_dir, tmp_path):
    """The shipped text-to-image workflow on an fp8 transformer and an fp8mixed encoder: the plan sizes them by their
    stored bytes and the prompt runs; a transformer with an nvfp4 layer is refused at validation, on the loader
    node's input, with the file, the layer and the format."""
    from test_engine import folders_for, shipped
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.graph.workflow.errors import ValidationFailed
    from vramgraph.models.tiny import write_tiny_models

    names = {"transformer": "flux-2-klein-4b.safetensors", "text_encoder": "qwen_3_4b.safetensors",
             "vae": "flux2-vae.safetensors"}
    models = write_tiny_models(tmp_path / "models", names=names, quantize={
        names["transformer"]: {"prefix": "model.diffusion_model.", "input_scale": 1.0},
        names["text_encoder"]: {"marking": "comfy_quant", "layers": lambda k: ".layers.1" in k}})
    engine = Engine(folders_for(models, input_dir, tmp_path), device="cpu")
    prompt = shipped("text_to_image")
    sizes = {m.label: m.nbytes for m in engine.prepare(prompt).plan.models.values()}
    spec = loading.inspect(models)
    assert sizes["transformer"] == spec.transformer.nbytes("fp32") < spec.transformer.params * 4  # CPU runs fp32
    assert sizes["text encoder"] == spec.text_encoder.nbytes("fp32") < spec.text_encoder.params * 4
    assert len(engine.run(prompt).images) == 1
    path = models / "diffusion_models" / names["transformer"]
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {
        "model.diffusion_model.double_blocks.0.img_mlp.0": {"format": "nvfp4"}}})}
    save(tensors, path, metadata=meta)
    with pytest.raises(ValidationFailed) as info:  # from the header, at validation: nothing runs
        Engine(folders_for(models, input_dir, tmp_path), device="cpu").prepare(prompt)
    (err,) = info.value.response["node_errors"]["1"]["errors"]
    assert err["type"] == "custom_validation_failed" and err["extra_info"]["input_name"] == "file"
    assert re.match(r"file - flux-2-klein-4b\.safetensors: layer double_blocks\.0\.img_mlp\.0: it is quantised as "
                    "'nvfp4'", err["details"])


# --------------------------------------------- refused at validation: vramgraph validate, POST /prompt, the engine

CORE_NAMES = {"transformer": "flux-2-klein-4b.safetensors", "text_encoder": "qwen_3_4b.safetensors",
              "vae": "flux2-vae.safetensors"}
# (loader node of the core graph, its input, folder, file written, format, marking)
REFUSED = [("1", "unet_name", "diffusion_models", "klein-nvfp4.safetensors", "nvfp4", "metadata"),
           ("1", "unet_name", "diffusion_models", "klein-w4a8.safetensors", "w4a8", "comfy_quant"),
           ("2", "clip_name", "text_encoders", "qwen-mxfp8.safetensors", "mxfp8", "comfy_quant"),
           ("3", "vae_name", "vae", "vae-convrot.safetensors", "convrot_w4a4", "metadata")]


@pytest.fixture(scope="module")
def refused_models(tmp_path_factory):
    """Tiny models under the core graph's names (the transformer in fp8, a file we run) and, beside them, copies
    with one layer marked in a format we do not run; returns (models folder, {file: its marked layer, as messages
    name it: without the transformer's prefix})."""
    from safetensors.torch import load_file
    from vramgraph.models.tiny import write_tiny_models

    models = write_tiny_models(tmp_path_factory.mktemp("refused") / "models", names=CORE_NAMES, quantize={
        CORE_NAMES["transformer"]: {"prefix": "model.diffusion_model.", "input_scale": 1.0}})
    sources = {"diffusion_models": CORE_NAMES["transformer"], "text_encoders": CORE_NAMES["text_encoder"],
               "vae": CORE_NAMES["vae"]}
    layers = {}
    for _, _, folder, name, fmt, marking in REFUSED:
        tensors = load_file(str(models / folder / sources[folder]))
        layer = next(k for k, v in tensors.items() if k.endswith(".weight") and v.ndim >= 2).removesuffix(".weight")
        conf = {"format": fmt}
        meta = {}
        if marking == "metadata":
            meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {layer: conf}})}
        else:
            tensors[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        save(tensors, models / folder / name, metadata=meta)
        layers[name] = next((layer.removeprefix(p) for p in flux2.BFL_PREFIXES if layer.startswith(p)), layer)
    return models, layers


def _core_graph(node: str | None = None, input_name: str | None = None, name: str | None = None) -> dict:
    from test_engine import core_text_to_image

    g = core_text_to_image("a kite", seed=1, steps=1)
    if node is not None:
        g[node]["inputs"][input_name] = name
    return g


def _refusal(name: str, layer: str, fmt: str) -> str:
    return f"{name}: layer {layer}: it is quantised as '{fmt}', which vramgraph does not run"


@pytest.mark.parametrize(("node", "input_name", "folder", "name", "fmt", "marking"), REFUSED)
def test_unrun_formats_are_refused_at_validation(refused_models, input_dir, tmp_path, node, input_name, folder, name,
                                                 fmt, marking):
    """validate() answers ComfyUI's /prompt error for the loader node's file input, naming the file, the layer and
    the format; the same graph on the files we run (an fp8 transformer) validates."""
    from test_engine import folders_for
    from vramgraph.graph.workflow.validate import validate
    from vramgraph.nodes import ENGINE_NODES

    models, layers = refused_models
    folders = folders_for(models, input_dir, tmp_path)
    assert validate(_core_graph(), ENGINE_NODES, folders).ok
    check = validate(_core_graph(node, input_name, name), ENGINE_NODES, folders)
    assert not check.ok
    response = check.response()
    assert response["error"]["type"] == "prompt_outputs_failed_validation"
    assert list(response["node_errors"]) == [node]
    (err,) = response["node_errors"][node]["errors"]
    assert err["type"] == "custom_validation_failed" and err["extra_info"]["input_name"] == input_name
    assert err["details"].startswith(f"{input_name} - " + _refusal(name, layers[name], fmt))


def test_unmarked_integer_weights_are_refused_at_validation(refused_models, input_dir, tmp_path):
    """check_weights' other header refusal, a weight stored as an integer that no marking names, is a validation
    error too (on the VAE's loader), naming the tensor, the file and its dtype."""
    from safetensors.torch import load_file
    from test_engine import folders_for
    from vramgraph.graph.workflow.validate import validate
    from vramgraph.nodes import ENGINE_NODES

    models, _ = refused_models
    tensors = load_file(str(models / "vae" / CORE_NAMES["vae"]))
    key = next(k for k, v in tensors.items() if k.endswith(".weight") and v.ndim == 4)
    tensors[key] = tensors[key].to(torch.int8)
    save(tensors, models / "vae" / "vae-int8.safetensors")
    check = validate(_core_graph("3", "vae_name", "vae-int8.safetensors"), ENGINE_NODES,
                     folders_for(models, input_dir, tmp_path))
    (err,) = check.response()["node_errors"]["3"]["errors"]
    assert err["extra_info"]["input_name"] == "vae_name"
    assert f"{key} in vae-int8.safetensors is stored as I8 and is not marked as a quantised layer" in err["details"]


def test_vramgraph_validate_refuses_from_the_header(refused_models, input_dir, tmp_path):
    """`vramgraph validate` exits 1 with the file, the layer and the format; a graph on our fp8 file exits 0."""
    models, layers = refused_models
    name = "klein-nvfp4.safetensors"
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_core_graph()))
    bad.write_text(json.dumps(_core_graph("1", "unet_name", name)))
    cmd = [sys.executable, "-m", "vramgraph", "validate", "--models", str(models), "--input", str(input_dir)]
    ok = subprocess.run([*cmd, str(good)], capture_output=True, text=True, cwd=Path(__file__).parent)
    assert ok.returncode == 0, ok.stderr
    out = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, cwd=Path(__file__).parent)
    assert out.returncode == 1
    assert f"node 1 (UNETLoader): unet_name - {_refusal(name, layers[name], 'nvfp4')}" in out.stderr
    assert "[custom_validation_failed]" in out.stderr


def test_server_prompt_refuses_from_the_header(refused_models, input_dir, tmp_path):
    """POST /prompt answers 400 with ComfyUI's node_errors on the loader's input; nothing is queued."""
    import requests
    from test_engine import folders_for
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.server.app import ServerThread, make_app

    models, layers = refused_models
    name = "qwen-mxfp8.safetensors"
    with ServerThread(make_app(Engine(folders_for(models, input_dir, tmp_path), device="cpu"),
                               start_worker=False)) as srv:
        r = requests.post(srv.url + "/prompt", json={"prompt": _core_graph("2", "clip_name", name)}, timeout=60)
        assert r.status_code == 400
        body = r.json()
        assert body["error"]["type"] == "prompt_outputs_failed_validation"
        entry = body["node_errors"]["2"]
        assert entry["class_type"] == "CLIPLoader" and entry["dependent_outputs"]
        (err,) = entry["errors"]
        assert err["extra_info"]["input_name"] == "clip_name"
        assert _refusal(name, layers[name], "mxfp8") in err["details"]
        assert requests.get(srv.url + "/queue", timeout=10).json()["queue_pending"] == []
        ok = requests.post(srv.url + "/prompt", json={"prompt": _core_graph()}, timeout=60)
        assert ok.status_code == 200, ok.text
