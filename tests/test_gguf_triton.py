"""The Triton GGUF dequantizer (models/gguf_kernels.py, chosen by models/gguf_triton.py) against the torch reference
(models/gguf_dequant.py, itself equal to the `gguf` package's numpy code: tests/test_gguf.py), on random blocks of
every GGML type, with block counts that leave a program's tile part empty, an odd start in memory and no block at all.

- On the GPU (`gpu`): the kernels' bf16, fp16 and fp32 outputs equal the reference's values cast once, bit for bit
  (the kernels compute the same fp32 products in the same order, launched without FMA contraction); a GGUF model
  gives the same output on either path.
- On the CPU: the same kernels under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess) where Triton is
  installed: fp32 and fp16 equal, bf16 within 1 bf16 ulp, because the interpreter truncates fp32 to bf16 where the
  GPU rounds to nearest even. Without Triton, that test checks the fallback instead.
- The fallback: the torch code, with one log line naming what was not available (the CPU, Triton, a kernel that
  failed, which is then not tried again).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from vramgraph.models.dtypes import GGML_BLOCKS
from vramgraph.models.gguf_dequant import dequantize
from vramgraph.models.gguf_triton import DISPATCH, MISSING, Dispatch
from vramgraph.models.gguf_write import random_blocks

TYPES = tuple(GGML_BLOCKS)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cases(kind: str) -> list[tuple[int, int]]:
    """(rows, cols) of whole blocks: fewer blocks than one program's tile, one more than a tile, several tiles with
    a part-filled last one, one block, none."""
    size = GGML_BLOCKS[kind][0]
    return [(3, size * 7), (3, size * 3), (5, size * 29), (1, size), (0, size * 2)]


def blocks(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    if rows == 0:
        return torch.empty(0, cols // GGML_BLOCKS[kind][0] * GGML_BLOCKS[kind][1], dtype=torch.uint8)
    return torch.from_numpy(random_blocks(kind, rows, cols, np.random.default_rng(seed)))


def reference(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    if raw.numel() == 0:  # no block (the torch code's unpacking reshapes cannot take none)
        return torch.empty(shape, device=raw.device)
    with DISPATCH.torch_code():
        return dequantize(raw, kind, shape)


def odd_start(raw: torch.Tensor) -> torch.Tensor:
    """The same bytes starting at an odd address (a view into a larger buffer)."""
    flat = torch.cat([raw.new_zeros(1), raw.reshape(-1)])
    return flat[1:].reshape(raw.shape)


# -------------------------------------------------------------------------------------------------------- the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", TYPES)
def test_triton_kernels_equal_the_torch_reference_on_the_gpu(kind):
    from vramgraph.models import gguf_kernels

    for i, (rows, cols) in enumerate(cases(kind)):
        raw = blocks(kind, rows, cols, seed=i).cuda()
        want = reference(raw, kind, (rows, cols))
        assert want.device.type == "cuda"
        for dt in DTYPES:
            got = gguf_kernels.dequantize(raw, kind, (rows, cols), dt)
            assert got.dtype == dt and torch.equal(got, want.to(dt)), (kind, rows, cols, dt)
            assert torch.equal(dequantize(raw, kind, (rows, cols), dt), got)  # the hook takes the kernel
            assert DISPATCH.unavailable(raw.device, kind, dt) is None
        got = gguf_kernels.dequantize(odd_start(raw), kind, (rows * cols,), torch.bfloat16)
        assert torch.equal(got, want.reshape(-1).to(torch.bfloat16))


@pytest.mark.gpu
def test_blocks_on_a_second_gpu_are_dequantized_there():
    """Triton launches on the current device: blocks on cuda:1 while cuda:0 is current still give their values."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    raw = blocks("Q4_K", 6, 768, seed=7).to("cuda:1")
    with torch.cuda.device(0):
        got = dequantize(raw, "Q4_K", (6, 768), torch.bfloat16)
    assert got.device == raw.device
    assert torch.equal(got, reference(raw, "Q4_K", (6, 768)).to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_gguf_model_computes_the_same_on_either_path(tmp_path, kind):
    """A tiny text encoder (linears and a quantized embedding table) on the GPU in bf16: the kernels' weights are the
    torch code's, so the hidden states are equal."""
    from test_gguf import QWEN3_256, _encoder_sd
    from vramgraph.models import loading
    from vramgraph.models.gguf_write import write_gguf

    path = tmp_path / f"Qwen3-4B-{kind}.gguf"
    write_gguf(path, _encoder_sd(QWEN3_256), kind, arch="qwen3", llama_names=True)
    model = loading.load(loading.inspect(path).text_encoder, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, QWEN3_256.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones(2, 9, dtype=torch.long, device="cuda")
    with torch.no_grad():
        fast = model(ids, mask)
        with DISPATCH.torch_code():
            slow = model(ids, mask)
    fast, slow = (fast[0], slow[0]) if isinstance(fast, tuple) else (fast, slow)
    assert torch.isfinite(slow).all() and torch.equal(fast, slow)
    assert DISPATCH.unavailable(ids.device, kind, torch.bfloat16) is None and not DISPATCH.failed


# ------------------------------------------------------------------------------------ the CPU: Triton's interpreter

INTERPRETED = """
import json, sys
import torch
from vramgraph.models import gguf_kernels
from vramgraph.models.gguf_triton import Dispatch
from test_gguf_triton import DTYPES, TYPES, blocks, cases, odd_start, reference

dispatch = Dispatch(gguf_kernels, devices=("cpu",))
bad = []
for kind in TYPES:
    for i, (rows, cols) in enumerate(cases(kind)):
        raw = blocks(kind, rows, cols, seed=i)
        want = reference(raw, kind, (rows, cols))
        for dt in DTYPES:
            got = dispatch.run(raw if i else odd_start(raw), kind, (rows, cols), dt)
            if got is None or got.dtype != dt or got.shape != want.shape:
                bad.append([kind, rows, cols, str(dt), "no result" if got is None else str((got.dtype, got.shape))])
                continue
            exact = want.to(dt)
            if dt == torch.bfloat16:  # the interpreter truncates: the value below or above, never further
                up = torch.nextafter(exact, torch.full_like(exact, float("inf")))
                down = torch.nextafter(exact, torch.full_like(exact, float("-inf")))
                ok = bool(((got == exact) | (got == up) | (got == down)).all())
            else:
                ok = torch.equal(got, exact)
            if not ok:
                bad.append([kind, rows, cols, str(dt), int((got != exact).sum())])
print(json.dumps({"bad": bad, "failed": dispatch.failed, "interpreted": type(gguf_kernels._q4_k).__name__}))
"""


def test_triton_kernels_under_the_interpreter_or_the_fallback(caplog):
    """Where Triton imports, the kernels run on CPU tensors under its interpreter; where it does not (CI), the torch
    code runs instead and says once that Triton was not available."""
    if importlib.util.find_spec("triton") is None:
        assert MISSING.startswith("Triton (") and DISPATCH.kernels is None
        dispatch = Dispatch(None, MISSING, devices=("cpu",))
        raw = blocks("Q4_K", 2, 512, seed=0)
        with caplog.at_level(logging.INFO, logger="vramgraph.models.gguf_triton"):
            assert dispatch.run(raw, "Q4_K", (2, 512), torch.bfloat16) is None
        assert [r.getMessage() for r in caplog.records] == \
            [f"GGUF dequantization on cpu: torch code (not available: {MISSING})"]
        return
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"bad": [], "failed": {}, "interpreted": "InterpretedFunction"}


def test_kernels_compile_for_the_gpu_without_fused_multiply_adds():
    """Every kernel compiles for an sm_90 card (H100/H200; those with a product and a sum for an sm_86 card too)
    with Triton's own ptxas (no GPU needed) and the options `dequantize` launches it with, and its machine code has
    no fused multiply-add (FFMA), which would round `d * q - m` once where the reference rounds twice; Triton's
    default options do fuse (shown on Q4_K). Without Triton (CI): the kernels are not loaded and a CUDA device's
    blocks would take the torch code, naming Triton."""
    if importlib.util.find_spec("triton") is None:
        assert DISPATCH.kernels is None
        assert DISPATCH.unavailable(torch.device("cuda"), "Q4_K", torch.bfloat16) == MISSING
        return
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vramgraph.models import gguf_kernels

    def sass(kind: str, arch: int, out: str = "*bf16", **options) -> str:
        fn, per_program = gguf_kernels.KERNELS[kind]
        sig = {"src": "*u8", "half": "*fp16", "out": out, "n": "i32", "BB": "constexpr"}
        compiled = triton.compile(ASTSource(fn, sig, constexprs={"BB": per_program}),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        return compiled.asm["sass"]

    affine = ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K")  # a product and a sum: what a compiler could fuse
    for kind, arch in [*((kind, 90) for kind in TYPES), *((kind, 86) for kind in affine)]:
        code = sass(kind, arch, enable_fp_fusion=False)
        assert "STG" in code and "FFMA" not in code, (kind, arch)
    assert "FFMA" in sass("Q4_K", 90, enable_fp_fusion=True)
    assert "FFMA" not in sass("Q4_1", 90, "*fp32", enable_fp_fusion=False)


# -------------------------------------------------------------------------------------------- the fallback's log


class FailingKernels:
    """Kernels that exist but fail, as a compile without ptxas would: counts the calls."""

    KERNELS = dict.fromkeys(GGML_BLOCKS)
    DTYPES = DTYPES

    def __init__(self) -> None:
        self.calls = 0

    def dequantize(self, raw, kind, shape, dtype):
        self.calls += 1
        raise RuntimeError("ptxas not found\n(and pages of the compiler's output)")


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vramgraph.models.gguf_triton"]


def test_the_cpu_takes_the_torch_code_and_says_so_once(caplog):
    raw = blocks("Q8_0", 4, 64, seed=1)
    dispatch = Dispatch(DISPATCH.kernels, MISSING)
    with caplog.at_level(logging.INFO, logger="vramgraph.models.gguf_triton"):
        for dt in DTYPES:
            assert dispatch.run(raw, "Q8_0", (4, 64), dt) is None
        assert dispatch.run(blocks("Q6_K", 1, 256, seed=2), "Q6_K", (256,), torch.float32) is None
    assert _lines(caplog) == ["GGUF dequantization on cpu: torch code (not available: the CPU)"]
    assert torch.equal(dequantize(raw, "Q8_0", (4, 64)), reference(raw, "Q8_0", (4, 64)))


def test_a_failing_kernel_falls_back_once_and_is_not_tried_again(caplog):
    kernels = FailingKernels()
    dispatch = Dispatch(kernels, devices=("cpu",))  # type: ignore[arg-type]
    raw = blocks("Q4_K", 2, 512, seed=3)
    with caplog.at_level(logging.INFO, logger="vramgraph.models.gguf_triton"):
        for _ in range(3):
            assert dispatch.run(raw, "Q4_K", (2, 512), torch.bfloat16) is None
        assert dispatch.run(blocks("Q8_0", 1, 32, seed=4), "Q8_0", (32,), torch.bfloat16) is None
        with dispatch.torch_code():  # switched off: not tried, nothing said
            assert dispatch.run(blocks("Q5_K", 1, 256, seed=5), "Q5_K", (256,), torch.bfloat16) is None
    assert kernels.calls == 2  # Q4_K once, Q8_0 once
    assert set(dispatch.failed) == {("Q4_K", torch.bfloat16, "cpu"), ("Q8_0", torch.bfloat16, "cpu")}
    assert _lines(caplog) == [
        "GGUF dequantization on cpu: torch code (not available: the Triton Q4_K kernel writing torch.bfloat16 "
        "(RuntimeError: ptxas not found))",
        "GGUF dequantization on cpu: torch code (not available: the Triton Q8_0 kernel writing torch.bfloat16 "
        "(RuntimeError: ptxas not found))"]
    assert Dispatch(None, "Triton (ModuleNotFoundError: No module named 'triton')").unavailable(
        torch.device("cuda"), "Q4_K", torch.bfloat16) == "Triton (ModuleNotFoundError: No module named 'triton')"
    assert Dispatch(kernels).unavailable(torch.device("cuda"), "Q4_K", torch.float64) == \
        "a Triton kernel writing torch.float64"  # type: ignore[arg-type]
