"""Progress of a run as the tools people know show it: one record per step of a node, named by the node's title
and type, and a tqdm bar per node that draws them (the command line's, and the Python API's with
`progress=True`).

`with_progress(events, progress, prompt)` wraps an engine event callback: every "progress" event (ComfyUI's
websocket message: node, value, max) also reaches `progress` as a `Progress`, named from `prompt`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Events = Callable[[str, dict], None]


@dataclass(frozen=True)
class Progress:
    """Step `value` of `total` of node `node` (its `class_type`, and `title` as the workflow names it)."""

    node: str
    class_type: str
    title: str
    value: int
    total: int

    @property
    def label(self) -> str:
        """'Sampler (VGSampler)', or the type alone when the node has no title of its own."""
        return f"{self.title} ({self.class_type})" if self.title and self.title != self.class_type else \
            self.class_type or f"node {self.node}"


class ProgressBar:
    """A tqdm bar per node, labelled by its title and type. The bar starts at the first step seen, so its rate is
    over the steps it timed (a bar made at step 1 would count that step as taking no time)."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.node: str | None = None

    def __call__(self, p: Progress) -> None:
        from tqdm import tqdm

        if self.bar is None or self.node != p.node:
            self.close()
            self.node = p.node
            self.bar = tqdm(total=p.total, initial=p.value, desc=p.label, unit="step", leave=False,
                            dynamic_ncols=True)
        else:
            self.bar.update(p.value - self.bar.n)
        if p.value >= p.total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.node = None, None


def with_progress(events: Events | None, progress: bool | Callable[[Progress], None] | None,
                  prompt: Mapping[str, Any]) -> Events:
    """`events` (None: none) with every "progress" event also given to `progress` as a `Progress` (True: a
    `ProgressBar`; None or False: nothing more)."""
    forward: Events = events or (lambda kind, data: None)
    if not progress:
        return forward
    report: Callable[[Progress], None] = ProgressBar() if progress is True else progress  # type: ignore[assignment]

    def on_event(kind: str, data: dict) -> None:
        if kind == "progress":
            node = prompt.get(str(data.get("node")), {})
            report(Progress(str(data.get("node")), str(node.get("class_type", "")),
                            str(node.get("_meta", {}).get("title", "")), int(data["value"]), int(data["max"])))
        elif kind in ("execution_success", "execution_error", "execution_interrupted") and \
                isinstance(report, ProgressBar):
            report.close()
        forward(kind, data)

    return on_event
