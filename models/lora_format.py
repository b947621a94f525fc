"""LoRA files for FLUX.2 [klein] and its Qwen3 text encoder, recognised from their header alone (no torch).

A LoRA file holds, per adapted layer ("module"), a few small tensors whose names end in what the adapter is:

- LoRA: `lora_up`/`lora_down` (kohya), `lora_B`/`lora_A` (diffusers/PEFT), `lora.up`/`lora.down`, `_lora.up`,
  `lora_linear_layer.up`, `lora_B.default`; optional `lora_mid`, `alpha`, `dora_scale` (DoRA);
- LoHa: `hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b` (optional `hada_t1`, `hada_t2`);
- LoKr: `lokr_w1` or `lokr_w1_a`/`lokr_w1_b`, `lokr_w2` or `lokr_w2_a`/`lokr_w2_b` (optional `lokr_t2`).

The module names are those ComfyUI maps for FLUX.2 (comfy/lora.py `model_lora_keys_unet` for a Flux model, and
`model_lora_keys_clip` for a single-Qwen3 text encoder): BFL/ComfyUI `diffusion_model.<layer>`, kohya
`lora_unet_<layer with _>`, diffusers/PEFT `transformer.<diffusers layer>`, SimpleTuner `lycoris_<...>`, OneTrainer
`lora_transformer_<...>`, DiffSynth bare diffusers names, `<single block>.linear1_qkv` (the attention rows of
linear1); for the text encoder `text_encoders.qwen3_4b.transformer.model.<layer>` (with or without the wrapper) and
kohya `lora_te_<layer with _>`. A diffusers name for one of q/k/v lands on its rows of our fused qkv.

Everything else is refused with the file, what it looks like and why: OFT/BOFT and other adapters, a module no layer
of ours has (named), shapes that do not fit (a LoRA for klein-9B on klein-4B), a rank mismatch, a dtype other than
bf16/fp16/fp32, a damaged file. ComfyUI only logs keys it cannot place; a partial application is a different picture
from the one the LoRA was trained for, so we refuse instead.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import flux2_config, qwen3_config
from .headers import CheckpointError, TensorInfo, read_header

COMPONENTS = ("transformer", "text_encoder")
TEXT_ENCODER_PREFIXES = ("lora_te_", "text_encoders.")
DTYPES = ("BF16", "F16", "F32")

# suffix -> (adapter, role); longest suffixes are tried first
_SUFFIXES: dict[str, tuple[str, str]] = {
    ".lora_up.weight": ("lora", "up"), ".lora_down.weight": ("lora", "down"), ".lora_mid.weight": ("lora", "mid"),
    ".lora_B.weight": ("lora", "up"), ".lora_A.weight": ("lora", "down"),
    ".lora_B.default.weight": ("lora", "up"), ".lora_A.default.weight": ("lora", "down"),
    ".lora.up.weight": ("lora", "up"), ".lora.down.weight": ("lora", "down"),
    "_lora.up.weight": ("lora", "up"), "_lora.down.weight": ("lora", "down"),
    ".lora_linear_layer.up.weight": ("lora", "up"), ".lora_linear_layer.down.weight": ("lora", "down"),
    ".hada_w1_a": ("loha", "w1a"), ".hada_w1_b": ("loha", "w1b"), ".hada_w2_a": ("loha", "w2a"),
    ".hada_w2_b": ("loha", "w2b"), ".hada_t1": ("loha", "t1"), ".hada_t2": ("loha", "t2"),
    ".lokr_w1": ("lokr", "w1"), ".lokr_w2": ("lokr", "w2"), ".lokr_w1_a": ("lokr", "w1a"),
    ".lokr_w1_b": ("lokr", "w1b"), ".lokr_w2_a": ("lokr", "w2a"), ".lokr_w2_b": ("lokr", "w2b"),
    ".lokr_t2": ("lokr", "t2"),
    ".alpha": ("any", "alpha"), ".dora_scale": ("any", "dora_scale"),
}
_ORDER = tuple(sorted(_SUFFIXES, key=len, reverse=True))  # longest suffix first
# adapters ComfyUI or LyCORIS know that we do not run: suffix fragment -> name
_REFUSED = {".oft_blocks": "OFT", ".oft_diag": "OFT", ".oft_R": "OFT", ".boft_": "BOFT", ".a1.weight": "GLoRA",
            ".b1.weight": "GLoRA", ".diff": "a full weight difference", ".diff_b": "a full bias difference",
            ".w_norm": "a norm weight difference", ".b_norm": "a norm bias difference",
            ".set_weight": "a replacement weight", ".reshape_weight": "a reshaped layer (BFL control LoRA)",
            ".lora_B.bias": "a LoRA with bias terms (BFL control LoRA)"}
_REQUIRED = {"lora": ("up", "down"), "loha": ("w1a", "w1b", "w2a", "w2b")}


class LoraError(CheckpointError):
    """A LoRA file that cannot be applied: what it is and why, naming the file."""


@dataclass(frozen=True)
class Target:
    """One adapter in the file, on one of our parameters (or on some of its rows)."""

    module: str  # the module name in the file (for messages)
    param: str  # our parameter, e.g. "double_blocks.0.img_attn.qkv.weight"
    kind: str  # "lora", "loha", "lokr"
    keys: tuple[tuple[str, str], ...]  # (role, key in the file)
    rows: tuple[int, int] | None = None  # (first row, rows) of the parameter it adapts; None: all
    swap: bool = False  # diffusers' final modulation stores (scale, shift) where we hold (shift, scale)

    def key(self, role: str) -> str | None:
        return dict(self.keys).get(role)


@dataclass(frozen=True)
class LoraFile:
    """A LoRA file as its header describes it: which of our layers each adapter changes."""

    path: Path
    style: str  # the key style, for messages and the plan ("diffusers/PEFT", "kohya", ...)
    targets: tuple[tuple[str, tuple[Target, ...]], ...]  # (component, its adapters)
    nbytes: int  # bytes of the adapter tensors
    adapters: tuple[str, ...]  # the adapter kinds present ("lora", "dora", "loha", "lokr")
    rank: int  # the largest rank (LoRA, LoHa; 0 for a LoKr without low-rank factors)
    ignored: int = 0  # text encoder layers set aside when parsed for a transformer alone (LoraLoaderModelOnly)

    def component(self, kind: str) -> tuple[Target, ...]:
        return dict(self.targets).get(kind, ())

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(k for k, t in self.targets if t)

    def nbytes_of(self, kind: str, infos: Mapping[str, TensorInfo]) -> int:
        return sum(infos[k].nbytes for t in self.component(kind) for _, k in t.keys)


# ---------------------------------------------------------------------------------------------------
# Module names -> our parameters


def _add(out: dict, name: str, param: str, rows: tuple[int, int] | None = None, swap: bool = False) -> None:
    out[name] = (param, rows, swap)


def transformer_names(cfg: flux2_config.Flux2Config) -> dict[str, tuple[str, tuple[int, int] | None, bool]]:
    """Every module name ComfyUI maps to a FLUX.2 layer -> (our parameter, its rows or None, halves swapped)."""
    out: dict = {}
    shapes = flux2_config.parameter_shapes(cfg)
    for p, shape in shapes.items():
        if len(shape) != 2:
            continue
        m = p.removesuffix(".weight")
        _add(out, f"diffusion_model.{m}", p)
        _add(out, f"lora_unet_{m.replace('.', '_')}", p)
        src = flux2_config._diffusers_source(p)
        size = shape[0] // len(src.keys)
        for i, k in enumerate(src.keys):
            d = k.removesuffix(".weight")
            rows = (i * size, size) if len(src.keys) > 1 else None
            swap = src.op == "swap_halves"
            flat = d.replace(".", "_")
            for name in (f"transformer.{d}", f"lycoris_{flat}", f"lora_transformer_{flat}", d):
                _add(out, name, p, rows, swap)
    for i in range(cfg.depth_single):
        _add(out, f"diffusion_model.single_blocks.{i}.linear1_qkv", f"single_blocks.{i}.linear1.weight",
             (0, 3 * cfg.hidden))
    return out


def text_encoder_names(cfg: qwen3_config.Qwen3Config) -> dict[str, tuple[str, tuple[int, int] | None, bool]]:
    """Every module name ComfyUI maps to a Qwen3 layer of the klein text encoder -> (our parameter, None, False).
    Layers past the last one FLUX.2 reads are mapped to "" (they cannot change the conditioning)."""
    out: dict = {}
    leaves = [x.removesuffix(".weight") for x in qwen3_config._LEAVES if "norm" not in x]
    for i in range(cfg.num_layers):
        for leaf in leaves:
            m = f"layers.{i}.{leaf}"
            p = f"{m}.weight" if i < cfg.n_built else ""
            for wrap in ("qwen3_4b", "qwen3_8b"):
                _add(out, f"text_encoders.{wrap}.transformer.model.{m}", p)
            _add(out, f"text_encoders.transformer.model.{m}", p)
            _add(out, f"lora_te_{m.replace('.', '_')}", p)
    return out


# ---------------------------------------------------------------------------------------------------
# Reading a file


def _split(key: str) -> tuple[str, str, str] | None:
    """(module, adapter, role) of a key, None for a key that is no adapter tensor we know."""
    for s in _ORDER:
        if key.endswith(s):
            adapter, role = _SUFFIXES[s]
            return key[:-len(s)], adapter, role
    return None


def _looks_like(modules: Iterable[str]) -> str:
    """What a LoRA that matches none of our layers was made for, from its module names."""
    text = " ".join(modules)
    if re.search(r"(img_mod|txt_mod)[._]lin|single_blocks[._]\d+[._]modulation|norm1[._]linear|proj_mlp|"
                 r"single_transformer_blocks[._]\d+[._]attn[._]to_q", text):
        return "FLUX.1 (its blocks have their own modulation; FLUX.2's share one)"
    if re.search(r"(down_blocks|input_blocks|up_blocks|output_blocks|mid_block)|lora_te[12]_|text_model", text):
        return "Stable Diffusion / SDXL (a UNet with CLIP text encoders)"
    if re.search(r"(noise_refiner|context_refiner|layers[._]\d+[._]attention[._](qkv|to_q))", text):
        return "Z-Image / Lumina 2"
    if re.search(r"img_mlp[._]net|txt_mlp[._]net|transformer_blocks[._]\d+[._]img_mod", text):
        return "Qwen-Image"
    return "no model vramgraph runs (an unknown key style)"


def _check_file(path: Path, infos: Mapping[str, TensorInfo]) -> None:
    size = os.path.getsize(path)
    end = max((i.offset + i.nbytes for i in infos.values()), default=0)
    if end > size:
        raise LoraError(f"{path}: the file ends before its tensors do (an incomplete download?); fetch it again")
    bad = sorted({i.dtype for i in infos.values()} - set(DTYPES))
    if bad:
        raise LoraError(f"{path}: adapter tensors stored as {', '.join(bad)}; LoRAs are read in bf16, fp16 or fp32 "
                        "(convert the file, or use the trainer's unquantised export)")


def _group(path: Path, infos: Mapping[str, TensorInfo]) -> dict[str, dict[str, str]]:
    """module -> {role: key} over the whole file; refuses unknown adapters and stray keys."""
    groups: dict[str, dict[str, str]] = {}
    stray = []
    for key in infos:
        for frag, what in _REFUSED.items():
            if frag in key:
                raise LoraError(f"{path}: holds {what} adapters (e.g. {key!r}); vramgraph applies LoRA (with DoRA), "
                                "LoHa and LoKr only")
        got = _split(key)
        if got is None:
            stray.append(key)
            continue
        module, _, role = got
        groups.setdefault(module, {})[role] = key
    if stray:
        raise LoraError(f"{path}: {len(stray)} tensors are no adapter part vramgraph knows, e.g. "
                        f"{', '.join(repr(k) for k in stray[:3])}: not a LoRA/LoHa/LoKr file, or a kind we do not run")
    if not groups:
        raise LoraError(f"{path}: holds no tensors: not a LoRA")
    return groups


def _kind(path: Path, module: str, roles: Mapping[str, str]) -> str:
    kinds = {a for r in roles for s, (a, rr) in _SUFFIXES.items() if rr == r and a != "any"
             and roles[r].endswith(s)}
    if len(kinds) != 1:
        what = "no adapter tensors" if not kinds else f"parts of several adapters ({', '.join(sorted(kinds))})"
        raise LoraError(f"{path}: module {module!r} has {what}; the file is damaged or not a LoRA")
    (kind,) = kinds
    need = _REQUIRED.get(kind, ())
    missing = [r for r in need if r not in roles]
    if kind == "lokr" and not (("w1" in roles or {"w1a", "w1b"} <= set(roles))
                               and ("w2" in roles or {"w2a", "w2b"} <= set(roles))):
        missing = ["lokr_w1 or lokr_w1_a/b, and lokr_w2 or lokr_w2_a/b"]
    if missing:
        raise LoraError(f"{path}: module {module!r} lacks {', '.join(missing)}; the file is damaged")
    return kind


def _style(modules: Iterable[str]) -> str:
    styles = set()
    for m in modules:
        if m.startswith("lora_unet_") or m.startswith("lora_te_"):
            styles.add("kohya")
        elif m.startswith("lycoris_"):
            styles.add("SimpleTuner LyCORIS")
        elif m.startswith("lora_transformer_"):
            styles.add("OneTrainer")
        elif m.startswith("transformer."):
            styles.add("diffusers/PEFT")
        elif m.startswith("diffusion_model."):
            styles.add("BFL/ComfyUI")
        elif m.startswith("text_encoders."):
            styles.add("ComfyUI text encoder")
        else:
            styles.add("DiffSynth")
    return " + ".join(sorted(styles))


def use_signature(path: str | Path, component: str, strength: float) -> tuple:
    """One LoRA file (this version of it) applied to one component at one strength. A merge records the signatures of
    its LoRAs in chain order (models/lora.py); the plan compares them with what it is to apply (nodes/lora.py)."""
    st = os.stat(path)
    return (str(path), st.st_size, st.st_mtime_ns, component, float(strength))


def read(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, dict[str, str]]]:
    """The tensor table of a LoRA file and its tensors grouped by module; LoraError if it is not one we apply."""
    path = Path(path)
    try:
        infos, _ = read_header(path)
    except CheckpointError as e:
        raise LoraError(str(e)) from e
    _check_file(path, infos)
    return infos, _group(path, infos)


def parse(path: str | Path, transformer: flux2_config.Flux2Config | None,
          text_encoder: qwen3_config.Qwen3Config | None) -> LoraFile:
    """Recognise a LoRA file against the model it is to be applied to (either config may be None: that part of
    the model is not loaded by the node, so a LoRA part for it is an error). Header only; nothing is read."""
    path = Path(path)
    infos, groups = read(path)
    maps = {"transformer": transformer_names(transformer) if transformer is not None else {},
            "text_encoder": text_encoder_names(text_encoder) if text_encoder is not None else {}}
    found: dict[str, list[Target]] = {k: [] for k in COMPONENTS}
    unmatched = []
    ignored = 0
    for module, roles in groups.items():
        kind = _kind(path, module, roles)
        if text_encoder is None and module.startswith(TEXT_ENCODER_PREFIXES):
            ignored += 1  # as ComfyUI's LoraLoaderModelOnly, which loads the model's part of a file only
            continue
        hit = next(((c, maps[c][module]) for c in COMPONENTS if module in maps[c]), None)
        if hit is None:
            unmatched.append(module)
            continue
        comp, (param, rows, swap) = hit
        if not param:  # a text encoder layer past the ones FLUX.2 reads
            continue
        found[comp].append(Target(module, param, kind, tuple(sorted(roles.items())), rows, swap))
    if unmatched:
        _refuse_unmatched(path, unmatched, len(groups), transformer, text_encoder)
    targets = tuple((c, tuple(found[c])) for c in COMPONENTS if found[c])
    for comp, ts in targets:
        cfg = transformer if comp == "transformer" else text_encoder
        shapes = (flux2_config if comp == "transformer" else qwen3_config).parameter_shapes(cfg)
        for t in ts:
            check_shapes(path, t, shapes[t.param], infos, cfg)
    kinds = sorted({t.kind for _, ts in targets for t in ts} |
                   ({"dora"} if any(t.key("dora_scale") for _, ts in targets for t in ts) else set()))
    rank = max((_rank(t, infos) for _, ts in targets for t in ts), default=0)
    nbytes = sum(i.nbytes for i in infos.values())
    return LoraFile(path, _style(groups), targets, nbytes, tuple(kinds), rank, ignored)


def _refuse_unmatched(path: Path, unmatched: list[str], total: int, transformer: object, text_encoder: object) -> None:
    if transformer is None and any(m in transformer_names(flux2_config.KLEIN_9B) for m in unmatched[:20]):
        raise LoraError(f"{path}: its layers (e.g. {unmatched[0]!r}) are the FLUX.2 transformer's, and this use of it "
                        "has no transformer to apply them to (load it on the MODEL: LoraLoader or LoraLoaderModelOnly)")
    if len(unmatched) == total:
        raise LoraError(f"{path}: a LoRA for {_looks_like(unmatched)}, not for FLUX.2 [klein]: none of its "
                        f"{total} layers, e.g. {unmatched[0]!r}, is a layer of ours")
    te = any(m.startswith(TEXT_ENCODER_PREFIXES) for m in unmatched)
    hint = ""
    if not te and transformer is None:
        hint = " (transformer layers: this node takes no MODEL)"
    shown = ", ".join(repr(m) for m in unmatched[:5])
    raise LoraError(f"{path}: {len(unmatched)} of its {total} layers match no layer of the model{hint}: {shown}"
                    f"{' ...' if len(unmatched) > 5 else ''}; vramgraph applies a LoRA whole or not at all")


def _shape(infos: Mapping[str, TensorInfo], t: Target, role: str) -> tuple[int, ...] | None:
    k = t.key(role)
    return tuple(infos[k].shape) if k else None


def _rank(t: Target, infos: Mapping[str, TensorInfo]) -> int:
    if t.kind == "lora":
        return _shape(infos, t, "down")[0]
    if t.kind == "loha":
        return _shape(infos, t, "w1b")[0]
    for r in ("w1b", "w2b"):
        s = _shape(infos, t, r)
        if s:
            return s[0]
    return 0


def _variant_hint(cfg: object, got_in: int) -> str:
    hidden = getattr(cfg, "hidden", None) or getattr(cfg, "hidden_size", None)
    names = {3072: "FLUX.2 [klein] 4B", 4096: "FLUX.2 [klein] 9B", 6144: "FLUX.2 [dev]", 2560: "Qwen3-4B (klein 4B)"}
    if isinstance(cfg, flux2_config.Flux2Config) and got_in in names and got_in != hidden:
        return f" (a LoRA for {names[got_in]} on a model with hidden size {hidden})"
    if isinstance(cfg, qwen3_config.Qwen3Config) and got_in in (2560, 4096) and got_in != hidden:
        return f" (a LoRA for Qwen3-{'4B' if got_in == 2560 else '8B'} on a text encoder of width {hidden})"
    return ""


def adapter_dims(t: Target, infos: Mapping[str, TensorInfo]) -> tuple[int, int]:
    """(out, in) of the weight difference an adapter makes; LoraError on a rank mismatch."""
    s = lambda r: _shape(infos, t, r)  # noqa: E731
    if t.kind == "lora":
        up, down, mid = s("up"), s("down"), s("mid")
        if len(up) < 2 or len(down) < 2:
            raise LoraError(f"module {t.module!r}: lora_up/lora_down are not matrices ({up}, {down})")
        rank_in = mid[0] if mid else down[0]
        if up[1] != rank_in or (mid and mid[1] != down[0]):
            raise LoraError(f"module {t.module!r}: rank mismatch: up {up}, down {down}; the file is damaged")
        return up[0], math.prod(down[1:])
    if t.kind == "loha":
        w1a, w1b, w2a, w2b = s("w1a"), s("w1b"), s("w2a"), s("w2b")
        if w1a[1] != w1b[0] or w2a[1] != w2b[0] or (w1a[0], w1b[1]) != (w2a[0], w2b[1]):
            raise LoraError(f"module {t.module!r}: rank mismatch in hada_w1/hada_w2: {w1a} {w1b} {w2a} {w2b}")
        return w1a[0], math.prod(w1b[1:])
    dims = []
    for w, a, b in (("w1", "w1a", "w1b"), ("w2", "w2a", "w2b")):
        if s(w):
            dims.append((s(w)[0], math.prod(s(w)[1:])))
        else:
            if s(a)[1] != s(b)[0]:
                raise LoraError(f"module {t.module!r}: rank mismatch in lokr_{a}/lokr_{b}: {s(a)} {s(b)}")
            dims.append((s(a)[0], math.prod(s(b)[1:])))
    return dims[0][0] * dims[1][0], dims[0][1] * dims[1][1]


def check_shapes(path: Path, t: Target, shape: tuple[int, ...], infos: Mapping[str, TensorInfo], cfg: object) -> None:
    """The adapter's weight difference must have the shape of the parameter (or of its rows) it changes."""
    try:
        out, inp = adapter_dims(t, infos)
    except LoraError as e:
        raise LoraError(f"{path}: {e}") from e
    want = (t.rows[1] if t.rows else shape[0], shape[1])
    if (out, inp) != want:
        raise LoraError(f"{path}: module {t.module!r} changes a ({out}, {inp}) weight but {t.param} is {want}"
                        f"{_variant_hint(cfg, inp)}")
    for role in ("alpha",):
        s = _shape(infos, t, role)
        if s is not None and math.prod(s) != 1:
            raise LoraError(f"{path}: module {t.module!r}: alpha has shape {s}; it must be one number")
    d = _shape(infos, t, "dora_scale")
    if d is not None and math.prod(d) not in (out, inp):
        raise LoraError(f"{path}: module {t.module!r}: dora_scale has shape {d}, fitting neither the {out} outputs "
                        f"nor the {inp} inputs of the layer")
