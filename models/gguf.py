"""GGUF files (ComfyUI-GGUF's and llama.cpp's): their tensor tables, read with the `gguf` package, as our headers.

A GGUF file is recognised by its magic bytes, whatever its name; `headers.read_header` hands it here. The tables
it returns are like a safetensors header's: every tensor's name, stored type, shape (in torch's order: GGUF lists
dimensions fastest first) and where its bytes start. The header is walked through a read-only memory map
(models/gguf_header.py; the `gguf` package gives the type codes); tensors are later read byte for byte into place
(models/common.py), never as a whole-file copy.

Conventions followed (those of ComfyUI-GGUF, city96/ComfyUI-GGUF `loader.py`):
- transformers carry `general.architecture` "flux" (ComfyUI-GGUF's name for FLUX-style models, FLUX.2 included)
  and BFL's tensor names, maybe under `model.diffusion_model.`; files without an architecture (stable-diffusion.cpp
  style) are recognised from their tensor names;
- text encoders are llama.cpp files (`general.architecture` "qwen3") whose names (`blk.N.attn_q.weight`,
  `token_embd.weight`, ...) are renamed to Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...). Qwen3's
  q/k rows are stored unpermuted (llama.cpp permutes only "llama" models);
- `comfy.gguf.orig_shape.<tensor>` gives a tensor's shape where the converter reshaped it.

Stored types: F32, F16, BF16 and the block quantisations of dtypes.GGML_BLOCKS (what ComfyUI-GGUF dequantizes);
any other is refused, naming the file, the tensor and the type. A file whose header does not match its size (a
truncated download, a tensor whose declared shape runs over the next one) is refused before anything runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .dtypes import GGML_BLOCKS
from .gguf_header import Header, HeaderError, RawTensor, read_gguf_header
from .headers import CheckpointError, TensorInfo

MAGIC = b"GGUF"
PLAIN_TYPES = ("F32", "F16", "BF16")  # stored like safetensors' dtypes of the same names
SUPPORTED = PLAIN_TYPES + tuple(GGML_BLOCKS)
TRANSFORMER_ARCHES = ("flux",)  # ComfyUI-GGUF's architecture name for FLUX.1/FLUX.2 transformers
TEXT_ARCHES = ("qwen3",)  # llama.cpp's name for Qwen3 (klein's text encoders: Qwen3-4B and Qwen3-8B)
NO_ARCH = ("", "pig", "cow")  # files without a real architecture: recognised from their tensor names
QWEN_TOKENIZERS = ("qwen2",)  # llama.cpp's pre-tokenizer name for Qwen2/Qwen3's BPE
META_KEPT = ("general.architecture", "general.name", "general.type", "general.file_type",
             "tokenizer.ggml.model", "tokenizer.ggml.pre")
# llama.cpp's names of a decoder layer's tensors -> Hugging Face's (the part after `blk.N.` / `model.layers.N.`)
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
MODEL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}


class GGUFError(CheckpointError):
    """A GGUF file we cannot use (damaged, an unknown architecture, a tensor type we do not run)."""


def is_gguf(path: str | Path) -> bool:
    """Whether the file starts with GGUF's magic bytes (False if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def hf_name(name: str) -> str:
    """A llama.cpp tensor name as Hugging Face's ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight');
    other names unchanged."""
    if name in MODEL_NAMES:
        return MODEL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m[2] in LAYER_NAMES:
        return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.{m[3]}"
    return name


def _types() -> Any:
    try:
        from gguf import GGMLQuantizationType
    except ImportError as e:
        raise CheckpointError("reading GGUF files needs the gguf package: pip install 'vramgraph[gguf]' "
                              "(or pip install gguf)") from e
    return GGMLQuantizationType


def _header(path: Path) -> Header:
    try:
        return read_gguf_header(path)
    except HeaderError as e:
        raise GGUFError(f"{path}: not a readable GGUF file: {e}; it is truncated or damaged (an interrupted "
                        "download?): fetch it again") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e


def _tensor(path: Path, head: Header, t: RawTensor, types: Any) -> TensorInfo:
    try:
        kind = types(t.type_code).name
    except ValueError:
        kind = f"type {t.type_code}"
    if kind not in SUPPORTED:
        raise GGUFError(f"{path}: tensor {t.name} is stored as {kind}, which vramgraph does not run (it runs "
                        f"{', '.join(SUPPORTED)}); use a file quantised to one of those")
    shape = tuple(reversed(t.dims))
    orig = head.metadata.get(f"comfy.gguf.orig_shape.{t.name}")
    if orig is not None:
        if not isinstance(orig, tuple) or kind in GGML_BLOCKS or _prod(orig) != _prod(shape):
            raise GGUFError(f"{path}: tensor {t.name}: comfy.gguf.orig_shape {orig} does not fit its stored shape "
                            f"{list(shape)} ({kind}); the file is damaged")
        shape = tuple(int(d) for d in orig)
    block = GGML_BLOCKS.get(kind)
    if block is not None and (not shape or shape[-1] % block[0]):
        raise GGUFError(f"{path}: tensor {t.name} ({kind}) has rows of {shape[-1] if shape else 0} elements, not a "
                        f"whole number of {block[0]}-element blocks; the file is damaged")
    return TensorInfo(path, kind, shape, t.name, offset=t.offset)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_spans(path: Path, infos: Mapping[str, TensorInfo]) -> None:
    """Every tensor's bytes lie inside the file and no two overlap: a header that claims more bytes than its file
    holds (truncated, or lying about a tensor's size) is refused here, not found mid-run."""
    size = path.stat().st_size
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in infos.values())
    for (start, end, name), nxt in zip(spans, [*spans[1:], None], strict=True):
        if end > size:
            raise GGUFError(f"{path}: tensor {name} ends at byte {end} but the file has {size} bytes: the file is "
                            "truncated (an interrupted download?) or its header is wrong; fetch it again")
        if nxt is not None and end > nxt[0]:
            raise GGUFError(f"{path}: tensor {name} claims {end - start} bytes, running into tensor {nxt[2]}: the "
                            "file's header is wrong (the file is damaged); fetch it again")


def read_gguf(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor table and metadata of a GGUF file, like `headers.read_header`'s for safetensors.

    Text encoders' llama.cpp names become Hugging Face's (`hf_name`). The metadata holds the entries of META_KEPT
    that the file has, `gguf.tokenizer` ("present" or "absent": whether it carries llama.cpp tokenizer metadata),
    and `gguf.types` (the quant mix: "Q4_K:240,F32:193").
    """
    path = Path(path)
    types = _types()
    head = _header(path)
    meta = {k: str(head.metadata[k]) for k in META_KEPT if isinstance(head.metadata.get(k), (str, int, float))}
    arch = meta.get("general.architecture", "")
    if arch not in TRANSFORMER_ARCHES + TEXT_ARCHES + NO_ARCH:
        raise GGUFError(f"{path}: a GGUF file of architecture {arch!r}, which is not one vramgraph runs: it reads "
                        "FLUX.2 [klein] transformers (architecture 'flux') and Qwen3 text encoders ('qwen3')")
    text = arch in TEXT_ARCHES or any(t.name.startswith("blk.") for t in head.tensors)
    infos: dict[str, TensorInfo] = {}
    types_found: dict[str, int] = {}
    for t in head.tensors:
        info = _tensor(path, head, t, types)
        name = hf_name(t.name) if text else t.name
        if name in infos:
            raise GGUFError(f"{path}: tensor {t.name} is listed twice; the file is damaged")
        infos[name] = info
        types_found[info.dtype] = types_found.get(info.dtype, 0) + 1
    _check_spans(path, infos)
    meta["gguf.tokenizer"] = "present" if "tokenizer.ggml.tokens" in head.metadata else "absent"
    meta["gguf.types"] = ",".join(f"{k}:{n}" for k, n in sorted(types_found.items(), key=lambda kv: -kv[1]))
    if text:
        pre = meta.get("tokenizer.ggml.pre")
        if pre is not None and pre not in QWEN_TOKENIZERS:
            raise GGUFError(f"{path}: its tokenizer is {pre!r}, not Qwen3's ('qwen2'): this is not a Qwen3 text "
                            "encoder; FLUX.2 [klein] needs Qwen3-4B (klein-4B) or Qwen3-8B (klein-9B)")
    return infos, meta


def tokenizer_note(path: Path, meta: Mapping[str, str]) -> str:
    """What a text-encoder GGUF's tokenizer becomes: the one vramgraph ships for Qwen3 (its BPE files), in both
    cases, since the file's tokenizer metadata (when there is any) is the same vocabulary."""
    if meta.get("gguf.tokenizer") == "absent":
        return (f"{path.name} has no tokenizer metadata; the Qwen3 tokenizer shipped with vramgraph is used "
                "(or a tokenizer.json beside the model)")
    return f"{path.name}: the Qwen3 tokenizer shipped with vramgraph is used (the file's copy is not read)"


def type_from_name(name: str) -> str | None:
    """The stored type a GGUF file name announces ('flux-2-klein-9b-Q4_K_M.gguf' -> 'Q4_K'), None if none: how a
    plan made without the file sizes it (models/ planning from built-in specs)."""
    m = re.search(r"(?i)(?:^|[-_.])(q[2-8]_(?:0|1|k)|bf16|f16|f32)(?:_[sml])?\.gguf$", name)
    if m is None:
        return None
    kind = m[1].upper()
    return kind if kind in SUPPORTED else None


def builtin_bytes(shapes: Mapping[str, tuple[int, ...]], kind: str, itemsize: int) -> int:
    """Bytes of a model of these parameter shapes stored as `kind` once loaded: 2-d weights whose rows are whole
    blocks as `kind` blocks (F16/BF16/F32 weights at the compute `itemsize`), everything else at `itemsize` (as
    llama.cpp falls back and as norms are cast). Llama.cpp's _M/_S mixes give some tensors a larger type; this
    counts the named one."""
    block = GGML_BLOCKS.get(kind)
    total = 0
    for shape in shapes.values():
        n = _prod(shape)
        if block is not None and len(shape) == 2 and shape[-1] % block[0] == 0:
            total += n // block[0] * block[1]
        else:
            total += n * itemsize
    return total
