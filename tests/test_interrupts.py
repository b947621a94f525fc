"""Interrupts land within one block of a long node (issue 15, item 5), on the CPU with tiny models.

The VAE decode and encode (the reference encode too) check for an interrupt after every resnet block, the text encode
after every layer, the tiled decode inside every tile: the same check the sampler makes between steps (the node
context's `check_interrupted`, which also stops a node that a `Cancel` left without outputs). The blocks reached are
counted with a torch forward hook on the real modules; the interrupt is asked from that hook, so where it is asked is
exact, and the test asserts how many blocks ran after it (none), never how long anything took.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.workflow.errors import InterruptedRun
from vramgraph.models.qwen3 import Qwen3Layer
from vramgraph.models.tiny import TINY_VAE
from vramgraph.models.vae import Flux2VAE, ResnetBlock
from vramgraph.nodes import ops
from vramgraph.nodes.estimates import tile_spans
from vramgraph.nodes.files import Folders

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"


def shipped(name: str, size: int = 64) -> dict:
    prompt = json.loads((WORKFLOWS / f"{name}.json").read_text())
    prompt["5"]["inputs"].update(width=size, height=size)
    return prompt


@pytest.fixture
def engine(tiny_models: Path, input_dir: Path, tmp_path: Path) -> Engine:
    return Engine(Folders(models=(tiny_models,), input=input_dir, output=tmp_path / "output", temp=tmp_path / "t"),
                  device="cpu")


class Blocks:
    """Counts forwards of `kind` modules while node `node` runs (told by the run's "executing" events) and asks the
    engine for an interrupt when the count reaches `stop_at` (0: never)."""

    def __init__(self, engine: Engine, node: str, kind: type, stop_at: int = 0) -> None:
        self.engine, self.node, self.kind, self.stop_at = engine, node, kind, stop_at
        self.running: str | None = None
        self.count = 0

    def events(self, kind: str, data: dict) -> None:
        if kind == "executing":
            self.running = data["node"]

    def hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self.running == self.node and isinstance(module, self.kind):
            self.count += 1
            if self.count == self.stop_at:
                self.engine.interrupt()

    @contextmanager
    def counting(self) -> Iterator[Blocks]:
        handle = torch.nn.modules.module.register_module_forward_hook(self.hook)
        try:
            yield self
        finally:
            handle.remove()


def test_interrupt_during_the_decode_lands_at_the_next_block(engine: Engine) -> None:
    blocks = Blocks(engine, "7", ResnetBlock, stop_at=4)  # the middle block's two resnets, then two of the up levels
    with blocks.counting(), pytest.raises(InterruptedRun) as info:
        engine.run(shipped("text_to_image"), events=blocks.events)
    assert (info.value.node_id, info.value.class_type) == ("7", "VGVAEDecode")
    assert blocks.count == 4  # not one block more ran after the interrupt
    assert list(engine.folders.output.rglob("*.png")) == []

    whole = Blocks(engine, "7", ResnetBlock)
    with whole.counting():
        rerun = engine.run(shipped("text_to_image"), events=whole.events)
    assert [n.node for n in rerun.nodes] == ["7", "8"]  # the sampling stayed cached
    assert whole.count == 2 + 2 * len(TINY_VAE.channels) > blocks.count  # a whole decode has 10 blocks


def test_interrupt_during_the_text_encode_lands_at_the_next_layer(engine: Engine) -> None:
    layers = Blocks(engine, "4", Qwen3Layer, stop_at=1)
    with layers.counting(), pytest.raises(InterruptedRun) as info:
        engine.run(shipped("text_to_image"), events=layers.events)
    assert (info.value.node_id, info.value.class_type) == ("4", "VGTextEncode")
    assert layers.count == 1  # of the tiny encoder's 27 layers


def test_interrupt_during_the_reference_encode_lands_at_the_next_block(engine: Engine) -> None:
    blocks = Blocks(engine, "11", ResnetBlock, stop_at=1)
    with blocks.counting(), pytest.raises(InterruptedRun) as info:
        engine.run(shipped("edit"), events=blocks.events)
    assert (info.value.node_id, info.value.class_type) == ("11", "VGReferenceImage")
    assert blocks.count == 1  # of the encoder's 6 (one per level, two in the middle block)


class Stop(Exception):
    pass


def test_the_tiled_decode_checks_inside_every_tile() -> None:
    torch.manual_seed(0)
    vae = Flux2VAE(TINY_VAE, parts=("decoder",)).eval()
    latent = torch.randn(1, 128, 65, 8)  # two tiles along the height: 65 cells and 9 cells
    assert len(tile_spans(65)) * len(tile_spans(8)) == 2
    per_tile = 1 + 2 * len(TINY_VAE.channels)  # after the middle block and after every resnet of the up levels

    calls: list[int] = []
    ops.vae_decode(vae, latent, "tiled", lambda: calls.append(1))
    assert len(calls) == 2 * per_tile

    asked = per_tile + 2  # inside the second tile

    def check() -> None:
        calls.append(1)
        if len(calls) == asked:
            raise Stop

    calls.clear()
    with pytest.raises(Stop):
        ops.vae_decode(vae, latent, "tiled", check)
    assert len(calls) == asked
