"""The sampling step at the GPU's limit: the levers that make a FLUX.2 transformer forward faster, each with its
fallback to the plain path.

- attention kernel: PyTorch's SDPA backends (cuDNN, flash, memory-efficient) timed once per shape on the device
  against SDPA's own choice; a forced backend only where it is clearly faster (`pick_attention`).
- regional `torch.compile` of the blocks (one compiled graph per block class, reused by all blocks of it), which fuses
  the norms, RoPE, modulation, gating and fp8 quantization around the matrix products; inductor's cache is kept on
  disk (`cache_dir`), and a ledger there records which shapes were compiled and how long that took, so that the next
  process knows its compile will be a warm one (`CompileLedger`).
- whether to compile is decided by predicted seconds (`compile_pays`): the steps' saving against the compile's
  seconds, cold or from the warm disk cache; a compile that does not pay back within the job is not done.

Whatever is not available (the CPU, a GPU without a kernel, a compile that fails) leaves the plain path in place and
says so in one log line (`prepare`). Measured levers and the constants below: docs/step.md, bench/results/step.json.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ATTENTION = ("auto", "sdpa", "cudnn", "flash", "efficient")
COMPILE = ("auto", "on", "off")
_CANDIDATES = ("cudnn", "flash", "efficient")
# A forced backend must beat SDPA's own choice by 5 % to be used: on the H100 with PyTorch 2.11 SDPA picks cuDNN
# itself (bench/results/step-levers-h100.json: forced cuDNN 91.0 ms a step against 90.6), and a forced backend has
# no fallback for inputs it cannot take.
PICK_GAIN = 0.95

# Measured by bench/step.py on an H100 (bench/results/step-levers-h100.json, commit 2f1cabf; docs/step.md): a
# compiled klein-4B step takes 0.66x the plain step at 1024² and 0.74x at 2048² (the larger ratio is kept: the
# prediction errs towards not compiling); compiling the blocks for one batch size took 13.0-14.6 s in bf16 and
# 12.0-16.4 s in fp8 with an empty inductor cache, and 9.6 s in a new process over the warm disk cache
# (bench/results/step-warm-compile-h100.json). Dynamic shapes: a new image size reuses the graph (0.2-0.6 s).
COMPILED_STEP_RATIO = 0.74
FP8_COMPILED = "rowwise"  # the fp8 layers' compute inside compiled blocks (klein-4B 1024²: 43.8 ms; eager static 85.2)
COMPILE_COLD_S = 16.0
COMPILE_WARM_S = 10.0


@dataclass(frozen=True)
class StepOptions:
    """How a sampling run's transformer steps run. attention: "auto" (the fastest SDPA backend for the shape, timed
    on the device), "sdpa" (SDPA's own choice), or one backend; compile: "auto" (only where it pays back within
    the job), "on", "off"; cache_dir: inductor's cache and the compile ledger (None: `default_cache_dir()`)."""

    attention: str = "auto"
    compile: str = "auto"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"unknown attention {self.attention!r}; use one of {', '.join(ATTENTION)}")
        if self.compile not in COMPILE:
            raise ValueError(f"unknown compile setting {self.compile!r}; use one of {', '.join(COMPILE)}")


    @classmethod
    def from_env(cls) -> StepOptions:
        """From $VRAMGRAPH_ATTENTION and $VRAMGRAPH_COMPILE (unset: "auto"); an unknown value raises ValueError
        naming the variable and the values it takes."""
        att, comp = os.environ.get("VRAMGRAPH_ATTENTION", "auto"), os.environ.get("VRAMGRAPH_COMPILE", "auto")
        if att not in ATTENTION:
            raise ValueError(f"VRAMGRAPH_ATTENTION={att!r}: use one of {', '.join(ATTENTION)}")
        if comp not in COMPILE:
            raise ValueError(f"VRAMGRAPH_COMPILE={comp!r}: use one of {', '.join(COMPILE)}")
        return cls(att, comp)


PLAIN = StepOptions(attention="sdpa", compile="off")


@dataclass(frozen=True)
class StepShape:
    """What one transformer forward runs over: `batch` sequences (cond and uncond count twice) of image and text
    tokens."""

    batch: int
    image_tokens: int
    text_tokens: int

    @property
    def tokens(self) -> int:
        return self.image_tokens + self.text_tokens


@dataclass(frozen=True)
class Prepared:
    """What a model was prepared with: the attention backend ("sdpa": SDPA's own choice), whether its blocks are
    compiled, the seconds the compile took here (0.0 if none ran), and what was not available."""

    attention: str
    compiled: bool
    compile_s: float = 0.0
    unavailable: tuple[str, ...] = ()
    attention_s: dict[str, float] = field(default_factory=dict)


def default_cache_dir() -> Path:
    """$VRAMGRAPH_CACHE_DIR, else $XDG_CACHE_HOME/vramgraph, else ~/.cache/vramgraph; compile caches in compile/."""
    base = os.environ.get("VRAMGRAPH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vramgraph")
    return Path(base) / "compile"


# ---------------------------------------------------------------------------------------------
# Attention


def _sdpa_backend(name: str) -> object:
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def _attend_with(backend: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v)


def attend_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The attention callable for a backend name; None for "sdpa" (SDPA's own choice)."""
    if name == "sdpa":
        return None
    return functools.partial(_attend_with, _sdpa_backend(name))


def _time_cuda(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def time_candidates(candidates: tuple[str, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    timer: Callable[[Callable[[], object]], float]) -> tuple[dict[str, float], list[str]]:
    """The seconds `timer` gives each candidate's attention on q, k, v ("sdpa": SDPA's own choice), and the names
    that could not run."""
    seconds, missing = {}, []
    for name in candidates:
        fn = attend_fn(name) or F.scaled_dot_product_attention
        try:
            seconds[name] = timer(lambda fn=fn: fn(q, k, v))
        except RuntimeError:  # no such kernel for this GPU, dtype or shape ("No available kernel")
            missing.append(name)
    return seconds, missing


@torch.no_grad()
def pick_attention(device: torch.device, dtype: torch.dtype, batch: int, heads: int, tokens: int, head_dim: int,
                   candidates: tuple[str, ...] = ("sdpa", *_CANDIDATES)
                   ) -> tuple[str, dict[str, float], tuple[str, ...]]:
    """The fastest of `candidates` for this shape on `device`, timed on random inputs ("sdpa", SDPA's own choice,
    kept unless another is faster by more than PICK_GAIN); with the seconds of each that ran and the names that could
    not run. On a non-CUDA device: ("sdpa", {}, the candidates other than "sdpa")."""
    if device.type != "cuda":
        return "sdpa", {}, tuple(c for c in candidates if c != "sdpa")
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype) for _ in range(3))
    seconds, missing = time_candidates(candidates, q, k, v, _time_cuda)
    if not seconds:
        return "sdpa", {}, tuple(missing)
    best = min(seconds, key=seconds.__getitem__)
    if "sdpa" in seconds and best != "sdpa" and seconds[best] > PICK_GAIN * seconds["sdpa"]:
        best = "sdpa"  # SDPA's own choice unless a forced backend is clearly faster (it falls back by itself)
    return best, seconds, tuple(missing)


def set_attention(model: nn.Module, name: str) -> None:
    """Make every block of `model` attend with backend `name` ("sdpa": SDPA's own choice)."""
    fn = attend_fn(name)
    for block in model.streamed_blocks():
        block.attend = fn


# ---------------------------------------------------------------------------------------------
# Compile


def compile_pays(passes: int, plain_step_s: float, compile_s: float, ratio: float = COMPILED_STEP_RATIO) -> bool:
    """Whether compiling pays back within a job of `passes` forwards of `plain_step_s` seconds each, against a
    compile of `compile_s` seconds (cold, or warm from the disk cache).

    >>> compile_pays(4, 0.085, COMPILE_COLD_S)        # one distilled image: 4 steps cannot pay 16 s
    False
    >>> compile_pays(8 * 20 * 2, 1.0, COMPILE_WARM_S)  # 8 base-model images at 2048², warm cache
    True
    """
    return passes * plain_step_s * (1.0 - ratio) > compile_s


class CompileLedger:
    """compiled.json in the cache folder: which (torch, GPU, model, dtype, shape) were compiled there and how many
    seconds it took, so that a later process predicts a warm compile for them."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / "compiled.json"

    def read(self) -> dict[str, float]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def record(self, key: str, seconds: float) -> None:
        data = self.read()
        data[key] = round(seconds, 3)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(self.path)


def compile_key(model: nn.Module, attention: str) -> str:
    """The ledger's key: what a compiled graph depends on (its shapes are dynamic: one compile serves every size)."""
    dev = model.img_in.weight.device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    fp8 = sorted({getattr(m, "compute", "") for m in model.modules() if hasattr(m, "compute_dtype")} - {""})
    return f"torch {torch.__version__} | {gpu} | {model.cfg} | {model.dtype} fp8={','.join(fp8) or '-'} | {attention}"


def set_compiled(model: nn.Module, on: bool, backend: str = "inductor", dynamic: bool = True) -> None:
    """Compile (or stop compiling) every block of `model` in place, one graph per block class; `dynamic`: the token
    and batch counts symbolic, so that one compile serves every image size and CFG batch."""
    for block in model.streamed_blocks():
        if on:
            block.compile(backend=backend, dynamic=dynamic)
        else:
            block._compiled_call_impl = None  # nn.Module.compile's handle; None runs the plain forward


@torch.no_grad()
def _trial_forward(model: nn.Module, shape: StepShape) -> None:
    """One forward of `shape` on random inputs: compiles the blocks for it (or raises what the compile raised)."""
    from .flux2 import image_ids, rope_table, text_ids

    cfg, dev, dt = model.cfg, model.img_in.weight.device, model.dtype
    img = torch.randn(shape.batch, shape.image_tokens, cfg.in_channels, device=dev, dtype=dt)
    txt = torch.randn(shape.batch, shape.text_tokens, cfg.context_dim, device=dev, dtype=dt)
    ids = torch.cat([text_ids(shape.text_tokens), image_ids(1, shape.image_tokens)])
    model(img, txt, torch.full((shape.batch,), 0.5, device=dev), rope_table(cfg, ids, dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _root_cause(e: BaseException) -> str:
    """'Type: first line' of the innermost cause (a backend's own error, not dynamo's wrapper around it)."""
    while (inner := getattr(e, "inner_exception", None) or e.__cause__) is not None:
        e = inner
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


def _compile(model: nn.Module, shape: StepShape, key: str, folder: Path, backend: str) -> tuple[float, str | None]:
    """Compile the blocks for `shape` with inductor's cache in `folder`; (seconds, None) or (0.0, why not)."""
    from .fp8 import FP8Linear, set_compute

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor"))
    static = any(isinstance(m, FP8Linear) and m.compute == "scaled_mm" for m in model.modules())
    if static:  # compiled, per-row scales fuse into the norm before them (43.8 ms against 85.2 eager, static)
        set_compute(model, FP8_COMPILED)
    set_compiled(model, True, backend)
    t0 = time.perf_counter()
    try:
        _trial_forward(model, shape)
    except Exception as e:  # any compile failure (no compiler, no Triton, a dynamo error): the plain path instead
        set_compiled(model, False)
        if static:
            set_compute(model, "scaled_mm")
        return 0.0, f"torch.compile ({_root_cause(e)})"
    seconds = time.perf_counter() - t0
    try:
        CompileLedger(folder).record(key, seconds)
    except OSError as e:  # a read-only cache folder costs the next process a cold prediction, nothing else
        log.debug("compile ledger not written: %s", e)
    return seconds, None


def prepare(model: nn.Module, shape: StepShape, options: StepOptions, passes: int,
            plain_step_s: float | None = None, backend: str = "inductor") -> Prepared:
    """Set up `model` (a Flux2Transformer whose blocks are all on one device) for a job of `passes` forwards of
    `shape`: the attention backend and compile per `options`; logs one line naming what was not available.

    plain_step_s: the predicted seconds of one plain forward (for compile "auto"; None: from the FLOP count at the
    H200's measured rate and COMPILED_STEP_RATIO's plain efficiency)."""
    dev = model.img_in.weight.device
    unavailable: list[str] = []
    attention, attention_s = options.attention, {}
    if dev.type != "cuda":
        if options.attention not in ("auto", "sdpa"):
            unavailable.append(f"{options.attention} attention (no CUDA device)")
        attention = "sdpa"
    elif attention == "auto":
        picks = model.__dict__.setdefault("_vg_attention", {})  # per model and shape: timed once
        key = (shape.batch, shape.tokens, model.dtype)
        if key not in picks:
            picks[key] = pick_attention(dev, model.dtype, shape.batch, model.cfg.heads, shape.tokens,
                                        model.cfg.head_dim)
        attention, attention_s, missing = picks[key]
        unavailable += [f"{m} attention" for m in missing]
    elif attention != "sdpa":
        _, _, missing = pick_attention(dev, model.dtype, 1, model.cfg.heads, 256, model.cfg.head_dim, (attention,))
        if missing:
            unavailable.append(f"{attention} attention")
            attention = "sdpa"
    set_attention(model, attention)
    unavailable += _fp8_unavailable(model, dev)
    compiled, compile_s = False, 0.0
    if options.compile != "off" and _is_compiled(model) and model.__dict__.get("_vg_compiled_for") == attention:
        compiled = True  # compiled by an earlier job (paid for): kept
    elif _want_compile(model, shape, options, passes, plain_step_s, attention, unavailable):
        folder = Path(options.cache_dir) if options.cache_dir else default_cache_dir()
        compile_s, why = _compile(model, shape, compile_key(model, attention), folder, backend)
        compiled = why is None
        model.__dict__["_vg_compiled_for"] = attention if compiled else None
        if why:
            unavailable.append(why)
    elif _is_compiled(model):
        set_compiled(model, False)
        _restore_fp8(model)
    if unavailable:
        log.info("sampling step: plain path for %s", "; ".join(unavailable))
    return Prepared(attention, compiled, compile_s, tuple(unavailable), attention_s)


def _fp8_unavailable(model: nn.Module, dev: torch.device) -> list[str]:
    """An fp8 model whose layers ask for fp8 matmuls on a device without them dequantizes: say so."""
    from .fp8 import FP8Linear, fp8_matmul_supported

    asks = any(isinstance(m, FP8Linear) and m.compute != "dequant" for m in model.modules())
    if asks and not fp8_matmul_supported(dev):
        return ["fp8 matmuls (need CUDA compute capability 8.9+; fp8 weights dequantized to "
                f"{str(model.dtype).removeprefix('torch.')} instead)"]
    return []


def _restore_fp8(model: nn.Module) -> None:
    """Back to per-tensor static scales (eager, they are faster) where compiling had switched to FP8_COMPILED."""
    from .fp8 import FP8Linear, set_compute

    if any(isinstance(m, FP8Linear) and m.compute == FP8_COMPILED != "scaled_mm" for m in model.modules()):
        set_compute(model, "scaled_mm")


def _is_compiled(model: nn.Module) -> bool:
    return any(getattr(b, "_compiled_call_impl", None) is not None for b in model.streamed_blocks())


def _want_compile(model: nn.Module, shape: StepShape, options: StepOptions, passes: int,
                  plain_step_s: float | None, attention: str, unavailable: list[str]) -> bool:
    """Whether to compile: "on" always where a GPU and Triton are; "auto" where it pays back within the job."""
    if options.compile == "off":
        return False
    dev = model.img_in.weight.device
    if dev.type != "cuda":
        if options.compile == "on":
            return True  # on the CPU only when asked: inductor builds C++ there (tests use backend="eager")
        unavailable.append("torch.compile (no CUDA device)")
        return False
    if options.compile == "on":
        return True
    if plain_step_s is None:
        from .flux2_config import step_flop

        flop = step_flop(model.cfg, shape.image_tokens, shape.text_tokens, shape.batch).total
        plain_step_s = flop / PLAIN_FLOP_S
    folder = Path(options.cache_dir) if options.cache_dir else default_cache_dir()
    warm = compile_key(model, attention) in CompileLedger(folder).read()
    return compile_pays(passes, plain_step_s, COMPILE_WARM_S if warm else COMPILE_COLD_S)


# The plain step's FLOP rate on the H200 (klein-4B at 1024²: 34.8 TFLOP in 86.3 ms, bench/results/fp8.json), the
# default prediction of a plain step's seconds where the caller has none.
PLAIN_FLOP_S = 34.8e12 / 0.0863
