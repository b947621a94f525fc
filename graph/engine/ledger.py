"""The residency ledger: where every model's weights are (GPU, pinned host copy, only the file).

Owned by the executor and changed only by the plan's Load/Unload steps; it decides nothing.

- A model loaded from the file with a pinned copy wanted (`Load(pin=True)`) is read into ONE host buffer
  first (parallel positional reads, see models.common.load_weights), page-locked, and copied to the GPU
  in one transfer: the file is read once. The executor may start that read early in a background
  thread (`pin`), while an earlier node computes.
- A model loaded from the file without a pinned copy goes straight onto the GPU, one tensor at a time,
  so host memory never holds it whole.
- `Unload(to="pinned")` drops the GPU copy; nothing moves. A later `Load(source="pinned")` waits for the
  pinned copy if it is still being read, then copies the whole buffer to the GPU in one transfer, at the
  host link's full speed, and points the parameters at views of it.
- `Unload(to="drop")` forgets the model's weights everywhere; a later load reads the file again.
- A node that streams a model block by block leaves its resident part (the weights outside the blocks and the
  resident blocks, one device buffer: models/streaming.py `Kept`) here after it ends; it is on the GPU under the
  part's own key (graph/plan/residency.py `part_key`) until the next node streaming the model takes it over, or an
  `Unload` of that key frees it.
- LoRAs merged into a GPU-resident model's weights (models/lora.py) stay there until another set is merged, the model
  is unloaded or loaded again (its weights are then the host copy's, which a merge never writes). `merged` tells the
  next plan what is merged now; nodes note each merge and restore (`note_lora`) as "merge" and "restore" events.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ...models import loading, lora
from ...models.streaming import Kept
from ...nodes.types import ModelInfo
from ..plan import residency
from ..plan.planner import ModelCost, Residency

log = logging.getLogger("vramgraph.ledger")


@dataclass
class HostCopy:
    module: torch.nn.Module  # parameters are views of `flat` (or plain CPU tensors without CUDA)
    host: dict[str, torch.Tensor]  # name -> host tensor
    flat: torch.Tensor | None  # the one pinned buffer, or None


@dataclass
class Entry:
    info: ModelInfo
    copy: HostCopy | None = None  # the pinned (or CPU) host copy, once read
    pending: Future | None = None  # the background read of that copy
    gpu_module: torch.nn.Module | None = None  # a copy loaded straight from the file onto the GPU
    gpu_flat: torch.Tensor | None = None  # the GPU copy of `copy.flat` while loaded from it
    on_device: bool = False
    kept: Kept = field(default_factory=Kept)  # the resident part a streaming node left on the GPU

    @property
    def part(self) -> str | None:
        """The key of the kept part on the GPU, None when there is none."""
        return residency.part_key(self.info.key, self.kept.blocks) if self.kept.nbytes else None

    @property
    def pinned(self) -> bool:
        return self.copy is not None or self.pending is not None

    @property
    def module(self) -> torch.nn.Module | None:
        if self.gpu_module is not None:
            return self.gpu_module
        return self.copy.module if self.copy is not None else None


@dataclass(frozen=True)
class Event:
    kind: str  # "load", "unload", "pin", "merge", "restore"
    model: str
    source: str
    seconds: float
    nbytes: int


EVENTS_KEPT = 4096  # a run of 64 prompts with 3 models, each swapped at every node, notes under 1000


@dataclass
class EventLog:
    """The ledger's moves, bounded: the last `kept` events, a count of every event ever noted (the mark), and a count
    per kind. A reader takes `mark()` before a run and `since(mark)` after it, so an old run's events are never kept
    for a new one's sake (the log of a server that runs for days stays `kept` long)."""

    kept: int = EVENTS_KEPT
    noted: int = 0  # every event ever noted: marks count from here
    kinds: dict[str, int] = field(default_factory=dict)  # kind -> events of that kind ever noted
    _recent: deque[Event] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.kept)

    def note(self, ev: Event) -> None:
        self._recent.append(ev)  # the oldest falls out past `kept`
        self.noted += 1
        self.kinds[ev.kind] = self.kinds.get(ev.kind, 0) + 1

    def mark(self) -> int:
        return self.noted

    def since(self, mark: int) -> list[Event]:
        """The events noted after `mark` (a `mark()` taken earlier). More than `kept` of them: only the last `kept`
        are left, and a warning says how many were dropped."""
        wanted = self.noted - mark
        if wanted < 0:
            raise ValueError(f"mark {mark} is after the {self.noted} events noted: take it with mark()")
        if wanted > len(self._recent):
            log.warning("%d ledger events since mark %d, only the last %d kept", wanted, mark, len(self._recent))
        return list(self._recent)[max(0, len(self._recent) - wanted):]

    def count(self, kind: str) -> int:
        """Events of `kind` ("load", "unload", "pin") ever noted, the dropped ones too."""
        return self.kinds.get(kind, 0)

    def __iter__(self) -> Iterator[Event]:
        return iter(tuple(self._recent))

    def __len__(self) -> int:
        return len(self._recent)


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    return named


@dataclass
class Ledger:
    device: torch.device
    entries: dict[str, Entry] = field(default_factory=dict)
    events: EventLog = field(default_factory=EventLog)  # the last moves: mark() / since(mark), count(kind)
    _pool: ThreadPoolExecutor | None = None

    def register(self, info: ModelInfo) -> None:
        if info.key not in self.entries:
            self.entries[info.key] = Entry(info)

    @property
    def on_gpu(self) -> frozenset[str]:
        """The keys of the models on the GPU, and of the kept parts there."""
        keys = {k for k, e in self.entries.items() if e.on_device}
        return frozenset(keys | {e.part for e in self.entries.values() if e.part is not None})

    def model_costs(self) -> dict[str, ModelCost]:
        """What the planner must know of every model here."""
        return {key: ModelCost(key, e.info.nbytes, e.info.label) for key, e in self.entries.items()}

    def residency(self) -> Residency:
        """Where the weights are now, as a plan starts from it: the kept parts with their real bytes."""
        kept = tuple(ModelCost(e.part, e.kept.nbytes, residency.part_label(e.info.label, e.kept.blocks))
                     for e in self.entries.values() if e.part is not None)
        return Residency(self.on_gpu, self.pinned, kept)

    def merged(self) -> dict[str, tuple]:
        """Per GPU-resident model whose weights hold merged LoRAs, their signatures (models/lora.py
        `merged_signature`): what the next plan may count as done."""
        out = {}
        for key, e in self.entries.items():
            module = e.module if e.on_device else None
            signature = lora.merged_signature(module) if module is not None else None
            if signature is not None:
                out[key] = signature
        return out

    def note_lora(self, key: str, done: lora.Applied) -> None:
        """A node applied LoRAs to model `key`: the bytes it merged and restored (nothing when the same set was
        merged already), as "merge" and "restore" events."""
        if not (done.merged or done.restored):
            return
        label = self.entries[key].info.label if key in self.entries else key
        if done.restored:
            self.events.note(Event("restore", key, "host", 0.0 if done.merged else done.seconds, done.restored))
        if done.merged:
            self.events.note(Event("merge", key, "lora", done.seconds, done.merged))
        log.info("%s: LoRAs merged into %.2f GiB, %.2f GiB restored, in %.3f s", label, done.merged / 2**30,
                 done.restored / 2**30, done.seconds)

    def kept(self, key: str) -> Kept:
        """Where a node streaming model `key` finds and leaves its resident part."""
        return self.entries[key].kept

    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(k for k, e in self.entries.items() if e.pinned)

    def _read_host(self, info: ModelInfo) -> HostCopy:
        if info.spec is None:
            raise RuntimeError(f"{info.label} '{info.key}' has no checkpoint file; it can be planned, not run")
        pinned = self.device.type == "cuda"
        t0 = time.perf_counter()
        module = loading.load(info.spec, dtype=info.dtype, device="pinned" if pinned else "cpu")
        module.requires_grad_(False).eval()
        tensors = _tensors(module)
        flat = None
        if pinned:  # every tensor is a view of one page-locked buffer (models.common.host_pages, pin_pages)
            storage = next(iter(tensors.values())).untyped_storage()
            flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        self._note(Event("pin", info.key, "file", time.perf_counter() - t0, info.nbytes), info)
        return HostCopy(module, {n: t.data for n, t in tensors.items()}, flat)

    def _host(self, e: Entry) -> HostCopy:
        """The host copy, waiting for its background read if it is still running."""
        if e.pending is not None:  # a failed read is not kept: the next load reads the (maybe fixed) file again
            pending, e.pending = e.pending, None
            e.copy = pending.result()
        if e.copy is None:
            e.copy = self._read_host(e.info)
        return e.copy

    def pin(self, key: str) -> None:
        """Start reading the pinned host copy from the file in the background (no-op if there is one)."""
        e = self.entries[key]
        if e.copy is None and e.pending is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vramgraph-pin")
            e.pending = self._pool.submit(self._read_host, e.info)

    def ensure_pinned(self, key: str) -> None:
        """Make sure the pinned host copy exists (reading it now, or waiting for its background read)."""
        self._host(self.entries[key])

    def load(self, key: str, source: str = "pinned", pin: bool = False) -> None:
        e = self.entries[key]
        if e.on_device:
            return
        e.kept.drop()  # (the plan unloads a kept part before its model loads whole)
        t0 = time.perf_counter()
        if source == "file" and self.device.type == "cuda" and not pin:
            if e.info.spec is None:
                raise RuntimeError(f"{e.info.label} '{e.info.key}' has no checkpoint file; it can be planned, not run")
            module = loading.load(e.info.spec, dtype=e.info.dtype, device=self.device)
            e.gpu_module = module.requires_grad_(False).eval()
        else:
            copy = self._host(e)
            if copy.flat is not None:  # one copy of the whole pinned buffer, then views at the same offsets
                e.gpu_flat = torch.empty(copy.flat.shape, dtype=torch.uint8, device=self.device)
                e.gpu_flat.copy_(copy.flat, non_blocking=True)
                for name, t in _tensors(copy.module).items():
                    h = copy.host[name]
                    off = h.storage_offset() * h.element_size()
                    t.data = e.gpu_flat[off:off + h.numel() * h.element_size()].view(h.dtype).view(h.shape)
                torch.cuda.synchronize(self.device)
            elif self.device.type != "cpu":
                for name, t in _tensors(copy.module).items():
                    t.data = copy.host[name].to(self.device, non_blocking=True)
                torch.cuda.synchronize(self.device)
            if self.device.type != "cpu":
                lora.forget(copy.module)  # its parameters are a fresh copy of the base weights: nothing merged
        e.on_device = True
        self._note(Event("load", key, source, time.perf_counter() - t0, e.info.nbytes), e.info)

    def unload(self, key: str, to: str = "pinned") -> None:
        base = residency.part_of(key)
        if base is not None:  # a kept part: its buffer is freed, the model's host copy stays as it is
            e = self.entries[base]
            nbytes, blocks = e.kept.nbytes, len(e.kept.blocks)  # (whatever part is there: the plan wants the room)
            e.kept.drop()
            self.events.note(Event("unload", key, "pinned", 0.0, nbytes))
            log.info("%s: its kept part (%d blocks, %.2f GiB) unloaded", e.info.label, blocks, nbytes / 2**30)
            return
        e = self.entries[key]
        t0 = time.perf_counter()
        if to == "drop":
            e.kept.drop()
        e.gpu_module = None
        if e.copy is not None and self.device.type != "cpu":  # the host copy's parameters point home again
            for name, t in _tensors(e.copy.module).items():
                t.data = e.copy.host[name]
            lora.forget(e.copy.module)
        e.gpu_flat = None
        if to == "drop":
            if e.pending is not None:
                e.pending.cancel()
            e.copy, e.pending = None, None
        e.on_device = False
        self._note(Event("unload", key, to, time.perf_counter() - t0, e.info.nbytes), e.info)

    def _note(self, ev: Event, info: ModelInfo) -> None:
        self.events.note(ev)
        onto = "onto the GPU" if self.device.type == "cuda" else f"for the {self.device.type.upper()}"
        what = {"pin": "read from its file into host RAM", "load": f"loaded {onto} from {ev.source}",
                "unload": "dropped" if ev.source == "drop" else "unloaded (host copy kept)"}[ev.kind]
        rate = f" ({ev.nbytes / ev.seconds / 1e9:.1f} GB/s)" if ev.kind != "unload" and ev.seconds > 0 else ""
        log.info("%s %.2f GiB %s in %.2f s%s", info.label, ev.nbytes / 2**30, what, ev.seconds, rate)

    def host_module(self, key: str) -> torch.nn.Module:
        """The host copy's module (read now if there is none yet), for a node that streams the weights."""
        e = self.entries[key]
        if e.on_device:
            raise RuntimeError(f"model {key} is on the GPU; the plan streams only models that are not resident")
        return self._host(e).module

    def cpu_module(self, key: str) -> torch.nn.Module:
        """The model with its weights in host memory, for a node whose variant computes on the CPU (the CPU
        decode). The plan loads nothing for it, so nothing here changes where the weights are: the host copy
        when there is one and its parameters are at home (not pointing at a GPU copy), else a copy read from
        the file for this node only (the caller drops it after the node)."""
        e = self.entries[key]
        m = e.module
        if m is not None and all(t.device.type == "cpu" for t in _tensors(m).values()):
            return m
        if not e.on_device and e.pending is not None:  # a background read will give the host copy
            return self._host(e).module
        if e.info.spec is None:
            raise RuntimeError(f"{e.info.label} '{e.info.key}' has no checkpoint file; it can be planned, not run")
        t0 = time.perf_counter()
        module = loading.load(e.info.spec, dtype=e.info.dtype, device="cpu").requires_grad_(False).eval()
        log.info("%s %.2f GiB read from its file into host RAM for one node in %.2f s", e.info.label,
                 e.info.nbytes / 2**30, time.perf_counter() - t0)
        return module

    def module(self, key: str) -> torch.nn.Module:
        e = self.entries.get(key)
        module = e.module if e is not None else None
        if module is None:
            raise RuntimeError(f"model {key} is not loaded; the plan must load it before the node that uses it")
        return module

    def forget(self, keep: set[str]) -> None:
        """Drop models no cached output refers to any more."""
        for key in [k for k in self.entries if k not in keep]:
            self.unload(key, "drop")  # (its kept part too)
            del self.entries[key]
