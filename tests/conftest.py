"""Test configuration: tests marked `gpu` need CUDA and are skipped cleanly without it; shared fixtures
(tiny random-weight models, small input images) for the end-to-end tests."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# One CPU thread per process without a CUDA device: the tiny models' operations are too small to share out, and
# OpenMP's spinning threads make a shared 2-core machine several times slower (tests/test_qwen3.py measured 5x).
# The environment variable reaches the processes the tests start (servers, workers, the README's commands); a
# value set by the caller is kept.
if not torch.cuda.is_available():
    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))



@pytest.fixture(autouse=True, scope="session")
def _one_tokenizer_per_file_content() -> Iterator[None]:
    """The real Qwen3 tokenizer.json takes 0.6 s of CPU to load, and every engine's catalogue loads its own (the
    library keeps one per catalogue): in the tests, a process loads each tokenizer file's content once. Files that
    fail to load are not remembered (the error is raised every time, as without this)."""
    from vramgraph.models.qwen3 import PromptTokenizer

    loaded: dict[str, PromptTokenizer] = {}
    original = PromptTokenizer.from_file

    def from_file(path: str | Path, max_length: int = 512, pad_id: int = 151643) -> PromptTokenizer:
        try:
            key = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            return original(path, max_length, pad_id)
        if key not in loaded:
            loaded[key] = original(path, max_length, pad_id)
        # the same parsed vocabulary, in a PromptTokenizer of its own (its file, its lengths)
        return PromptTokenizer(loaded[key].tokenizer, max_length, pad_id, origin=str(path))

    PromptTokenizer.from_file = from_file  # type: ignore[method-assign]
    yield
    PromptTokenizer.from_file = original  # type: ignore[method-assign]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a keyword: a parameter may be named gpu
            item.add_marker(skip)


# With VRAMGRAPH_NO_SKIPS=1 (.ci/run sets it) a skipped test fails the run unless it is marked `gpu`: a missing
# browser, broker or package must not pass CI unseen.
UNEXPECTED_SKIPS = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    skipped: list[str] = []
    config.stash[UNEXPECTED_SKIPS] = skipped

    class SkipGuard:
        """Every skipped test's report, where it reaches the process that sums up the run (with pytest-xdist that is
        the controller, which gets the workers' reports: a worker's own items are not there)."""

        @staticmethod
        def pytest_runtest_logreport(report: pytest.TestReport) -> None:
            if report.skipped and "gpu" not in report.keywords and os.environ.get("VRAMGRAPH_NO_SKIPS") == "1":
                skipped.append(report.nodeid)

    config.pluginmanager.register(SkipGuard(), "vramgraph-skip-guard")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.stash[UNEXPECTED_SKIPS]:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    skipped = config.stash[UNEXPECTED_SKIPS]
    if skipped:
        terminalreporter.section("skipped, but must run here (VRAMGRAPH_NO_SKIPS=1)", red=True)
        for nodeid in skipped:
            terminalreporter.line(nodeid)



# ------------------------------------------------------------------------------------ shared fixtures
# Tiny random-weight models and small input images for the end-to-end tests (engine, CLI, ComfyUI templates).

# File names the shipped workflows and ComfyUI's six FLUX.2 [klein] templates reference, all served by the same tiny
# models (the 9B names too: tiny models have no size). The fp8 and fp8mixed names are real fp8 files (TINY_FP8).
# full_encoder_small_decoder is a real (tiny) small decoder: a narrower decoder than its encoder. ALT_TRANSFORMER is a
# second transformer file (a different model to the engine: another path) with the same weights.
ALT_TRANSFORMER = "flux-2-klein-4b-alt.safetensors"
TINY_MODEL_NAMES = {
    "transformer": ["flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors",
                    "flux-2-klein-4b-fp8.safetensors", "flux-2-klein-base-4b-fp8.safetensors",
                    "flux-2-klein-9b-fp8.safetensors", "flux-2-klein-base-9b-fp8.safetensors",
                    "flux-2-klein-9b-kv-fp8.safetensors", ALT_TRANSFORMER],
    "text_encoder": ["qwen_3_4b.safetensors", "qwen_3_8b_fp8mixed.safetensors"],
    "vae": ["flux2-vae.safetensors"],
    "small_decoder": ["full_encoder_small_decoder.safetensors"],
}


def _block_linear(key: str) -> bool:
    return "_blocks." in key


def _not_layer_0(key: str) -> bool:
    return key.startswith("model.layers.") and not key.startswith("model.layers.0.")


# The fp8 files, as models.tiny.quantize_fp8's arguments: e4m3 per tensor, the other tensors in bf16. The transformers
# keep only their block linears in fp8, with an input scale each (BFL's klein fp8 files, by their size: shared/
# reference/checkpoint-formats.md 1e); each of ComfyUI's three markings serves at least one template, with and without
# the "model.diffusion_model." prefix. The fp8mixed encoder (which of its layers the real file stores in fp8 is not
# known) has every decoder layer's linears in fp8 but layer 0's, and its embedding in bf16.
FP8_BLOCKS = {"layers": _block_linear, "input_scale": 0.5, "rest": "bfloat16"}
TINY_FP8 = {
    "flux-2-klein-4b-fp8.safetensors": {**FP8_BLOCKS, "marking": "metadata", "prefix": "model.diffusion_model."},
    "flux-2-klein-base-4b-fp8.safetensors": {**FP8_BLOCKS, "marking": "comfy_quant"},
    "flux-2-klein-9b-fp8.safetensors": {**FP8_BLOCKS, "marking": "scaled_fp8", "prefix": "model.diffusion_model."},
    "flux-2-klein-base-9b-fp8.safetensors": {**FP8_BLOCKS, "marking": "metadata"},
    "flux-2-klein-9b-kv-fp8.safetensors": {**FP8_BLOCKS, "marking": "comfy_quant", "prefix": "model.diffusion_model."},
    "qwen_3_8b_fp8mixed.safetensors": {"marking": "comfy_quant", "layers": _not_layer_0, "rest": "bfloat16"},
}
# Input images: the shipped edit workflows' references and the images ComfyUI's edit templates load.
INPUT_IMAGES = {"reference.png": (80, 64), "reference_2.png": (64, 96), "handbag_white.png": (80, 64),
                "comfy_logo_blue.png": (64, 64), "robed_women.png": (64, 80), "pink_tone_chair.png": (64, 64),
                "car_interior_white.jpeg": (80, 64), "bold_outfit_woman.jpeg": (64, 80),
                "man_in_street.png": (80, 64), "safari_outfit.png": (64, 64)}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ComfyUI-style models/ folder (diffusion_models/, text_encoders/, vae/) of tiny models, read-only to tests."""
    from vramgraph.models.tiny import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("tiny") / "models", names=TINY_MODEL_NAMES, quantize=TINY_FP8)


@pytest.fixture(scope="session")
def input_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An input folder with small random RGB PNGs under INPUT_IMAGES' names (width, height)."""
    import numpy as np
    from PIL import Image

    folder = tmp_path_factory.mktemp("input")
    rng = np.random.default_rng(0)
    for name, (w, h) in INPUT_IMAGES.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
    return folder
