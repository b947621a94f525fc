"""LoRA files: recognised from their keys in every style ComfyUI maps for FLUX.2 and Qwen3, refused otherwise; the
adapter math (LoRA, DoRA, LoHa, LoKr) merged and on the fly equals the reference formulas to fp32 tolerance."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from safetensors.torch import load_file
from vramgraph.models import flux2_config, lora, lora_format
from vramgraph.models.flux2 import Flux2Transformer
from vramgraph.models.headers import Source
from vramgraph.models.lora_make import text_encoder_modules, transformer_modules, write_lora
from vramgraph.models.qwen3 import Qwen3Encoder
from vramgraph.models.tiny import TINY_QWEN3, TINY_TRANSFORMER

CFG = dataclasses.replace(TINY_TRANSFORMER, hidden=64, heads=2, head_dim=32, context_dim=96, rope_axes=(8, 8, 8, 8))
TE = dataclasses.replace(TINY_QWEN3, hidden_size=32, intermediate_size=48, num_heads=2, num_kv_heads=1, head_dim=16,
                         output_layers=(1, 2, 3), num_layers=4)


def _model(seed: int = 0) -> Flux2Transformer:
    torch.manual_seed(seed)
    return Flux2Transformer(CFG).float().eval()


def _inputs() -> tuple:
    from vramgraph.models.flux2 import image_ids, rope_table, text_ids

    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(1, 16, CFG.in_channels, generator=g), torch.randn(1, 5, CFG.context_dim, generator=g)
    rope = rope_table(CFG, torch.cat([text_ids(5), image_ids(4, 4)]))
    return img, txt, torch.tensor([0.7]), rope


# ---------------------------------------------------------------------------- reference formulas (ComfyUI's math)


def ref_delta(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """dW of module `name` in a file's tensors, written out from comfy/weight_adapter/*.py's formulas."""
    g = {k[len(name) + 1:]: v.double() for k, v in t.items() if k.startswith(name + ".")}
    alpha = g.get("alpha")
    if "hada_w1_a" in g:
        dw, rank = (g["hada_w1_a"] @ g["hada_w1_b"]) * (g["hada_w2_a"] @ g["hada_w2_b"]), g["hada_w1_b"].shape[0]
    elif "lokr_w1" in g or "lokr_w1_a" in g:
        rank = None
        w1 = g["lokr_w1"] if "lokr_w1" in g else g["lokr_w1_a"] @ g["lokr_w1_b"]
        if "lokr_w1_b" in g:
            rank = g["lokr_w1_b"].shape[0]
        w2 = g["lokr_w2"] if "lokr_w2" in g else g["lokr_w2_a"] @ g["lokr_w2_b"]
        if "lokr_w2_b" in g:
            rank = g["lokr_w2_b"].shape[0]
        dw = torch.kron(w1, w2)
        return dw * (float(alpha) / rank if alpha is not None and rank else 1.0)
    else:
        up = g.get("lora_up.weight", g.get("lora_B.weight"))
        down = g.get("lora_down.weight", g.get("lora_A.weight"))
        dw, rank = up @ down, down.shape[0]
    return dw * (float(alpha) / rank if alpha is not None else 1.0)


def ref_merge(w: torch.Tensor, t: dict, name: str, strength: float) -> torch.Tensor:
    dw = ref_delta(t, name)
    w = w.double()
    if f"{name}.dora_scale" not in t:
        return w + strength * dw
    d = t[f"{name}.dora_scale"].double()
    wc = w + dw
    norm = wc.norm(dim=0, keepdim=True) if d.shape[0] == 1 else wc.norm(dim=1, keepdim=True)
    wd = wc * (d.reshape(1, -1) if d.shape[0] == 1 else d.reshape(-1, 1)) / norm
    return w + strength * (wd - w)


def expected_state(model: torch.nn.Module, path, style: str, strength: float) -> dict[str, torch.Tensor]:
    """The model's weights with the file merged by the reference formula, placed by the checkpoint loader's own
    layout tables (diffusers-named deltas are merged in diffusers' layout and converted as a checkpoint would be)."""
    t = load_file(str(path))
    names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in t}
    names = {n.removesuffix(".lora_A").removesuffix(".lora_B").removesuffix(".lora_up").removesuffix(".lora_down")
             for n in names}
    sd = {k: v.double() for k, v in model.state_dict().items()}
    if style in ("bfl", "kohya", "linear1_qkv"):
        for n in names:
            m = n.removeprefix("diffusion_model.") if style != "kohya" else _kohya_param(n, sd)
            rows = None
            if m.endswith("_qkv"):
                m, rows = m.removesuffix("_qkv"), 3 * CFG.hidden
            w = sd[m + ".weight"]
            part = w[:rows] if rows else w
            part.copy_(ref_merge(part, t, n, strength))
        return sd
    # diffusers names: build the diffusers state dict, merge there, convert back with the loader's Sources
    prefix = {"diffusers": "transformer.", "lycoris": "lycoris_", "onetrainer": "lora_transformer_", "diffsynth": ""}
    srcs = {p: flux2_config._diffusers_source(p) for p in sd if sd[p].ndim == 2}
    dsd: dict[str, torch.Tensor] = {}
    for p, src in srcs.items():
        w = sd[p]
        if src.op == "swap_halves":
            a, b = w.chunk(2, 0)
            w = torch.cat([b, a], 0)
        for k, part in zip(src.keys, w.chunk(len(src.keys), 0), strict=True):
            dsd[k] = part.clone()
    for k in dsd:
        d = k.removesuffix(".weight")
        n = prefix[style] + (d if style in ("diffusers", "diffsynth") else d.replace(".", "_"))
        if n in names:
            dsd[k] = ref_merge(dsd[k], t, n, strength)
    for p, src in srcs.items():
        sd[p] = Source(src.keys, src.op).make(dsd.__getitem__, tuple(sd[p].shape))
    return sd


def _kohya_param(n: str, sd: dict) -> str:
    flat = n.removeprefix("lora_unet_")
    return next(p.removesuffix(".weight") for p in sd if p.removesuffix(".weight").replace(".", "_") == flat)


def _forward(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(*_inputs())


# ---------------------------------------------------------------------------- recognition


@pytest.mark.parametrize("style", ("bfl", "diffusers", "kohya", "lycoris", "onetrainer", "diffsynth", "linear1_qkv"))
def test_every_transformer_style_maps_every_layer(tmp_path, style):
    path = write_lora(tmp_path / f"{style}.safetensors", transformer_modules(CFG, style), rank=4, alpha=2.0)
    lf = lora_format.parse(path, CFG, None)
    assert lf.components == ("transformer",)
    n_modules = len(transformer_modules(CFG, style))
    assert len(lf.component("transformer")) == n_modules
    assert lf.rank == 4 and lf.adapters == ("lora",)


@pytest.mark.parametrize("style", ["comfy_te", "comfy_te_bare", "kohya_te"])
def test_text_encoder_styles(tmp_path, style):
    path = write_lora(tmp_path / "te.safetensors", text_encoder_modules(TE, style), rank=2)
    lf = lora_format.parse(path, CFG, TE)
    assert lf.components == ("text_encoder",)
    assert {t.param for t in lf.component("text_encoder")} == \
        {p for p, s in Qwen3Encoder(TE).state_dict().items() if s.ndim == 2 and not p.startswith("embed")}


def test_a_file_with_both_parts(tmp_path):
    mods = transformer_modules(CFG, "bfl") + text_encoder_modules(TE, "kohya_te")
    path = write_lora(tmp_path / "both.safetensors", mods)
    assert lora_format.parse(path, CFG, TE).components == ("transformer", "text_encoder")
    alone = lora_format.parse(path, CFG, None)  # LoraLoaderModelOnly: the text encoder part set aside, as ComfyUI
    assert alone.components == ("transformer",) and alone.ignored == len(text_encoder_modules(TE, "kohya_te"))
    with pytest.raises(lora_format.LoraError, match=r"transformer's.*LoraLoader"):  # a CLIP-only use has no transformer
        lora_format.parse(write_lora(tmp_path / "k.safetensors", transformer_modules(CFG, "kohya")), None, TE)


@pytest.mark.parametrize(("modules", "said"), [
    ([("diffusion_model.double_blocks.0.img_mod.lin", 6 * 64, 64)], "FLUX.1"),
    ([("lora_unet_down_blocks_0_attentions_0_proj_in", 32, 32)], "Stable Diffusion"),
    ([("diffusion_model.layers.0.attention.qkv", 96, 32)], "Z-Image"),
    ([("something.else", 4, 4)], "unknown key style"),
])
def test_other_models_are_refused_with_what_they_are(tmp_path, modules, said):
    path = write_lora(tmp_path / "other.safetensors", modules)
    with pytest.raises(lora_format.LoraError, match=said) as e:
        lora_format.parse(path, CFG, TE)
    assert str(path) in str(e.value)


def test_a_9b_lora_on_the_4b_model_is_refused(tmp_path):
    big = flux2_config.KLEIN_9B
    mods = [m for m in transformer_modules(big, "bfl") if "double_blocks.0.img_attn.proj" in m[0]]
    path = write_lora(tmp_path / "9b.safetensors", mods)
    with pytest.raises(lora_format.LoraError, match=r"FLUX.2 \[klein\] 9B"):
        lora_format.parse(path, flux2_config.KLEIN_4B, None)


def test_unmatched_keys_are_named(tmp_path):
    mods = [*transformer_modules(CFG, "bfl")[:3], ("diffusion_model.double_blocks.7.img_attn.qkv", 192, 64)]
    path = write_lora(tmp_path / "partial.safetensors", mods)
    with pytest.raises(lora_format.LoraError, match=r"1 of its 4 layers.*double_blocks\.7\.img_attn\.qkv"):
        lora_format.parse(path, CFG, None)


def test_oft_and_bad_files_are_refused(tmp_path):
    from helpers import save

    oft = save({"diffusion_model.double_blocks.0.img_attn.proj.oft_blocks": torch.zeros(4, 16, 16)},
               tmp_path / "oft.safetensors")
    with pytest.raises(lora_format.LoraError, match="OFT"):
        lora_format.parse(oft, CFG, None)
    good = write_lora(tmp_path / "good.safetensors", transformer_modules(CFG, "bfl"))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(lora_format.LoraError, match="ends before"):
        lora_format.parse(cut, CFG, None)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(lora_format.LoraError, match="not a safetensors file"):
        lora_format.parse(junk, CFG, None)
    bad_rank = save({"diffusion_model.img_in.lora_A.weight": torch.zeros(4, CFG.in_channels),
                     "diffusion_model.img_in.lora_B.weight": torch.zeros(CFG.hidden, 3)}, tmp_path / "rank.safetensors")
    with pytest.raises(lora_format.LoraError, match="rank mismatch"):
        lora_format.parse(bad_rank, CFG, None)


def test_nan_weights_are_refused_before_anything_changes(tmp_path):
    from helpers import save

    t = load_file(str(write_lora(tmp_path / "a.safetensors", transformer_modules(CFG, "bfl"))))
    t["diffusion_model.img_in.lora_A.weight"][0, 0] = float("nan")
    path = save(t, tmp_path / "nan.safetensors")
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    use = lora.Use(lora_format.parse(path, CFG, None), "transformer", 1.0)
    with pytest.raises(lora_format.LoraError, match="NaN"), lora.applied(model, [use], "merged"):
        pass
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------- the math


@pytest.mark.parametrize(("style", "kind", "dora"), [
    ("bfl", "lora", False), ("diffusers", "lora", False), ("kohya", "lora", True), ("lycoris", "loha", False),
    ("lycoris", "lokr", False), ("onetrainer", "lora", False), ("diffsynth", "lokr", False),
    ("linear1_qkv", "lora", False), ("bfl", "loha", True)])
def test_merged_and_on_the_fly_equal_the_reference(tmp_path, style, kind, dora):
    path = write_lora(tmp_path / "l.safetensors", transformer_modules(CFG, style), kind=kind, rank=4, alpha=3.0,
                      dtype="float32", dora=dora)
    use = lora.Use(lora_format.parse(path, CFG, None), "transformer", 0.8)
    want = expected_state(_model(), path, style, 0.8)
    model = _model()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    with lora.applied(model, [use], "merged"):
        got = model.state_dict()
        for k, v in want.items():
            torch.testing.assert_close(got[k].double(), v, rtol=1e-5, atol=1e-6)
        merged = _forward(model)
    ref = _model()
    ref.load_state_dict({k: v.float() for k, v in want.items()})
    torch.testing.assert_close(merged, _forward(ref), rtol=1e-4, atol=1e-5)
    with lora.applied(model, [use], "onthefly"):  # undoes the merge first: weights are the base again
        assert all(torch.equal(base[k], v) for k, v in model.state_dict().items())
        fly = _forward(model)
    torch.testing.assert_close(fly, merged, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(fly, _forward(_model()), atol=1e-4)  # the LoRA changed the output


def test_stacked_loras_and_strengths(tmp_path):
    a = write_lora(tmp_path / "a.safetensors", transformer_modules(CFG, "bfl"), dtype="float32", seed=1, alpha=1.0)
    b = write_lora(tmp_path / "b.safetensors", transformer_modules(CFG, "diffusers"), dtype="float32", seed=2)
    ua = lora.Use(lora_format.parse(a, CFG, None), "transformer", 1.0)
    ub = lora.Use(lora_format.parse(b, CFG, None), "transformer", -0.5)
    want = expected_state(_model(), b, "diffusers", -0.5)
    first = expected_state(_model(), a, "bfl", 1.0)
    delta_a = {k: first[k] - _model().state_dict()[k].double() for k in first}
    model = _model()
    with lora.applied(model, [ua, ub], "merged"):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v.double(), want[k] + delta_a[k], rtol=1e-5, atol=1e-6)
        merged = _forward(model)
    with lora.applied(model, [ua, ub], "onthefly"):
        torch.testing.assert_close(_forward(model), merged, rtol=1e-4, atol=1e-5)
    off = lora.Use(ua.file, "transformer", 0.0)
    with lora.applied(model, [off], "merged"):  # strength 0 is off: the base weights
        torch.testing.assert_close(_forward(model), _forward(_model()))


def test_switching_loras_restores_the_base_without_writing_the_host_copy(tmp_path):
    a = write_lora(tmp_path / "a.safetensors", transformer_modules(CFG, "bfl"), seed=1)
    b = write_lora(tmp_path / "b.safetensors", transformer_modules(CFG, "kohya"), seed=2)
    model = _model().to(torch.bfloat16)
    host = {k: v for k, v in model.state_dict().items()}
    saved = {k: v.clone() for k, v in host.items()}
    for path in (a, b, a):
        use = lora.Use(lora_format.parse(path, CFG, None), "transformer", 1.0)
        with lora.applied(model, [use], "merged"):
            assert not torch.equal(model.img_in.weight, saved["img_in.weight"])
    assert all(torch.equal(host[k], saved[k]) for k in host)  # the tensors the host copy holds were never written
    lora.restore(model)
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_text_encoder_lora(tmp_path):
    path = write_lora(tmp_path / "te.safetensors", text_encoder_modules(TE, "kohya_te"), dtype="float32", alpha=1.0)
    use = lora.Use(lora_format.parse(path, None, TE), "text_encoder", 1.2)
    torch.manual_seed(0)
    enc = Qwen3Encoder(TE).float()
    ids, mask = torch.randint(0, TE.vocab_size, (1, 7)), torch.ones(1, 7, dtype=torch.long)
    t = load_file(str(path))
    ref = Qwen3Encoder(TE).float()
    ref.load_state_dict(enc.state_dict())
    with torch.no_grad():
        for p, w in ref.named_parameters():
            n = "lora_te_" + p.removesuffix(".weight").replace(".", "_")
            if f"{n}.lora_down.weight" in t:
                w.copy_(ref_merge(w, t, n, 1.2).float())
        want = ref(ids, mask)
        with lora.applied(enc, [use], "merged"):
            torch.testing.assert_close(enc(ids, mask), want, rtol=1e-4, atol=1e-5)
        with lora.applied(enc, [use], "onthefly"):
            torch.testing.assert_close(enc(ids, mask), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("style", "convert"), [("kohya", "_convert_kohya_flux2_lora_to_diffusers"),
                                                ("bfl", "_convert_non_diffusers_flux2_lora_to_diffusers")])
def test_diffusers_conversion_gives_the_same_weights(tmp_path, style, convert):
    """diffusers' own converters of kohya and BFL/ai-toolkit FLUX.2 LoRAs to its PEFT layout (q/k/v split, alpha
    baked in) are a second reading of the key maps: the converted file, applied by us, changes every weight the same."""
    from diffusers.loaders import lora_conversion_utils as conv
    from helpers import save

    mods = [m for m in transformer_modules(CFG, style) if "blocks" in m[0]]
    path = write_lora(tmp_path / "orig.safetensors", mods, dtype="float32", alpha=2.0 if style == "kohya" else None)
    converted = getattr(conv, convert)(dict(load_file(str(path))))
    conv_path = save({k: v.clone() for k, v in converted.items()}, tmp_path / "converted.safetensors")
    model, other = _model(), _model()
    with lora.applied(model, [lora.Use(lora_format.parse(path, CFG, None), "transformer", 1.0)], "merged"), \
            lora.applied(other, [lora.Use(lora_format.parse(conv_path, CFG, None), "transformer", 1.0)], "merged"):
        changed = 0
        for (k, v), w in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
            torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=k)
            changed += not torch.equal(v, _model().state_dict()[k])
    assert changed == len({m[0].split('_qkv')[0] for m in mods})


def test_the_plan_chooses_merged_or_on_the_fly_and_counts_it():
    """klein-4B at 1024² with two rank-16 LoRAs on every block linear: a 4-step image takes them on the fly (less
    than one merge pass), 50 steps merged; a streamed variant always on the fly; each variant's bytes, seconds and
    note grow by what its way costs."""
    from vramgraph.nodes import estimates
    from vramgraph.nodes.lora import lora_cost, with_lora_costs
    from vramgraph.nodes.types import CondInfo, LatentInfo, LoraRef, ModelInfo

    cfg = flux2_config.KLEIN_4B
    shapes = flux2_config.parameter_shapes(cfg)
    touched = tuple((p, *s) for p, s in shapes.items() if len(s) == 2 and "blocks" in p)
    ref = LoraRef("a.safetensors", 1.0, "", sum((o + i) * 16 * 2 for _, o, i in touched), len(touched), 16, ("lora",),
                  touched)
    plain = ModelInfo("t", "transformer", "transformer", sum(o * i * 2 for _, o, i in touched), cfg)
    model = dataclasses.replace(plain, loras=(ref, ref))
    tokens = 64 * 64 + 512
    one, two = lora_cost(dataclasses.replace(model, loras=(ref,)), tokens, 4), lora_cost(model, tokens, 4)
    assert two.fly_seconds == pytest.approx(2 * one.fly_seconds, rel=0.01) and two.merge_seconds == one.merge_seconds
    assert two.adapter_bytes == 2 * ref.nbytes and two.fly_activation == tokens * (3 * 3072 + 2 * 9216) * 2
    base = estimates.sampling_variants(plain, LatentInfo(1, 64, 64), CondInfo(1, 512), 1, 4)
    for steps, want in ((4, "onthefly"), (50, "merged")):
        got = with_lora_costs(model, base, tokens, steps)
        assert [v.lora_mode for v in got] == [want, "onthefly"]  # gpu, stream
        for v, b in zip(got, base, strict=True):
            assert v.activation > b.activation and v.seconds > b.seconds and "LoRA" in v.note
    assert with_lora_costs(plain, base, tokens, 4) == base
    # a queue planned as one: four 4-step images share one merge, which beats four times on the fly; one does not
    from vramgraph.nodes.lora import share_merges
    from vramgraph.nodes.types import Cost

    one_image = Cost((), with_lora_costs(model, base, tokens, 4))
    queue = share_merges({f"q{i}:11": one_image for i in range(4)})
    assert all([v.lora_mode for v in c.variants] == ["merged", "onthefly"] for c in queue.values())
    assert "shared by 4 nodes" in queue["q0:11"].variants[0].note
    assert share_merges({"11": one_image}) == {"11": one_image}
    # an fp8 checkpoint (BFL's: block linears in fp8): those layers stay on the fly, so nothing is left to merge
    spec = types.SimpleNamespace(quant_blocks=tuple(('.'.join(p.split('.')[:2]), 1, 1) for p, *_ in touched))
    fp8 = dataclasses.replace(model, spec=spec)
    assert [v.lora_mode for v in with_lora_costs(fp8, base, tokens, 50)] == ["onthefly", "onthefly"]
    c = lora_cost(fp8, tokens, 50)
    assert c.merge_seconds == 0 and c.fp8_seconds == pytest.approx(c.fly_seconds)


def test_fp8_layers_and_streamed_blocks_take_loras_on_the_fly(tmp_path):
    """An fp8 model (ComfyUI's per-tensor e4m3 layout): merged mode leaves the fp8 weights as they are and hooks those
    layers, equal to the reference merged into the dequantized weights; a streamed pass with the hooks equals the
    resident one."""
    from vramgraph.models.common import infos_from_state_dict
    from vramgraph.models.flux2 import load_transformer
    from vramgraph.models.streaming import stream_blocks
    from vramgraph.models.tiny import quantize_fp8

    base = _model()
    sd, _ = quantize_fp8(base.state_dict(), layers=lambda k: "_blocks." in k)
    fp8 = load_transformer(infos_from_state_dict(sd), CFG, dtype=torch.float32, fp8_compute="dequant")
    deq = _model()
    with torch.no_grad():
        deq.load_state_dict({k: v.float() for k, v in base.state_dict().items()})
        for name, m in fp8.named_modules():
            if hasattr(m, "dequantized"):
                deq.get_submodule(name).weight.copy_(m.dequantized(torch.float32))
    path = write_lora(tmp_path / "l.safetensors", transformer_modules(CFG, "bfl"), dtype="float32", alpha=2.0)
    use = lora.Use(lora_format.parse(path, CFG, None), "transformer", 1.0)
    want = expected_state(deq, path, "bfl", 1.0)
    ref = _model()
    ref.load_state_dict({k: v.float() for k, v in want.items()})
    stored = {k: v.clone() for k, v in fp8.state_dict().items() if v.dtype == torch.float8_e4m3fn}
    with lora.applied(fp8, [use], "merged"):
        torch.testing.assert_close(_forward(fp8), _forward(ref), rtol=1e-4, atol=1e-4)
        assert all(torch.equal(fp8.state_dict()[k].view(torch.uint8), v.view(torch.uint8)) for k, v in stored.items())
    with lora.applied(fp8, [use], "onthefly"), stream_blocks(fp8, "cpu", resident=(0,)) as m:
        torch.testing.assert_close(_forward(m), _forward(ref), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dora", [False, True])
def test_peft_merges_the_same_weights(dora):
    """PEFT's own LoRA and DoRA layers (the library diffusers applies LoRAs with), merged by PEFT, against ours."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 40, bias=False))
    base = net[0].weight.detach().clone()
    model = get_peft_model(net, LoraConfig(r=4, lora_alpha=6, target_modules=["0"], use_dora=dora,
                                           init_lora_weights=False))
    layer = model.base_model.model[0]
    tensors = {"down": layer.lora_A["default"].weight.detach().clone(),
               "up": layer.lora_B["default"].weight.detach().clone()}
    if dora:
        tensors["dora_scale"] = layer.lora_magnitude_vector["default"].weight.detach().clone()  # (out,)
    x = torch.randn(3, 24)
    with torch.no_grad():
        want_out = model(x)
        want = model.merge_and_unload()[0].weight.detach()
        adapter = lora.Adapter(lora_format.Target("m", "0.weight", "lora", ()), tensors, alpha=6.0)
        torch.testing.assert_close(adapter.merge(base.clone(), 1.0), want, rtol=1e-5, atol=1e-6)
        hooked = torch.nn.Linear(24, 40, bias=False)
        hooked.weight.copy_(base)
        hooked.register_forward_hook(lora._Hook(hooked, [(adapter, 1.0)]))
        torch.testing.assert_close(hooked(x), want_out, rtol=1e-5, atol=1e-5)
