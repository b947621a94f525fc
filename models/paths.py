"""Walking model folders the way users build them: symbolic links to files and to folders are followed.

Torch-free (listing and validation import it).
"""

from __future__ import annotations

import os
from pathlib import Path


def walk_files(root: Path, exts: tuple[str, ...]) -> list[str]:
    """The files under `root` with one of `exts` ('/'-separated relative names), following symbolic links to
    files and to folders (each real folder is entered once, so a link loop ends)."""
    found: list[str] = []
    seen: set[str] = set()
    for here, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        rel = Path(here).relative_to(root)
        for f in files:
            if f.lower().endswith(exts) and os.path.isfile(os.path.join(here, f)):  # a dangling link is no file
                found.append((rel / f).as_posix())
    return sorted(found)
