"""GGUF files (models/gguf.py, gguf_dequant.py, gguf_layers.py): every GGML type we run dequantizes bit for bit as
the `gguf` package's numpy code does on the same bytes; tiny transformers and text encoders written with gguf's
writer are recognised, sized at their stored bytes, keep their blocks in memory and compute exactly what the same
model computes on the dequantized weights; damaged or foreign files are refused from the header, naming the file."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, quants
from helpers import save
from test_flux2 import _inputs
from vramgraph.models import flux2, loading
from vramgraph.models.dtypes import GGML_BLOCKS
from vramgraph.models.flux2 import Flux2Transformer
from vramgraph.models.gguf import GGUFError
from vramgraph.models.gguf_dequant import dequantize
from vramgraph.models.gguf_layers import GGUFEmbedding, GGUFLinear, read_stored
from vramgraph.models.gguf_write import random_blocks, write_gguf
from vramgraph.models.headers import CheckpointError, read_header
from vramgraph.models.qwen3 import Qwen3Encoder
from vramgraph.models.tiny import TINY_QWEN3, TINY_TRANSFORMER
from vramgraph.nodes.catalog import ModelCatalog

TYPES = (*GGML_BLOCKS, "F32", "F16", "BF16")
# a Qwen3 whose rows are whole K-quant blocks (256 wide); 27 layers, as the encoder's hidden states need
QWEN3_256 = dataclasses.replace(TINY_QWEN3, hidden_size=256, intermediate_size=256, num_heads=2, num_kv_heads=1,
                                head_dim=128)


def _one_tensor_file(path, kind, rows=8, cols=512, seed=0):
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "flux")
    if kind in GGML_BLOCKS and kind.endswith("_K"):
        data, qt = random_blocks(kind, rows, cols, rng), T[kind]
    elif kind in ("F32", "F16"):
        data, qt = rng.standard_normal((rows, cols)).astype(np.float32 if kind == "F32" else np.float16), T[kind]
    else:
        data, qt = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), T[kind]), T[kind]
    w.add_tensor("w.weight", data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", TYPES)
def test_torch_dequantization_equals_gguf_numpy(tmp_path, kind):
    """Read with our header reader, dequantized by torch, against gguf's reader and numpy dequantizer: equal bits."""
    path = _one_tensor_file(tmp_path / f"{kind}.gguf", kind)
    infos, meta = read_header(path)
    info = infos["w.weight"]
    assert info.dtype == kind and info.shape == (8, 512) and meta["gguf.types"] == f"{kind}:1"
    (t,) = GGUFReader(path).tensors
    want = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).reshape(8, 512).astype(np.float32))
    got = dequantize(read_stored(info), kind, info.shape)
    assert got.dtype == torch.float32 and torch.isfinite(want).all()
    assert torch.equal(got, want)
    if kind in GGML_BLOCKS:  # chunked into the compute dtype: the same values, rounded once
        half = dequantize(read_stored(info).clone(), kind, info.shape, torch.bfloat16, chunk_elements=3 * 256)
        assert torch.equal(half, want.to(torch.bfloat16))


def _transformer_sd(seed=3):
    torch.manual_seed(seed)
    model = Flux2Transformer(TINY_TRANSFORMER)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return {"model.diffusion_model." + k: v for k, v in model.state_dict().items()}


def _run_transformer(model):
    img, ctx, ids, n = _inputs()
    rope = flux2.rope_table(model.cfg, torch.cat([flux2.text_ids(ctx.shape[1]), ids]))
    with torch.no_grad():
        return model(img, ctx, torch.tensor([0.9, 0.35]), rope, n)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_1", "Q2_K", "Q4_K", "Q5_K", "Q6_K"])
def test_transformer_runs_on_its_blocks_as_on_the_dequantized_weights(tmp_path, kind):
    sd = _transformer_sd()
    held = write_gguf(tmp_path / "diffusion_models" / f"flux-2-klein-4b-{kind}.gguf", sd, kind)
    spec = loading.inspect(tmp_path / "diffusion_models" / f"flux-2-klein-4b-{kind}.gguf").transformer
    plain = save(held, tmp_path / "plain.safetensors")
    ref_spec = loading.inspect(plain).transformer
    assert spec.config == ref_spec.config and spec.params == ref_spec.params
    quantized = {k.removeprefix("model.diffusion_model.") for k, v in sd.items()
                 if v.ndim == 2 and v.shape[1] % GGML_BLOCKS[kind][0] == 0}
    assert spec.quant_layers == len(quantized) > 0
    infos = spec.infos
    stored = sum(infos[k].nbytes for k in quantized)
    assert dict(spec.dtype_mix)[kind] == stored
    rest = spec.params - sum(infos[k].shape[0] * infos[k].shape[1] for k in quantized)
    assert spec.nbytes("bf16") == stored + 2 * rest  # the planner's bytes: blocks as stored, the rest in bf16
    assert sum(spec.block_bytes("bf16").values()) == spec.nbytes("bf16")
    model = loading.load(spec, dtype=torch.float32)
    qkv = model.double_blocks[0].img_attn.qkv
    assert isinstance(qkv, GGUFLinear) and qkv.weight.dtype == torch.uint8 and qkv.kind == kind
    assert qkv.weight.numel() == infos["double_blocks.0.img_attn.qkv.weight"].nbytes  # the file's bytes, kept
    ref = loading.load(ref_spec, dtype=torch.float32)
    got, want = _run_transformer(model), _run_transformer(ref)
    assert torch.isfinite(want).all() and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    bf = loading.load(spec, dtype=torch.bfloat16)  # bf16 compute: the blocks stay bytes, norms are cast
    assert bf.double_blocks[0].img_attn.qkv.weight.dtype == torch.uint8
    assert bf.double_blocks[0].img_attn.norm.query_norm.scale.dtype == torch.bfloat16


def _encoder_sd(cfg, seed=5):
    torch.manual_seed(seed)
    model = Qwen3Encoder(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return {"model." + k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("kind", "cfg"), [("Q8_0", TINY_QWEN3), ("Q4_K", QWEN3_256), ("Q3_K", QWEN3_256)])
def test_llama_cpp_text_encoder_runs_as_on_the_dequantized_weights(tmp_path, kind, cfg, caplog):
    """A llama.cpp Qwen3 file (blk.N.attn_q.weight, token_embd.weight) without tokenizer metadata: recognised, its
    embedding table kept in blocks (rows dequantized as looked up), same hidden states as the plain model."""
    sd = _encoder_sd(cfg)
    path = tmp_path / "text_encoders" / f"Qwen3-4B-{kind}.gguf"
    held = write_gguf(path, sd, kind, arch="qwen3", llama_names=True, tokenizer=False)
    infos, meta = read_header(path)
    assert "model.layers.0.self_attn.q_proj.weight" in infos and meta["gguf.tokenizer"] == "absent"
    with caplog.at_level("INFO"):
        spec = loading.inspect(path)
        assert caplog.text == ""  # validation inspects the file at every prompt: the note is said where it loads
        catalog = ModelCatalog()
        for _ in range(2):
            catalog.info_at("text_encoder", path)
    assert caplog.text.count("no tokenizer metadata; the Qwen3 tokenizer shipped with vramgraph is used") == 1
    te = spec.text_encoder
    plain = loading.inspect(save(held, tmp_path / "plain.safetensors")).text_encoder
    assert te is not None and te.config == plain.config
    model = loading.load(te, dtype=torch.float32)
    assert isinstance(model.embed_tokens, GGUFEmbedding) and model.embed_tokens.weight.dtype == torch.uint8
    ref = loading.load(plain, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        got, want = model(ids, mask), ref(ids, mask)
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    assert torch.isfinite(want).all() and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def _write_header_only(path, arch, tensors, tokenizer_pre=None):
    w = GGUFWriter(str(path), arch)
    if tokenizer_pre:
        w.add_tokenizer_pre(tokenizer_pre)
    for name, data, qt in tensors:
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_damaged_and_foreign_files_are_refused_naming_the_file(tmp_path):
    sd = _transformer_sd()
    good = tmp_path / "good.gguf"
    write_gguf(good, sd, "Q8_0")
    raw = good.read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(raw[: len(raw) - 5000])
    with pytest.raises(CheckpointError, match=r"truncated\.gguf.*(truncated|damaged|incomplete)"):
        loading.inspect(cut)
    # a header whose first tensor claims twice its rows: its bytes run into the next tensor's
    reader = GGUFReader(good)
    t = reader.tensors[0]
    dims_at = next(int(p.ctypes.data - np.frombuffer(reader.data, np.uint8).ctypes.data) for p in t.field.parts
                   if p is t.field.parts[3])
    lying = bytearray(raw)
    n = len(t.shape)
    last = dims_at + 8 * (n - 1)
    lying[last:last + 8] = struct.pack("<Q", int(t.shape[-1]) * 2)
    (tmp_path / "lying.gguf").write_bytes(bytes(lying))
    with pytest.raises(CheckpointError, match=r"lying\.gguf.*(claims|ends at)"):
        loading.inspect(tmp_path / "lying.gguf")
    f32 = np.zeros((4, 64), np.float32)
    other = _write_header_only(tmp_path / "wan.gguf", "wan", [("x.weight", f32, T.F32)])
    with pytest.raises(GGUFError, match=r"wan\.gguf.*architecture 'wan'"):
        read_header(other)
    iq = _write_header_only(tmp_path / "iq.gguf", "flux", [("double_blocks.0.img_attn.qkv.weight",
                                                               np.zeros((4, 2 * 18), np.uint8), T.IQ4_NL)])
    with pytest.raises(GGUFError, match=r"iq\.gguf: tensor double_blocks\.0\.img_attn\.qkv\.weight is stored as "
                                        r"IQ4_NL"):
        read_header(iq)
    gemma = _write_header_only(tmp_path / "gemma.gguf", "qwen3", [("blk.0.attn_q.weight", f32, T.F32)],
                               tokenizer_pre="gemma")
    with pytest.raises(GGUFError, match=r"gemma\.gguf: its tokenizer is 'gemma'"):
        read_header(gemma)
    (tmp_path / "magic.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(GGUFError, match=r"magic\.gguf: not a readable GGUF file"):
        read_header(tmp_path / "magic.gguf")


def test_header_walk_matches_gguf_reader(tmp_path):
    """models/gguf_header.py against the `gguf` package's GGUFReader on the same file: a text encoder's header with a
    tokenizer (arrays of strings and numbers skipped, not read), scalars of every width, a comfy.gguf.orig_shape
    list and mixed tensor types; every tensor's name, dimensions, type and absolute offset agree."""
    from vramgraph.models.gguf_header import read_gguf_header

    path = tmp_path / "te.gguf"
    w = GGUFWriter(str(path), "qwen3")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"tok{i}" for i in range(5000)])
    w.add_token_types([1] * 5000)
    w.add_token_merges([f"a{i} b{i}" for i in range(4000)])
    w.add_uint8("t.u8", 7)
    w.add_int64("t.i64", -5)
    w.add_float64("t.f64", 0.25)
    w.add_bool("t.bool", True)
    w.add_array("comfy.gguf.orig_shape.blk.1.attn_norm.weight", [8, 4])
    rng = np.random.default_rng(0)
    w.add_tensor("blk.0.attn_q.weight", random_blocks("Q4_K", 4, 256, rng), raw_dtype=T.Q4_K)
    w.add_tensor("blk.1.attn_norm.weight", np.ones(32, np.float32))
    w.add_tensor("token_embd.weight", quants.quantize(np.ones((6, 64), np.float32), T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    head = read_gguf_header(path)
    reader = GGUFReader(path)
    assert [(t.name, t.dims, t.type_code, t.offset) for t in head.tensors] == \
        [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    assert head.data_offset == reader.data_offset
    assert head.metadata["general.architecture"] == "qwen3" and head.metadata["t.i64"] == -5
    assert head.metadata["t.u8"] == 7 and head.metadata["t.f64"] == 0.25 and head.metadata["t.bool"] is True
    assert head.metadata["tokenizer.ggml.tokens"] == ("array", 8, 5000)
    assert set(head.metadata) == set(reader.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    infos, meta = read_header(path)
    assert infos["model.layers.1.input_layernorm.weight"].shape == (8, 4)  # the orig_shape, not (32,)
    assert infos["model.embed_tokens.weight"].dtype == "Q8_0" and meta["gguf.tokenizer"] == "present"
    assert meta["gguf.types"] == "Q4_K:1,F32:1,Q8_0:1"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", TYPES)
def test_cuda_dequantization_equals_gguf_numpy(tmp_path, kind):
    """On the GPU, where the runtime dequantizes: the same bits as the `gguf` package's numpy code."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = _one_tensor_file(tmp_path / f"{kind}.gguf", kind, rows=64, cols=1024)
    info = read_header(path)[0]["w.weight"]
    (t,) = GGUFReader(path).tensors
    want = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).reshape(64, 1024).astype(np.float32))
    raw = read_stored(info).to("cuda")
    assert torch.equal(dequantize(raw, kind, info.shape).cpu(), want)
    assert torch.equal(dequantize(raw, kind, info.shape, torch.bfloat16, chunk_elements=4096).cpu(),
                       want.to(torch.bfloat16))


def test_transient_counts_the_largest_linear_not_the_embedding_table(tmp_path):
    """The text encoder's quantized embedding table dequantizes only the rows a prompt looks up, so the estimate's
    just-in-time transient is its largest linear's, not the 151,936-row table's."""
    sd = _encoder_sd(TINY_QWEN3)
    path = tmp_path / "te-Q8_0.gguf"
    write_gguf(path, sd, "Q8_0", arch="qwen3", llama_names=True)
    te = loading.inspect(path).text_encoder
    linears = [v.numel() for k, v in sd.items() if v.ndim == 2 and "embed_tokens" not in k]
    assert te.quant_largest == max(linears) < sd["model.embed_tokens.weight"].numel()
