"""The output cache: what an engine keeps of its runs for the next one (ComfyUI's classic cache,
`comfy_execution/caching.py`), the one place node outputs and their `ui` are remembered.

One `CacheEntry(outputs, ui)` per node signature (graph/engine/planning.py: the node's class, its inputs, its
ancestors' signatures and what its IS_CHANGED says of the files it reads): the outputs later nodes take, and the
ComfyUI `ui` dict the node returned (None when it returned none). A node whose signature is cached does not run
again: the engine takes its outputs from the entry, and the server (and a fleet worker, which runs the server's
worker) tells the client the entry's `ui` again, as ComfyUI sends `executed` for a cached output node.

The rule that bounds it: after every run (finished, failed or interrupted) the cache holds the entries of that
run's prompt only (`keep`: earlier prompts' entries the prompt does not share are dropped), and of those at most
`max_entries` entries and `max_bytes` bytes of arrays (tensors; an array shared by several entries counts once).
Over either bound the entries holding the most array bytes go first, and among equals the one the run had last
(the engine gives them in the order its run had them: cached ones, then as they ran); a model handle holds no
array and loaders run first, so the loaders' entries, which keep their models' weights in the ledger, go last.

The engine owns its cache: `clear()` empties it (ComfyUI's /free), `close()` empties it for good (the engine
has ended; what a later run would keep is dropped). Torch-free: an array is anything with a `shape` and an integer
`nbytes` (a tensor, a numpy array; not a ModelInfo, whose `nbytes` are weights the ledger holds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, KeysView, Mapping
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 1000  # entries kept at most (a batch of 16 text-to-image prompts, loaders shared, makes 83 at most)
MAX_BYTES = 8 * 2**30  # array bytes kept at most (a 1024x1024 image is 12 MiB as a float32 IMAGE)


@dataclass(frozen=True)
class CacheEntry:
    """One node's result: its outputs as later nodes take them, and the `ui` dict it returned (or None)."""

    outputs: tuple
    ui: dict | None = None


def array_bytes(value: Any, seen: set[int] | None = None) -> int:
    """The bytes of the arrays (anything with a `shape` and an integer `nbytes`: tensors, numpy arrays) in `value`,
    looked for in tuples, lists, dicts and dataclasses; an array already in `seen` (by id) counts 0, and is added.

    >>> class A:
    ...     shape, nbytes = (2,), 8
    >>> a = A()
    >>> array_bytes(([a, {"x": a}], A()))
    16
    """
    seen = set() if seen is None else seen
    if hasattr(value, "shape") and isinstance(getattr(value, "nbytes", None), int):
        if id(value) in seen:
            return 0
        seen.add(id(value))
        return value.nbytes
    if isinstance(value, tuple | list):
        return sum(array_bytes(v, seen) for v in value)
    if isinstance(value, dict):
        return sum(array_bytes(v, seen) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(array_bytes(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    return 0


class OutputCache:
    """Node results by signature, bounded as the module doc says. Not thread-safe: its engine's lock guards it."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: dict[str, CacheEntry] = {}
        self._bytes: dict[str, int] = {}  # signature -> the array bytes its entry adds
        self._closed = False

    def __contains__(self, signature: object) -> bool:
        return signature in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __getitem__(self, signature: str) -> CacheEntry:
        return self._entries[signature]

    def get(self, signature: str) -> CacheEntry | None:
        return self._entries.get(signature)

    def signatures(self) -> KeysView[str]:
        return self._entries.keys()

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    @property
    def nbytes(self) -> int:
        """The array bytes the entries hold (each array once)."""
        return sum(self._bytes.values())

    def keep(self, entries: Mapping[str, CacheEntry]) -> list[str]:
        """Hold `entries` (a run's, by signature, in the prompt's order) in place of what was held, within the
        bounds; returns the signatures of `entries` left out for them."""
        if self._closed:
            return list(entries)
        seen: set[int] = set()
        sizes = {s: array_bytes(e.outputs, seen) for s, e in entries.items()}
        order = list(entries)
        first = sorted(range(len(order)), key=lambda i: (sizes[order[i]], i), reverse=True)  # the order they go in
        total, count, out = sum(sizes.values()), len(order), []
        for i in first:
            if count <= self.max_entries and total <= self.max_bytes:
                break
            out.append(order[i])
            total, count = total - sizes[order[i]], count - 1
        gone = set(out)
        self._entries = {s: e for s, e in entries.items() if s not in gone}
        self._bytes = {s: sizes[s] for s in self._entries}
        return out

    def clear(self) -> None:
        self._entries, self._bytes = {}, {}

    def close(self) -> None:
        """Empty it for good: a closed cache keeps nothing."""
        self.clear()
        self._closed = True


__all__ = ["MAX_BYTES", "MAX_ENTRIES", "CacheEntry", "OutputCache", "array_bytes"]
