"""Run a model whose weights live in (pinned) host memory with only some of its blocks on the device.

`stream_blocks(module, device, resident)` is a context manager. On entry the weights outside the blocks and
the blocks named in `resident` are copied to `device` once; every other block (a "streamed" block) is copied
into one of two staging buffers on the device for each of its forward calls. The copies run on a second CUDA
stream: when streamed block g starts computing, block g+1 is already on its way into the other buffer, and
when block g has computed, the copy of block g+2 into its buffer is queued behind an event recorded after that
compute (double buffering). The compute stream waits on the copy's event, never on the whole device. The order
is cyclic: after the last streamed block of a pass the first one of the next pass is prefetched.

The weights that stay for the node (outside the blocks, and the resident blocks) go into ONE device buffer. Given a
`Kept` (the ledger's, engine/ledger.py), that buffer outlives the node: on exit it is handed to the `Kept`, and the
next node that streams the same model with the same resident blocks computes from it without copying them again
(the plan counts it as a part of the model kept on the GPU between the two nodes, graph/plan/planner.py). A kept
buffer for other blocks is freed on entry, before anything is allocated.

The module says which submodules are its blocks, in the order a forward pass calls them
(`streamed_blocks()`), and which submodules stay in host memory (`host_only`, e.g. an embedding table looked up
on the host). On a CPU "device" the same partition runs with plain copies, so a test can check that a
streamed forward equals the resident one bit for bit. On exit every parameter points at its host copy again.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

ALIGN = 256  # bytes: each tensor's offset in a staging buffer, so its views are aligned as allocations are


def _tensors(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owner module, attribute name, tensor) of every parameter and buffer under `module`."""
    out = []
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                out.append((m, name, p))
        for name, b in m._buffers.items():
            if b is not None:
                out.append((m, name, b))
    return out


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Kept:
    """The device buffer of a streamed model's resident part (weights outside the blocks and the resident blocks),
    kept between the nodes that stream it: `blocks` says which blocks it holds, `buffer` is None when none is kept."""

    def __init__(self) -> None:
        self.blocks: tuple[int, ...] = ()
        self.buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def drop(self) -> None:
        self.blocks, self.buffer = (), None


class _Streamer:
    def __init__(self, module: nn.Module, device: torch.device, resident: Collection[int],
                 kept: Kept | None = None) -> None:
        self.device = device
        self.blocks: list[nn.Module] = list(module.streamed_blocks())
        keep = set(resident)
        bad = [i for i in keep if not 0 <= i < len(self.blocks)]
        if bad:
            raise ValueError(f"resident blocks {sorted(bad)} out of range: the model has {len(self.blocks)} blocks")
        self.kept, self.resident = kept, tuple(sorted(keep))
        self.order = [i for i in range(len(self.blocks)) if i not in keep]  # streamed blocks, in pass order
        host_only = [getattr(module, name) for name in getattr(module, "host_only", ())]
        in_blocks = {id(t) for b in self.blocks for _, _, t in _tensors(b)}
        on_host = {id(t) for h in host_only for _, _, t in _tensors(h)}
        self.home: list[tuple[nn.Module, str, torch.Tensor]] = []  # every tensor this moves, to point back on exit
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        # the weights outside the blocks and the resident blocks: in one buffer, copied now unless it is kept
        moved = [t for t in _tensors(module) if id(t[2]) not in in_blocks and id(t[2]) not in on_host]
        for i in self.resident:
            moved += _tensors(self.blocks[i])
        offsets, end = [], 0
        for _, _, t in moved:
            offsets.append(end)
            end += _aligned(t.data.numel() * t.data.element_size())
        reuse = kept is not None and kept.buffer is not None and kept.blocks == self.resident \
            and kept.nbytes == end and kept.buffer.device == device
        if kept is not None and not reuse:
            kept.drop()  # another part of the model: freed before this node allocates its own
        self.fixed = kept.buffer if reuse else torch.empty(end, dtype=torch.uint8, device=device)
        for (owner, name, t), off in zip(moved, offsets, strict=True):
            host = t.data
            self.home.append((owner, name, host))
            view = self.fixed[off:off + host.numel() * host.element_size()].view(host.dtype).view(host.shape)
            if not reuse:
                view.copy_(host, non_blocking=True)
            t.data = view
        # the streamed blocks: their tensors' places in a staging buffer
        self.layout: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}  # block -> (tensor, host, offset)
        size = 0
        for i in self.order:
            off = 0
            entries = []
            for owner, name, t in _tensors(self.blocks[i]):
                self.home.append((owner, name, t.data))
                entries.append((t, t.data, off))
                off += _aligned(t.data.numel() * t.data.element_size())
            self.layout[i] = entries
            size = max(size, off)
        self.nbuf = min(2, len(self.order))
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(self.nbuf)]
        self.ready: list[Any] = [None] * self.nbuf  # event: the buffer's copy has landed
        self.free: list[Any] = [None] * self.nbuf  # event: the buffer's block has computed
        self.fetched = 0  # streamed blocks queued for copy so far (over all passes)
        self.computed = 0  # streamed blocks computed so far
        self.slot_of: dict[int, int] = {}
        self.hooks = []
        for i in self.order:
            self.hooks.append(self.blocks[i].register_forward_pre_hook(self._before(i)))
            self.hooks.append(self.blocks[i].register_forward_hook(self._after(i)))
        for _ in range(self.nbuf):
            self._fetch()

    def _views(self, block: int, slot: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        buf = self.buffers[slot]
        return [(t, host, buf[off:off + host.numel() * host.element_size()].view(host.dtype).view(host.shape))
                for t, host, off in self.layout[block]]

    def _fetch(self) -> None:
        """Queue the copy of the next streamed block (cyclic over passes) into its buffer."""
        g = self.fetched
        slot, block = g % self.nbuf, self.order[g % len(self.order)]
        views = self._views(block, slot)
        if self.cuda:
            with torch.cuda.stream(self.side):
                if self.free[slot] is not None:
                    self.side.wait_event(self.free[slot])
                for _, host, view in views:
                    view.copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.side)
                self.ready[slot] = ev
        else:
            for _, host, view in views:
                view.copy_(host)
        self.fetched += 1

    def _before(self, block: int):
        def hook(mod: nn.Module, args: Any) -> None:
            g = self.computed
            expected = self.order[g % len(self.order)]
            if block != expected:
                raise RuntimeError(f"streamed block {block} ran where block {expected} was expected: the model "
                                   "must run its blocks in the order streamed_blocks() gives")
            slot = g % self.nbuf
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
            for t, _, view in self._views(block, slot):
                t.data = view
        return hook

    def _after(self, block: int):
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            slot = self.computed % self.nbuf
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                self.free[slot] = ev
            for t, host, _ in self.layout[block]:
                t.data = host
            self.computed += 1
            self._fetch()  # the block `nbuf` places further on goes into the buffer this one just left
        return hook

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        if self.cuda:  # the last prefetches must land before their buffers go back to the allocator
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        for owner, name, host in self.home:
            getattr(owner, name).data = host
        self.buffers = []
        if self.kept is not None:  # the resident part stays on the device for the next node that streams the model
            self.kept.blocks, self.kept.buffer = self.resident, self.fixed
        self.fixed = None


@contextmanager
def stream_blocks(module: nn.Module, device: torch.device | str, resident: Collection[int] = (),
                  kept: Kept | None = None) -> Iterator[nn.Module]:
    """`module` (weights in host memory) ready to run on `device` with only the `resident` blocks kept there; with
    `kept`, the resident part is taken from it when it holds the same blocks, and left in it on exit."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # as the tensors it allocates name it (a kept buffer's too)
        device = torch.device("cuda", torch.cuda.current_device())
    s = _Streamer(module, device, resident, kept)
    try:
        yield module
    finally:
        s.close()


def block_bytes(module: nn.Module) -> list[int]:
    """Bytes of each block's tensors, in pass order (what the plan's Blocks sizes estimate)."""
    return [sum(t.numel() * t.element_size() for _, _, t in _tensors(b)) for b in module.streamed_blocks()]
