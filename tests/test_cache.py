"""The output cache notices change (issue 15, item 3), on the CPU with tiny models and real files.

Nodes that read files (LoadImage/VGLoadImage, the model loaders) have ComfyUI's `IS_CHANGED`: a small file's content
hash, a large one's (size, mtime_ns, inode). It is part of the node's signature and so of every signature after it:
overwriting the reference image of workflows/edit.json runs the reference encode again, replacing a model file reads
the new weights. Finished nodes stay cached after an interrupt or a failure: the rerun starts where the run stopped.

The edit workflow (workflows/edit.json), at 64x64:

    1 VGLoadTransformer ─────────────────────────────────────► 6 VGSampler ─► 7 VGVAEDecode ─► 8 VGSaveImage
    2 VGLoadTextEncoder ─► 4 VGTextEncode ─► 11 VGReferenceImage ─►┘                ▲
    3 VGLoadVAE ──────────────────────────────►┘ ▲                                 │
    10 VGLoadImage ──────────────────────────────┘                                 │
    5 VGEmptyLatent ─► 6                         3 ─────────────────────────────────┘
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.workflow.errors import InterruptedRun, NodeExecutionError
from vramgraph.models.tiny import write_tiny_models
from vramgraph.nodes.files import Folders, fingerprint, identity

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
NAMES = {"transformer": "flux-2-klein-4b.safetensors", "text_encoder": "qwen_3_4b.safetensors",
         "vae": "flux2-vae.safetensors"}


def shipped(name: str, size: int = 64) -> dict:
    prompt = json.loads((WORKFLOWS / f"{name}.json").read_text())
    prompt["5"]["inputs"].update(width=size, height=size)
    return prompt


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).copy()


def write_picture(path: Path, seed: int, size: tuple[int, int] = (80, 64)) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)


@pytest.fixture
def own_input(input_dir: Path, tmp_path: Path) -> Path:
    """A copy of the shared input folder this test may overwrite."""
    return Path(shutil.copytree(input_dir, tmp_path / "input"))


@pytest.fixture
def folders(tiny_models: Path, own_input: Path, tmp_path: Path) -> Folders:
    return Folders(models=(tiny_models,), input=own_input, output=tmp_path / "output", temp=tmp_path / "temp")


def ran(result: object) -> list[str]:
    return [n.node for n in result.nodes]  # type: ignore[attr-defined]


def test_overwritten_reference_image_runs_the_reference_encode_again(folders: Folders) -> None:
    engine = Engine(folders, device="cpu")
    first = engine.run(shipped("edit"))
    assert set(ran(first)) == set(shipped("edit")) and len(first.images) == 1

    again = engine.run(shipped("edit"))  # nothing touched: everything cached, nothing runs
    assert ran(again) == [] and set(again.cached) == set(shipped("edit")) and again.plan.steps == ()

    ref = folders.input / "reference.png"
    os.utime(ref, ns=(ref.stat().st_atime_ns, ref.stat().st_mtime_ns + 10**9))  # touched, same content (a hash)
    assert ran(engine.run(shipped("edit"))) == []

    write_picture(ref, seed=7)  # another picture under the same name
    third = engine.run(shipped("edit"))
    assert ran(third) == ["10", "11", "6", "7", "8"]  # the image, its encode and everything after it
    assert {"1", "2", "3", "4", "5"} <= set(third.cached)  # the text encode is not repeated
    assert third.loads == 0  # the models stayed where they were
    assert not np.array_equal(pixels(first.images[0]), pixels(third.images[0]))


def test_replaced_model_file_reruns_its_loader_and_everything_after(tmp_path: Path, own_input: Path) -> None:
    models = write_tiny_models(tmp_path / "models", names=NAMES)
    other = write_tiny_models(tmp_path / "other", seed=1, names=NAMES)  # the same shapes, other weights
    folders = Folders(models=(models,), input=own_input, output=tmp_path / "output", temp=tmp_path / "temp")
    engine = Engine(folders, device="cpu")
    first = engine.run(shipped("text_to_image"))
    assert first.loads == 3

    vae = models / "vae" / NAMES["vae"]
    os.replace(other / "vae" / NAMES["vae"], vae)  # as a download or a copy into models/ does
    second = engine.run(shipped("text_to_image"))
    assert ran(second) == ["3", "7", "8"]  # the loader and the decode after it; encode and sampling are cached
    assert second.loads == 1  # the new VAE is read from the file, not the old weights reused
    assert not np.array_equal(pixels(first.images[0]), pixels(second.images[0]))

    # the same result as a fresh engine that only ever saw the new file
    fresh = Engine(Folders(models=(models,), input=own_input, output=tmp_path / "fresh"), device="cpu")
    assert np.array_equal(pixels(fresh.run(shipped("text_to_image")).images[0]), pixels(second.images[0]))


def test_interrupt_at_the_sampler_keeps_what_finished(folders: Folders, tmp_path: Path) -> None:
    engine = Engine(folders, device="cpu")

    def stop(kind: str, data: dict) -> None:
        if kind == "progress" and data["node"] == "6" and data["value"] == 1:
            engine.interrupt()

    with pytest.raises(InterruptedRun) as info:
        engine.run(shipped("edit"), events=stop)
    assert info.value.node_id == "6"
    assert "finished nodes are cached" in str(info.value.to_dict())

    rerun = engine.run(shipped("edit"))
    assert ran(rerun) == ["6", "7", "8"]  # starts at the sampler
    assert {"4", "10", "11"} <= set(rerun.cached)  # the text encode and the reference encode are reported cached
    assert rerun.loads == 0

    whole = Engine(Folders(models=folders.models, input=folders.input, output=tmp_path / "whole"), device="cpu")
    assert np.array_equal(pixels(whole.run(shipped("edit")).images[0]), pixels(rerun.images[0]))


def test_a_failed_node_reruns_from_itself_once_fixed(folders: Folders) -> None:
    engine = Engine(folders, device="cpu")
    prompt = shipped("edit")
    # a negative prompt without the reference, with guidance: the sampler refuses it when it runs
    prompt["12"] = {"class_type": "VGTextEncode", "inputs": {"text_encoder": ["2", 0], "text": "blurry"}}
    prompt["6"]["inputs"].update(negative=["12", 0], guidance=2.0)
    with pytest.raises(NodeExecutionError) as info:
        engine.run(prompt)
    assert info.value.node_id == "6" and "reference latents" in str(info.value)

    prompt["6"]["inputs"]["guidance"] = 1.0  # the fix: guidance 1 ignores the negative
    rerun = engine.run(prompt)
    assert ran(rerun) == ["6", "7", "8"]
    assert {"4", "10", "11", "12"} <= set(rerun.cached)


def test_fingerprint_is_content_for_small_files_and_identity_changes_on_rewrite(tmp_path: Path) -> None:
    a = tmp_path / "a.png"
    write_picture(a, seed=1)
    before, ident = fingerprint(a), identity(a)
    data = a.read_bytes()
    a.unlink()
    a.write_bytes(data)  # the same bytes in a new file
    assert fingerprint(a) == before and fingerprint(a).startswith("sha256:")
    assert identity(a) != ident
    write_picture(a, seed=2)
    assert fingerprint(a) != before
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "x.safetensors").write_bytes(b"1")
    first = fingerprint(folder)
    (folder / "x.safetensors").write_bytes(b"22")
    assert first.startswith("stat:") and fingerprint(folder) != first
