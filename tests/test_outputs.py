"""SaveImage and PreviewImage write what ComfyUI's own nodes write (nodes.py, folder_paths.get_save_image_path):
file names, counters, folders, ui entries and the `prompt` / `workflow` text chunks."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from vramgraph.nodes.output import TEMP_LETTERS, PreviewImage, SaveImage, fill_prefix

PROMPT = {"9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}}}
WORKFLOW = {"nodes": [{"id": 9, "type": "SaveImage", "widgets_values": ["ComfyUI"]}], "links": [], "version": 0.4}


@pytest.fixture
def vg(tmp_path):
    (tmp_path / "output").mkdir()
    return SimpleNamespace(output_dir=tmp_path / "output", temp_dir=tmp_path / "temp", seed=7)


def _images(n: int = 2, h: int = 12, w: int = 20) -> torch.Tensor:
    return torch.linspace(0, 1, n * h * w * 3).reshape(n, h, w, 3)


def test_save_image_names_counts_and_chunks_as_comfyui(vg):
    out = vg.output_dir
    for name in ("ComfyUI_00007_.webp", "ComfyUI_00003_.png", "ComfyUI_00009", "ComfyUI_00011.png",
                 "ComfyUI_temp_abcde_00050_.png", "ComfyUIx_00020_.png"):
        (out / name).write_bytes(b"")
    # counted: _00007_ (any extension), _00003_, _00009 (nothing after); not: 00011.png (no "_" after the digits),
    # another prefix's files
    images = _images()
    got = SaveImage().save_images(images, "ComfyUI", prompt=PROMPT, extra_pnginfo={"workflow": WORKFLOW}, vg=vg)
    assert got["ui"] == {"images": [{"filename": "ComfyUI_00010_.png", "subfolder": "", "type": "output"},
                                    {"filename": "ComfyUI_00011_.png", "subfolder": "", "type": "output"}]}
    assert set(got) == {"ui", "result"} and got["result"][0] is images  # passed on, as ComfyUI 0.29's SaveImage
    im = Image.open(out / "ComfyUI_00010_.png")
    assert im.size == (20, 12)
    assert list(im.text)[:2] == ["prompt", "workflow"]  # ComfyUI's order: the prompt, then extra_pnginfo's keys
    assert im.text["prompt"] == json.dumps(PROMPT) and im.text["workflow"] == json.dumps(WORKFLOW)
    assert im.text["seed"] == "7"
    raw = (out / "ComfyUI_00010_.png").read_bytes()
    assert b"tEXtprompt\0" + json.dumps(PROMPT).encode() in raw  # plain tEXt, as PIL's add_text writes ASCII


def test_save_image_subfolders_variables_and_batch_numbers(vg):
    ui = SaveImage().save_images(_images(1), "shots/%width%x%height%/pic", vg=vg)["ui"]["images"]
    assert ui == [{"filename": "pic_00001_.png", "subfolder": "shots/20x12", "type": "output"}]
    assert (vg.output_dir / "shots" / "20x12" / "pic_00001_.png").is_file()
    ui = SaveImage().save_images(_images(2), "b%batch_num%", vg=vg)["ui"]["images"]
    assert [e["filename"] for e in ui] == ["b0_00001_.png", "b1_00002_.png"]
    t = time.struct_time((2026, 3, 4, 5, 6, 7, 0, 0, 0))
    assert fill_prefix("%year%-%month%-%day%_%hour%%minute%%second%", 1, 1, t) == "2026-03-04_050607"
    with pytest.raises(ValueError, match="outside the output folder"):
        SaveImage().save_images(_images(1), "../escape", vg=vg)
    assert not (vg.output_dir.parent / "escape_00001_.png").exists()


def test_preview_image_goes_to_temp_under_a_random_prefix(vg):
    a, b = PreviewImage(), PreviewImage()
    for node in (a, b):
        assert re.fullmatch(f"_temp_[{TEMP_LETTERS}]{{5}}", node.prefix_append)
    ui = a.save_images(_images(2), prompt=PROMPT, extra_pnginfo={"workflow": WORKFLOW}, vg=vg)["ui"]["images"]
    names = [e["filename"] for e in ui]
    assert names == [f"ComfyUI{a.prefix_append}_00001_.png", f"ComfyUI{a.prefix_append}_00002_.png"]
    assert all(e["type"] == "temp" and e["subfolder"] == "" for e in ui)
    assert sorted(p.name for p in vg.temp_dir.iterdir()) == names and not any(vg.output_dir.iterdir())
    assert Image.open(vg.temp_dir / names[0]).text["prompt"] == json.dumps(PROMPT)
    assert list(PreviewImage.INPUT_TYPES()["required"]) == ["images"]
    assert set(PreviewImage.INPUT_TYPES()["hidden"]) >= {"prompt", "extra_pnginfo"}
