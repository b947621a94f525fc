"""A GGUF file's header (its metadata and tensor table) parsed through a read-only memory map, fast.

The `gguf` package's `GGUFReader` builds a numpy array per metadata element: on a llama.cpp text encoder, whose
header carries Qwen3's 151,936 tokens and 151,387 merges, that took 15-18 s on this project's 2-core machine
(`GGUFReader` on a header of that size; our parse: well under a second), and validation reads headers more than
once. So the header is walked here, skipping array elements without materialising them, and keeping only the scalar
and string values plus the lengths of arrays. The layout and the type codes are the `gguf` package's (GGUF v2/v3,
little-endian, `GGUFValueType`, `GGMLQuantizationType`, the alignment in `general.alignment`); tests/test_gguf.py
checks this parse against `GGUFReader` on the same files.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# GGUFValueType -> struct format of its scalar (STRING = 8 and ARRAY = 9 are walked apart)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


class HeaderError(ValueError):
    """The header cannot be walked: it ends early, or holds a value of no known type."""


@dataclass(frozen=True)
class RawTensor:
    """One tensor as the header lists it: dimensions fastest first (GGUF's order), GGML type code, absolute offset."""

    name: str
    dims: tuple[int, ...]
    type_code: int
    offset: int


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]  # scalars and strings as values; arrays as ("array", element type, length)
    tensors: tuple[RawTensor, ...]
    data_offset: int


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise HeaderError(f"the header ends early (at byte {len(self.buf)})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise HeaderError(f"the header ends early (a string of {n} bytes at byte {self.pos})")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", "replace")

    def skip_strings(self, count: int) -> None:
        unpack, buf, pos, end = struct.unpack_from, self.buf, self.pos, len(self.buf)
        for _ in range(count):
            if pos + 8 > end:
                raise HeaderError("the header ends early (inside an array of strings)")
            pos += 8 + unpack("<Q", buf, pos)[0]
        if pos > end:
            raise HeaderError("the header ends early (inside an array of strings)")
        self.pos = pos

    def value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, count = self.take("<I"), self.take("<Q")
            if inner == STRING:
                self.skip_strings(count)
            elif inner in SCALARS:
                self.pos += struct.calcsize(SCALARS[inner]) * count
                if self.pos > len(self.buf):
                    raise HeaderError("the header ends early (inside an array)")
            elif inner == ARRAY:
                for _ in range(count):
                    self.value(ARRAY)
            else:
                raise HeaderError(f"an array of unknown value type {inner}")
            return ("array", inner, count)
        raise HeaderError(f"a value of unknown type {kind}")


def _walk(buf: Any, keep_arrays: tuple[str, ...]) -> Header:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise HeaderError("no GGUF magic")
    cur.pos = 4
    version = cur.take("<I")
    if version not in VERSIONS:
        big = version & 0xFFFF == 0
        raise HeaderError("a big-endian GGUF file, which vramgraph does not read" if big else
                          f"GGUF version {version}, which vramgraph does not read (it reads {VERSIONS})")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, kind = cur.string(), cur.take("<I")
        if kind == ARRAY and key.startswith(keep_arrays):  # a small integer list (comfy.gguf.orig_shape.*)
            inner, count = cur.take("<I"), cur.take("<Q")
            if inner not in SCALARS or count > 8:
                raise HeaderError(f"metadata {key} is not a short list of numbers")
            meta[key] = tuple(cur.take(SCALARS[inner]) for _ in range(count))
            continue
        meta[key] = cur.value(kind)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("<I")
        if n_dims > 8:
            raise HeaderError(f"tensor {name} has {n_dims} dimensions")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise HeaderError(f"general.alignment {align!r} is not a power of two")
    start = -(-cur.pos // align) * align
    tensors = tuple(RawTensor(name, dims, code, start + off) for name, dims, code, off in infos)
    return Header(version, meta, tensors, start)


def read_gguf_header(path: Path, keep_arrays: tuple[str, ...] = ("comfy.gguf.orig_shape.",)) -> Header:
    """The header of the GGUF file at `path` (HeaderError if it cannot be walked; OSError if it cannot be read)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        view = memoryview(buf)
        try:
            return _walk(view, keep_arrays)
        finally:
            view.release()
