"""Pass 3's rules, the reference: the GPU as pass 3 sees it while it walks the order, one node at a time.

`GpuState` holds what is resident, pinned and loaded so far, and its methods are the rules of pass 3
(graph/plan/planner.py's docstring, docs/planner.md):

- `evict_cost(m, i, cur)`: what evicting model m before position i costs: nothing when m is never used again or must
  leave anyway before its next use (that node and m cannot fit together), else its reload seconds (its bytes over
  the bandwidth of its source: pinned copy, file, or a kept part's upload), with the distance to that next use.
- `evictions(i, v, total, skip)`: the models to unload so that v fits: cheapest first, ties to the farthest next use
  (Belady), then the largest; afterwards any of them that still fits is kept, the most costly first.
- `weigh(i, node)`: every variant priced (its seconds + loads of its missing models + reloads its evictions cause),
  the fastest taken, except that a variant within `TIE` of it that copies fewer bytes host->GPU wins.
- `apply(i, node, choice)`: the Unload, Load and Run rows of that choice, and the GPU after it.

`LookAhead` answers "which node next meets model m" by walking the order. graph/plan/assign.py walks the order with
these rules; its fast path only remembers choices and answers the look ahead from tables, and is checked plan for
plan against this reference (tests/test_plan_reference.py).

Pure: it sees sizes and predicted seconds (graph/plan/types.py), never tensors.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from . import residency
from .residency import BlockPlan
from .types import Budget, CostModel, Load, NodeCost, Residency, Run, Unload, gib

if TYPE_CHECKING:
    from ...nodes.types import Variant
    from .sizes import Sizes

INF = math.inf
PINNING = ", pinned while loading"  # a Load's note, after the node it is for, where it makes a pinned copy
TIE = 0.001  # variants whose predicted seconds are this close (relative) count as equally fast: the one that copies
#              fewer bytes host->GPU wins (a stream that copies 1.5x the bytes for 0.01 % less predicted time is
#              within the prediction's error, and its bytes are real: the link's power and other processes' copies)


# ------------------------------------------------------------------------------------------------ records


class Priced(NamedTuple):
    """A variant as weighed: its predicted seconds, None where it cannot run there."""

    variant: Variant
    seconds: float | None


class Tie(NamedTuple):
    """The fastest variant that lost to one within TIE of it that copies fewer bytes."""

    fastest: str
    seconds: float
    more_bytes: int


class RunNote(NamedTuple):
    """What a Run's note says, written out (`text`) only for the steps of the plan returned."""

    variant: Variant
    first: Variant  # the node's first (preferred) variant
    blocks: BlockPlan | None
    label: str  # the streamed model's name
    seconds: float
    options: tuple[Priced, ...]
    tie: Tie | None

    def text(self) -> str:
        """The variant's own note, what it streams, what it was chosen over when it is not the first, and, where it
        is not the fastest, the near tie that it won by copying fewer bytes."""
        v = self.variant
        parts = [v.note] if v.note else []
        if self.blocks is not None:
            parts.append(self.blocks.describe(self.label))
        if v is not self.first or self.tie:
            alts = ", ".join([f"{a.name}: does not fit" if ta is None else f"{a.name}: {ta:.3f} s"
                              for a, ta in self.options if a is not v])
            parts.append(f"chosen at {self.seconds:.3f} s over {alts}")
        if self.tie:
            parts.append(f"{self.tie.fastest} is within {TIE:.1%} of it and would copy {gib(self.tie.more_bytes)} "
                         "GiB more")
        return "; ".join(parts)


@dataclass(slots=True)
class Row:
    """One step of pass 3, as PlannedStep will show it (the note perhaps not written out yet). (A slotted record, not
    a NamedTuple nor a frozen dataclass: a queue's plan makes a thousand, and these are made in a fraction of the
    time.)"""

    step: Load | Unload | Run
    gpu_bytes: int
    resident: tuple[str, ...]
    seconds: float
    note: str | RunNote
    streams: tuple[str, ...] = ()
    blocks: BlockPlan | None = None


class Choice(NamedTuple):
    """What `weigh` chose for a node: the variant (its index), the models to unload first, its block plan if it
    streams, the kept part it takes over, its Run's seconds and note."""

    pick: int  # the variant's index in the node's variants
    unload: tuple[str, ...]
    blocks: BlockPlan | None
    takes: str | None
    seconds: float
    note: str | RunNote


class Option(NamedTuple):
    """A variant priced by `weigh`."""

    seconds: float  # predicted, with the loads and reloads it causes
    copied: int  # bytes it copies host->GPU
    pick: int  # the variant's index in the node's variants
    unload: list[str]
    blocks: BlockPlan | None
    read: float  # seconds reading a streamed model's file the first time
    takes: str | None  # the kept part it takes over


@dataclass(slots=True)
class Answer:
    """`evict_cost`'s answer for evicting `model` before variant `cur` runs: the reload seconds that causes and the
    distance to the model's next use. (Slotted, as Row.)"""

    model: str
    cur: Variant
    seconds: float
    distance: float

    def key(self, w: dict[str, int]) -> tuple[float, float, int]:
        """The order of evictions: cheapest first, then the farthest next use, then the largest."""
        return self.seconds, -self.distance, -w[self.model]


class Use(NamedTuple):
    """The next node that meets a model: its variant, and how many positions ahead."""

    variant: Variant
    distance: int


# ------------------------------------------------------------------------------------------------ look ahead


class LookAhead:
    """For evicting model m at position i: the first node after i, in this run and then (with `repeat`) in the next,
    whose variant uses m or cannot fit beside it. The nodes after i count with their provisional variant (none is
    chosen yet), those before i with their chosen one; position i in the next run is `cur`, the variant asking."""

    def __init__(self, order: list[int], prov: list[Variant], sizes: Sizes, gpu: int, repeat: bool) -> None:
        self.order, self.prov, self.sizes, self.gpu, self.repeat = order, prov, sizes, gpu, repeat

    def meets(self, m: str, v: Variant) -> bool | None:
        """True: v uses m; False: v and m cannot fit together (or m is a kept part of a model v loads whole);
        None: neither."""
        sizes = self.sizes
        if sizes.uses(m, v):
            return True
        return False if sizes.excludes(m, v) or sizes.weights(v.models) + sizes.w(m) + v.activation > self.gpu \
            else None

    def first(self, m: str, i: int, chosen: list[Variant | None], cur: Variant) -> Use | None:
        """The first node after position i that meets m, `cur` (position i in the next run) last; None if none."""
        order, n = self.order, len(self.order)
        for j in range(i + 1, n):
            if self.meets(m, self.prov[order[j]]) is not None:
                return Use(self.prov[order[j]], j - i)
        if not self.repeat:
            return None
        for k in range(i):
            v = chosen[order[k]]
            if v is not None and self.meets(m, v) is not None:
                return Use(v, n - i + k)
        return Use(cur, n) if self.meets(m, cur) is not None else None


# ------------------------------------------------------------------------------------------------ the GPU


class GpuState:
    """The GPU along pass 3: resident models (kept parts too) in the order they came, their bytes, the pinned copies,
    and the rows so far. `pins`: the models that get a pinned copy when first loaded (pass 2)."""

    def __init__(self, names: list[str], sizes: Sizes, budget: Budget, cm: CostModel, start: Residency,
                 pins: frozenset[str], look: LookAhead) -> None:
        self.names, self.sizes, self.gpu, self.cm, self.pins, self.look = names, sizes, budget.gpu, cm, pins, look
        self.w = {k: m.nbytes for k, m in sizes.models.items()}  # bytes of every model and kept part
        self.w.update((k, m.nbytes) for k, m in sizes.parts.items())
        self.resident: list[str] = sorted(start.gpu)
        self.kept: dict[str, str] = {}  # model -> the key of its kept part on the GPU (graph/plan/residency.py)
        for m in self.resident:
            base = sizes.base(m)
            if base is not None:
                self.kept[base] = m
        self.pinned: set[str] = set(start.pinned)
        self.held = sum(self.w[m] for m in self.resident)  # bytes of the resident weights
        self.held_start = self.held
        self.now = tuple(self.resident)  # a new tuple whenever the resident models change
        self.copies = frozenset(self.pinned)  # ... and a new set whenever a pinned copy is made
        self.chosen: list[Variant | None] = [None] * len(names)
        self.held_after = [0] * len(names)  # per node: the bytes of the weights resident after it
        self.rows: list[Row] = []
        self.loads: Counter[str] = Counter()
        self.unloaded: set[str] = set()  # models an Unload step frees
        self.weighed: set[str] = set()  # models whose eviction was priced
        self.moved = 0  # bytes copied host->GPU (loads, streams and uploads of resident blocks)
        self.asked: list[Answer] = []  # evict_cost's answers for the node being weighed

    # -------------------------------------------------------------------------------------------- costs

    def reload_seconds(self, m: str) -> float:
        """A kept part comes back with the upload of the next node that streams its model; a model from its pinned
        copy or its file."""
        if self.sizes.base(m) is not None:
            return self.w[m] / (self.cm.h2d_pinned * residency.STREAM_COPY_EFFICIENCY)
        return self.cm.load_seconds(self.w[m], m in self.pinned)

    def evict_cost(self, m: str, i: int, cur: Variant) -> Answer:
        """(reload seconds this eviction causes, distance to the next use); 0 s when m must leave anyway."""
        self.weighed.add(m)
        use = self.look.first(m, i, self.chosen, cur)
        if use is not None and self.sizes.uses(m, use.variant):
            answer = Answer(m, cur, self.reload_seconds(m), use.distance)
        else:  # never used again, or forced out anyway: that node and m cannot fit together
            answer = Answer(m, cur, 0.0, INF)
        self.asked.append(answer)
        return answer

    def freed(self, v: Variant) -> tuple[list[str], str | None]:
        """The kept parts v frees without an eviction: those of the models it loads whole (which must leave first),
        and the part of the model it streams by blocks (None if none), which it takes over."""
        drop = [self.kept[m] for m in self.sizes.unique(v.models) if m in self.kept]
        own = self.kept.get(v.blocks.model) if v.blocks is not None else None
        return drop, own

    def evictions(self, i: int, v: Variant, total: int, skip: list[str]) -> tuple[list[str], float]:
        """The models to unload before v runs at position i (`total`: the GPU bytes it needs with all resident but
        `skip`), and the reload seconds that costs."""
        w = self.w
        keyed = sorted((self.evict_cost(m, i, v) for m in self.resident if m not in v.models and m not in skip),
                       key=lambda e: e.key(w))
        out: list[Answer] = []
        for e in keyed:
            if total <= self.gpu:
                break
            out.append(e)
            total -= w[e.model]
        for e in reversed(out[:]):  # keep back any evicted model that still fits, most costly first
            if total + w[e.model] <= self.gpu:
                out.remove(e)
                total += w[e.model]
        return [e.model for e in out], sum(e.seconds for e in out)

    def free(self, i: int, u: Variant) -> bool:
        """Whether u can run at position i without pushing out a model that would have to come back."""
        drop, _ = self.freed(u)
        w = self.w
        total = self.held - sum(w[m] for m in drop) + u.activation \
            + sum(w[m] for m in self.sizes.unique(u.models) if m not in self.resident)
        return total <= self.gpu or self.evictions(i, u, total, drop)[1] == 0

    def read_first(self, v: Variant) -> float:
        """Reading a streamed model's file into its pinned host copy, the first time."""
        secs = 0.0
        for m in v.streams:
            if m not in self.pinned:
                secs += self.cm.load_seconds(self.w[m], False)
        return secs

    # -------------------------------------------------------------------------------------------- choosing

    def cannot(self, v: Variant, nc: NodeCost, i: int) -> bool:
        """A variant pass 3 does not weigh: it does not fit alone, it streams a resident model (which would be held
        twice), or it streams block by block a model that another variant of the node holds whole for free."""
        sizes = self.sizes
        if sizes.alone(v) > self.gpu:
            return True
        if v.streams and any(m in self.resident for m in v.streams):
            return True
        return v.blocks is not None and any(sizes.holds(u, v, self.gpu) and self.free(i, u) for u in nc.variants)

    def streamed(self, i: int, v: Variant, missing: int, out: list[str], reload_s: float, own: str | None
                 ) -> tuple[float, list[str], BlockPlan]:
        """A block-streaming variant: the resident blocks that fit beside the models that stay (the kept part `own`
        reused where keeping its blocks is faster), and whether evicting more models (cheapest first) buys a faster
        node than their reloads cost."""
        sizes, w, bw = self.sizes, self.w, self.cm.h2d_pinned
        room = self.gpu - self.held - missing + sum(w[m] for m in out) + (w[own] if own is not None else 0)

        def best_at(room: int) -> BlockPlan | None:
            bp = sizes.choose(v, room, bw)
            if own is not None:
                kb = sizes.keeping(v, own, room, bw)
                if kb is not None and (bp is None or kb.seconds < bp.seconds):
                    bp = kb
            return bp

        best_bp = best_at(room)
        best_t, best_out = (INF if best_bp is None else best_bp.seconds + reload_s), out
        more = sorted((self.evict_cost(m, i, v) for m in self.resident if m not in out and m not in v.models
                       and m != own), key=lambda e: e.key(w))
        extra_s = 0.0
        for k, e in enumerate(more, 1):
            extra_s += e.seconds
            room += w[e.model]
            bp = best_at(room)
            if bp is not None and bp.seconds + reload_s + extra_s < best_t:
                best_t, best_out, best_bp = bp.seconds + reload_s + extra_s, out + [x.model for x in more[:k]], bp
        assert best_bp is not None  # the variant's activation is its least need, which evictions made room for
        return best_t, best_out, best_bp

    def price(self, i: int, k: int, v: Variant) -> Option:
        """Variant v (index k) at position i: its seconds with the loads of its missing models and the reloads its
        evictions cause, the bytes it copies, and what it unloads."""
        sizes, w, cm = self.sizes, self.w, self.cm
        drop, own = self.freed(v) if self.kept else ([], None)
        missing = [m for m in sizes.unique(v.models) if m not in self.resident]
        need = sum(w[m] for m in missing)
        total = self.held + need + v.activation - sum(w[m] for m in drop) - (w[own] if own is not None else 0)
        out, reload_s = ([], 0.0) if total <= self.gpu else \
            self.evictions(i, v, total, [*drop, own] if own is not None else drop)
        out = drop + out
        bp, read = None, 0.0
        if v.blocks is not None:
            t, out, bp = self.streamed(i, v, need, out, reload_s, own)
            read = self.read_first(v)
            t += read
        else:
            t = cm.run_seconds(v) + reload_s
            if v.streams:
                t += sum(cm.load_seconds(w[m], m in self.pinned) for m in v.streams)
        if missing:
            t += sum(cm.load_seconds(w[m], m in self.pinned) for m in missing)
        copied = need + (bp.uploaded if bp is not None else sum(w[m] for m in v.streams))
        return Option(t, copied, k, out, bp, read, own)

    def weigh(self, i: int, nc: NodeCost) -> Choice:
        """The variant of node `nc` at position i: the least predicted time, except that one within TIE of it that
        copies fewer bytes wins (the fewest bytes, then the least time, then the first listed)."""
        options: list[Option] = []
        priced: list[Priced] = []
        for k, v in enumerate(nc.variants):
            if self.cannot(v, nc, i):
                priced.append(Priced(v, None))
                continue
            options.append(self.price(i, k, v))
            priced.append(Priced(v, options[-1].seconds))
        assert options  # feasibility was checked up front
        best = fastest = min(options, key=lambda o: o.seconds)  # (the first of equals)
        if len(options) > 1:
            best = min((o for o in options if o.seconds <= fastest.seconds * (1 + TIE) and o.copied < fastest.copied),
                       key=lambda o: (o.copied, o.seconds, o.pick), default=fastest)
        tie = None if best is fastest else Tie(nc.variants[fastest.pick].name, fastest.seconds,
                                               fastest.copied - best.copied)
        v, bp = nc.variants[best.pick], best.blocks
        note: str | RunNote = v.note
        if bp is not None or v is not nc.variants[0] or tie:
            label = self.sizes.models[bp.model].name if bp is not None else ""
            note = RunNote(v, nc.variants[0], bp, label, best.seconds, tuple(priced), tie)
        secs = bp.seconds + best.read if bp is not None else self.cm.run_seconds(v)
        return Choice(best.pick, tuple(best.unload), bp, best.takes, secs, note)

    # -------------------------------------------------------------------------------------------- applying

    def apply(self, node: int, nc: NodeCost, choice: Choice) -> Variant:
        """The rows of a choice: its Unloads, the Loads of its missing models (with a pinned copy where pass 2 gave
        it one), its Run; a streamed node leaves its resident part on the GPU as a kept part."""
        v = self.chosen[node] = nc.variants[choice.pick]
        for m in choice.unload:
            self.unload(m, f"makes room for {self.names[node]} ({nc.class_type})")
        for m in self.sizes.unique(v.models):
            if m not in self.resident:
                self.load(m, f"for {self.names[node]}")
        for m in v.streams:  # the executor reads (and keeps) its pinned copy for the stream
            if m in self.pins and m not in self.pinned:
                self.pin(m)
        gpu_bytes = self.held + v.activation
        bp = choice.blocks
        if bp is not None:
            if choice.takes is not None:  # taken over by this node: reused, or freed as it starts
                self.resident.remove(choice.takes)
                self.held -= self.w[choice.takes]
                del self.kept[bp.model]
            gpu_bytes = self.held + bp.gpu_bytes
            self.moved += bp.uploaded
            part = self.kept_part(bp)
            if part is not None:  # its resident part stays on the GPU after it, until a node needs the room
                self.kept[bp.model] = part
                self.resident.append(part)
                self.held += self.w[part]
            self.now = tuple(self.resident)
        self.rows.append(Row(self.run_step(node, v), gpu_bytes, self.now, choice.seconds, choice.note,
                             tuple(v.streams), bp))
        self.held_after[node] = self.held
        return v

    def kept_part(self, bp: BlockPlan) -> str | None:
        """The key of the part a streamed node leaves on the GPU (None: it leaves nothing), its bytes known."""
        part = self.sizes.part(bp)
        if part is not None:
            self.w[part] = self.sizes.w(part)
        return part

    def run_as_is(self, node: int, v: Variant) -> None:
        """A node without weights that fits beside what is resident (a host node): it runs, nothing moves."""
        self.chosen[node] = v
        self.rows.append(Row(self.run_step(node, v), self.held + v.activation, self.now, self.cm.run_seconds(v),
                             v.note))
        self.held_after[node] = self.held

    def run_step(self, node: int, v: Variant) -> Run:
        return Run(self.names[node], v.name)

    def unload(self, m: str, why: str) -> None:
        self.resident.remove(m)
        self.held -= self.w[m]
        self.now = tuple(self.resident)
        self.unloaded.add(m)
        base = self.sizes.base(m)
        if base is not None:
            del self.kept[base]
        to = "pinned" if m in self.pinned or base is not None else "drop"
        self.rows.append(Row(self.unload_step(m, to), self.held, self.now, 0.0, why))

    def load(self, m: str, why: str) -> None:
        src = "pinned" if m in self.pinned else "file"
        pin = src == "file" and m in self.pins
        if pin:
            self.pin(m)
        self.resident.append(m)
        self.held += self.w[m]
        self.now = tuple(self.resident)
        self.loads[m] += 1
        self.moved += self.w[m]
        self.rows.append(Row(self.load_step(m, src, pin), self.held, self.now,
                             self.cm.load_seconds(self.w[m], src == "pinned"), why + (PINNING if pin else "")))

    def load_step(self, m: str, src: str, pin: bool) -> Load:
        return Load(m, src, pin)

    def unload_step(self, m: str, to: str) -> Unload:
        return Unload(m, to)

    def pin(self, m: str) -> None:
        self.pinned.add(m)
        self.copies = frozenset(self.pinned)

    def end(self) -> Residency:
        """Where the weights are after the last node."""
        parts = tuple(self.sizes.parts.get(m) or self.sizes.models[m] for m in self.kept.values())
        return Residency(frozenset(self.resident), frozenset(self.pinned), parts)
