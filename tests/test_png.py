"""nodes/png.py: pictures any PNG reader decodes to the same pixels and text, deflated in parallel pieces."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from vramgraph.nodes import png


def _read(data: bytes) -> tuple[np.ndarray, dict]:
    im = Image.open(io.BytesIO(data))
    im.load()
    return np.asarray(im), dict(im.info)


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 5, 1), (64, 48, 4), (600, 700, 3)])
@pytest.mark.parametrize("level", [0, 1, 4, 9])
def test_pixels_round_trip(shape, level):
    rng = np.random.default_rng(sum(shape) + level)
    y, x = np.mgrid[0 : shape[0], 0 : shape[1]]
    smooth = (x[..., None] * 3 + y[..., None] * 2 + np.arange(shape[2]) * 40) % 256
    for pixels in (rng.integers(0, 256, shape, dtype=np.uint8), smooth.astype(np.uint8)):
        data = png.encode(pixels, level=level)
        if pixels.nbytes > 4 * png.PIECE:
            assert data.count(b"IDAT") == 1  # one stream made of several parallel pieces
        got, _ = _read(data)
        assert np.array_equal(got.reshape(shape), pixels)


def test_text_chunks_read_back_as_pil_writes_them():
    text = {"prompt": '{"3": {"inputs": {"text": "a cat"}}}', "workflow": "{}", "seed": "42",
            "note": "café, 東京 and emoji 🐱"}
    data = png.encode(np.zeros((4, 4, 3), np.uint8), text)
    _, info = _read(data)
    assert {k: info[k] for k in text} == text
    assert b"tEXtprompt\0" in data and b"iTXtnote\0" in data  # Latin-1 text plain, the rest as UTF-8


def test_bad_input_and_no_half_written_file(tmp_path):
    with pytest.raises(ValueError, match="expected an"):
        png.encode(np.zeros((4, 4, 2), np.uint8))
    with pytest.raises(ValueError, match="expected an"):
        png.encode(np.zeros((4, 4, 3), np.float32))
    target = tmp_path / "a.png"
    png.write(target, np.full((3, 3, 3), 200, np.uint8), {"k": "v"})
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]
    assert _read(target.read_bytes())[1]["k"] == "v"


def test_a_failed_save_leaves_no_part_file(tmp_path):
    """The rename onto the final name fails (a folder has that name): the temporary .part file is removed."""
    (tmp_path / "taken.png").mkdir()
    with pytest.raises(OSError):
        png.write(tmp_path / "taken.png", np.full((3, 3, 3), 10, np.uint8))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.png"]
    assert (tmp_path / "taken.png").is_dir()
