"""Images from outside (uploads, LoadImage, masks, previews of input files) are measured before they are decoded.

A PNG of 21 KB can decompress to 13000x13000 pixels (676 MB as RGBA, 2 GB as float32): PIL reads only the header
on open, so the size is known before any pixel is decoded. `open_image` refuses an image of more than
`max_pixels` pixels (width x height of its first frame; our readers decode the first frame only) with
`ImageTooLarge`, saying the size, the cap and how to raise it. The cap is `max_image_pixels` in the config file
(vramgraph.json), default MAX_IMAGE_PIXELS: 2**25 pixels (33.5 megapixels: 8K UHD, 7680x4320, fits; 13000x13000
does not), about 400 MB as a float32 RGB image.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MAX_IMAGE_PIXELS = 2**25
RAISE_IT = "raise \"max_image_pixels\" in the config file (vramgraph.json) if this machine has the memory for it"


class ImageTooLarge(ValueError):
    """An image over the pixel cap, refused before decoding."""

    def __init__(self, width: int, height: int, cap: int, what: str = "the image") -> None:
        size = f"{width}x{height} = {width * height:,} pixels" if width > 0 else "far more pixels than PIL allows"
        super().__init__(f"{what} is {size}, over the cap of {cap:,} pixels; it is refused before decoding "
                         f"(scale it down, or {RAISE_IT})")
        self.width, self.height, self.cap = width, height, cap


def check_size(width: int, height: int, cap: int, what: str = "the image") -> None:
    if width <= 0 or height <= 0 or width * height > cap:
        raise ImageTooLarge(width, height, cap, what)


@contextmanager
def open_image(source: str | Path | bytes, max_pixels: int, what: str = "the image") -> Iterator[Any]:
    """PIL's Image.open of a path or of bytes, its size checked against `max_pixels` before anything is decoded.
    Raises ImageTooLarge, or what PIL raises for a file that is not an image (OSError and others)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():  # PIL's warning for a big image: this function decides (the cap)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(source) if isinstance(source, bytes | bytearray) else source)
    except Image.DecompressionBombError:  # PIL's own check (over twice its limit) came first: far over ours
        raise ImageTooLarge(-1, -1, max_pixels, what) from None
    with opened as im:
        check_size(*im.size, max_pixels, what)
        yield im


__all__ = ["MAX_IMAGE_PIXELS", "ImageTooLarge", "check_size", "open_image"]
