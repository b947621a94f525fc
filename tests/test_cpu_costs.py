"""The CPU variants' seconds come from bench/cpu_costs.py: its FLOP counts are the models' own, it times the tiny
models on this CPU in a moment, and the constants in nodes/estimates.py are its committed result."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from vramgraph.models.qwen3_config import Qwen3Config  # noqa: E402
from vramgraph.models.tiny import TINY_QWEN3  # noqa: E402
from vramgraph.models.vae_config import VAEConfig  # noqa: E402
from vramgraph.nodes import estimates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "cpu_costs.json"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cpu_costs", ROOT / "bench" / "cpu_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _encoder_flops(cfg: Qwen3Config, layers: int, tokens: int) -> int:
    """Per layer: 2 FLOPs per weight per token (q, k, v, o and the MLP's three) and the attention's two products."""
    h, heads, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    weights = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * cfg.intermediate_size
    return layers * (2 * tokens * weights + 4 * tokens * tokens * heads * d)


def test_the_encoders_flops_are_counted_as_its_formula(bench) -> None:
    cfg = Qwen3Config()
    for layers, tokens in ((1, 64), (2, 96)):
        assert bench.flops(bench._encode_call(cfg, layers, tokens, "meta", torch.bfloat16)) == \
            _encoder_flops(cfg, layers, tokens)


def test_the_decoders_flops_grow_with_its_pixels(bench) -> None:
    """Convolutions: 4x the FLOPs for 4x the pixels, and a little more (the middle block's attention)."""
    small, large = (bench.flops(bench._decode_call(VAEConfig(), n, "meta", torch.bfloat16)) for n in (8, 16))
    assert 4 < large / small < 4.1


def test_the_tiny_encoder_is_timed_on_this_cpu(bench) -> None:
    row = bench.timed("tiny", lambda device: bench._encode_call(TINY_QWEN3, 2, 16, device, torch.float32))
    assert row["flops"] == _encoder_flops(TINY_QWEN3, 2, 16)
    assert row["seconds"] > 0 and row["gflops_per_s"] > 0


def test_the_cpu_constants_are_the_committed_measurement() -> None:
    data = json.loads(RESULT.read_text())
    assert estimates.CPU_TEXT_ENCODE_SECONDS_PER_PROMPT == data["text_encode"]["seconds_per_prompt"]
    assert estimates.CPU_DECODE_SECONDS_PER_MPIXEL == data["decode"]["seconds_per_mpixel"]
    assert data["text_encode"]["real_flops"] == _encoder_flops(Qwen3Config(), Qwen3Config().n_built, 512)
    assert data["dtype"] == "bf16" and not data["quick"]
