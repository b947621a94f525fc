"""Shared pieces of the GPU benchmarks: full-size reference models with random weights, timing, reports.

Run from the repository root with vramgraph importable (bench/run_device.sh arranges that on the
device machine). Every benchmark writes one JSON report whose claims are ratios from one run.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from pathlib import Path

import torch

GiB = 2**30
TOKENIZER_DIR = Path(os.environ.get("QWEN_TOKENIZER_DIR", ".whl/tok"))


def env() -> dict:
    import diffusers
    import transformers

    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "torch": torch.__version__,
            "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move 1-d parameters (norm scales) off their init values so that they matter."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
    return model


def ref_transformer(dtype: torch.dtype, device: str = "cuda", seed: int = 1):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        m = Flux2Transformer2DModel(num_layers=5, num_single_layers=20, num_attention_heads=24,
                                    attention_head_dim=128, joint_attention_dim=7680, in_channels=128,
                                    guidance_embeds=False)
    return perturb_(m.to(dtype).eval().requires_grad_(False), seed)


def ref_vae(dtype: torch.dtype, device: str = "cuda", seed: int = 2):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    with torch.device(device):
        m = AutoencoderKLFlux2()
    m = perturb_(m.to(dtype).eval().requires_grad_(False), seed)
    with torch.no_grad():
        m.bn.running_mean.copy_(0.3 * torch.randn_like(m.bn.running_mean))
        m.bn.running_var.copy_(0.5 + torch.rand_like(m.bn.running_var))
    return m


def ref_qwen3(dtype: torch.dtype, device: str = "cuda", seed: int = 3):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                      rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True)
    with torch.device(device):
        m = Qwen3ForCausalLM(cfg)
    return to_dtype_keep_rope(perturb_(m.eval().requires_grad_(False), seed), dtype)


def to_dtype_keep_rope(m, dtype: torch.dtype):
    """`m.to(dtype)` for a transformers Qwen3, keeping its RoPE frequencies in fp32 (as loading a bf16
    checkpoint with from_pretrained does); a plain .to() would round them and skew the reference."""
    rot = m.model.rotary_emb
    inv = rot.inv_freq.float().clone()
    m.to(dtype)
    rot.inv_freq = inv
    if hasattr(rot, "original_inv_freq"):
        rot.original_inv_freq = inv
    return m


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def sync(dev: torch.device) -> None:
    """Wait for `dev`'s queued work (nothing to wait for on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_on(fn, repeats: int, dev: torch.device) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, each waited for on `dev` (the CPU too, unlike `timed`)."""
    out = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t0)
    return out


def peak_on(fn, dev: torch.device) -> int:
    """`peak_bytes` of `fn()` on `dev`; 0 on the CPU, where nothing is measured (the call still runs)."""
    if dev.type != "cuda":
        fn()
        return 0
    sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    fn()
    sync(dev)
    return torch.cuda.max_memory_allocated(dev) - base


def write_report(path: str | os.PathLike, report: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def peak_bytes(fn, *args) -> int:
    """Bytes `fn(*args)` allocates on the GPU at its peak above what was allocated when it started (what the
    executor measures for each node: torch.cuda.max_memory_allocated above the resident weights)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


class DevicePoll(threading.Thread):
    """The peak device memory in use while it runs (`with DevicePoll(0.02) as p: ...`), sampled every `period` seconds
    in a thread: CUDA's view, `total - free` of cudaMemGetInfo (this process's context, its allocator's holdings and
    anything else on the device), and where nvidia-ml-py works, NVML's device `used` (which also counts the memory the
    driver keeps for itself: 0.60 GiB more on the H200, graph/engine/budget.py) and this process's `usedGpuMemory`."""

    def __init__(self, period: float = 0.002, index: int = 0) -> None:
        super().__init__(daemon=True)
        self.period, self.index = period, index
        self.peak, self.samples = 0, 0
        self.nvml_peak: int | None = None
        self.nvml_process_peak: int | None = None
        self._done = threading.Event()
        self._nvml = None
        try:  # one GPU per machine here: CUDA's device `index` is NVML's too
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
        except Exception:  # no nvidia-ml-py, or NVML does not answer: CUDA's view alone
            self._nvml = None

    def sample(self) -> None:
        free, total = torch.cuda.mem_get_info(self.index)
        self.peak = max(self.peak, total - free)
        self.samples += 1
        if self._nvml is not None:
            nv, handle = self._nvml
            self.nvml_peak = max(self.nvml_peak or 0, nv.nvmlDeviceGetMemoryInfo(handle).used)
            try:
                mine = [p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)
                        if p.pid == os.getpid() and p.usedGpuMemory is not None]
            except Exception:  # not every driver (or sandbox) lists processes
                mine = []
            if mine:
                self.nvml_process_peak = max(self.nvml_process_peak or 0, mine[0])

    def run(self) -> None:
        while not self._done.wait(self.period):
            self.sample()

    def __enter__(self) -> DevicePoll:
        self.sample()
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.index)
        self._done.set()
        self.join()
        self.sample()
