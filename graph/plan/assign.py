"""Passes 2 and 3 of the planner (graph/plan/planner.py): the pinned host copies, and residency and variants along a
fixed order, with the look ahead for evictions and the choices remembered for a queue's repeated nodes.

Pure: it sees sizes and predicted seconds (graph/plan/types.py), never tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import residency
from .order import Shape
from .residency import BlockPlan
from .sizes import Sizes
from .types import Budget, CostModel, Load, NodeCost, PlannedStep, Residency, Run, Unload, gib

if TYPE_CHECKING:
    from ...nodes.types import Variant

_INF = math.inf
_PINNING = ", pinned while loading"  # a Load's note, after the node it is for, where it makes a pinned copy
TIE = 0.001  # variants whose predicted seconds are this close (relative) count as equally fast: the one that copies
#              fewer bytes host->GPU wins (a stream that copies 1.5x the bytes for 0.01 % less predicted time is
#              within the prediction's error, and its bytes are real: the link's power and other processes' copies)


_FIELDS = {kind: tuple(f.name for f in dataclasses.fields(kind)) for kind in (Load, Unload, Run)}
# Assigned.steps fills these fields by name, without the dataclasses' __init__
assert _FIELDS[Run] == ("node", "variant") and tuple(f.name for f in dataclasses.fields(PlannedStep)) == (
    "step", "gpu_bytes", "resident", "seconds", "note", "streams", "blocks")


@dataclass
class Assigned:
    rows: list[tuple]  # each step as (Run/Load/Unload, its fields, then PlannedStep's other fields, the note perhaps
    #                    as _run_note's arguments): plan() makes steps only of the pass it returns
    order: list[int]  # the nodes (graph/plan/order.py `Shape` numbers) in their order
    chosen: list[Variant]  # per node: its variant
    end: Residency
    loads: Counter[str]
    unloaded: set[str]  # models an Unload step frees
    moved: int  # bytes copied host->GPU, as Plan.bytes_moved + Plan.streamed_bytes count them
    weighed: set[str]  # models whose eviction was priced (evict_cost asked)
    held_after: list[int]  # per node: the bytes of the weights resident after it
    held_start: int  # ... and at the start

    def steps(self, shape: Shape, cm: CostModel, start: tuple[str, ...]) -> tuple[PlannedStep, ...]:
        """The plan's steps, with the nodes that need nothing (plan/order.py `Shape`) where they run: before the first
        node (on the GPU as it is at the start, `start`) or right after the node they waited for."""
        notes: dict[int, str] = {}  # _run_note of each arguments tuple (the nodes of a remembered choice share one)
        first, followers = shape.expand(self.order)
        held_after, order, free_names, free_costs = self.held_after, self.order, shape.free_names, shape.free_costs
        out: list[PlannedStep] = []
        new = object.__new__  # (steps are frozen dataclasses without __post_init__, made without their __init__, which
        #                        sets each field through object.__setattr__, at a quarter of the time: a queue of 64
        #                        prompts makes a thousand)

        def run_free(nodes: list[int], held: int, res: tuple[str, ...]) -> None:
            for f in nodes:
                v = free_costs[f].variants[0]
                s = new(Run)
                d = s.__dict__
                d["node"], d["variant"] = free_names[f], v.name
                p = new(PlannedStep)
                d = p.__dict__
                d["step"], d["gpu_bytes"], d["resident"], d["seconds"] = s, held, res, cm.run_seconds(v)
                d["note"], d["streams"], d["blocks"] = v.note, (), None
                out.append(p)

        if first:
            run_free(first, self.held_start, start)
        r = 0  # Runs so far
        for kind, args, gpu, res, secs, note, streams, bp in self.rows:
            if note.__class__ is not str:
                got = notes.get(id(note))
                if got is None:
                    got = notes[id(note)] = _run_note(*note)
                note = got
            s = new(kind)
            d = s.__dict__
            if kind is Run:
                d["node"], d["variant"] = args
            else:
                d.update(zip(_FIELDS[kind], args, strict=True))
            p = new(PlannedStep)
            d = p.__dict__
            d["step"], d["gpu_bytes"], d["resident"], d["seconds"] = s, gpu, res, secs
            d["note"], d["streams"], d["blocks"] = note, streams, bp
            out.append(p)
            if kind is Run:
                n = order[r]
                r += 1
                if n in followers:
                    run_free(followers[n], held_after[n], res)
        return tuple(out)

    def repinned(self, pins: frozenset[str]) -> Assigned:
        """This pass, made with every model pinned once loaded, as the same order gets it with only `pins` (which hold
        the start's pinned copies): its Loads of the other models make no copy, and the end keeps only those of `pins`.

        Valid where no model outside `pins` is unloaded, streamed or weighed for eviction in this pass (plan() checks):
        pass 3 asks whether a model has a pinned copy only to price its reload, its stream or its eviction, and a model
        outside `pins` has a copy here only once loaded; loaded, it stays, so nothing asks, and every choice is the
        same."""
        rows = [(Load, (r[1][0], "file", False), r[2], r[3], r[4], r[5].removesuffix(_PINNING), r[6], r[7])
                if r[0] is Load and r[1][2] and r[1][0] not in pins else r for r in self.rows]
        end = Residency(self.end.gpu, self.end.pinned & pins, self.end.kept)
        return Assigned(rows, self.order, self.chosen, end, self.loads, self.unloaded, self.moved, self.weighed,
                        self.held_after, self.held_start)


def _run_note(v: Variant, first: Variant, bp: BlockPlan | None, label: str, t: float,
              options: list[tuple[Variant, float | None]], tie: tuple[str, float, int] | None) -> str:
    """A Run's note: the variant's own, what it streams, what it was chosen over when it is not the first, and, where
    it is not the fastest, the near tie that it won by copying fewer bytes (`tie`: the fastest's name, seconds, and
    the bytes more it copies)."""
    parts = [v.note] if v.note else []
    if bp is not None:
        parts.append(bp.describe(label))
    if v is not first or tie:
        alts = ", ".join([f"{a.name}: does not fit" if ta is None else f"{a.name}: {ta:.3f} s"
                          for a, ta in options if a is not v])
        parts.append(f"chosen at {t:.3f} s over {alts}")
    if tie:
        parts.append(f"{tie[0]} is within {TIE:.1%} of it and would copy {gib(tie[2])} GiB more")
    return "; ".join(parts)


@dataclass
class Memo:
    """What the passes 3 of one plan share: each node's kind (`node_kinds`), the choices remembered by kind and state
    (`known`; None: weigh every node) and the look ahead's tables ((id(order), model) -> (order, table))."""

    kinds: list[int]  # per node (a number)
    known: dict[tuple, tuple] | None = field(default_factory=dict)
    tables: dict[tuple[int, str], tuple[list[int], list[int]]] = field(default_factory=dict)
    orders: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)  # id(order) -> (order, the kinds
    #                                                                                  of its nodes)
    some: dict[int, int] = field(default_factory=dict)  # a node of each kind

    def along(self, order: list[int]) -> list[int]:
        """The kinds of `order`'s nodes."""
        got = self.orders.get(id(order))
        if got is None or got[0] is not order:
            kinds = self.kinds
            got = self.orders[id(order)] = order, [kinds[x] for x in order]
            if not self.some:
                self.some = {k: n for n, k in enumerate(kinds)}
        return got[1]


class NextUse:
    """Pass 3's look ahead for evicting model m at position i: the first node after i, in this run and then (with
    `repeat`) in the next, whose variant uses m or cannot fit beside it, and its distance. The nodes after i have
    their provisional variant (none is chosen yet), the ones before i their chosen one, which stays as it is; so a
    table per model answers the first part and a mark per model the second, where a walk along the order would do it
    for every eviction. Ask with positions that never go down, as pass 3 does."""

    def __init__(self, order: list[int], prov: list[Variant], sizes: Sizes, gpu: int, repeat: bool,
                 memo: Memo) -> None:
        self.order, self.prov, self.sizes, self.gpu, self.repeat, self.memo = order, prov, sizes, gpu, repeat, memo
        self.ahead: dict[str, list[int]] = {}  # m -> per position, the first at or after it whose provisional variant
        #                                        meets m (len(order): none)
        self.behind: dict[str, list[Any]] = {}  # m -> [the first position whose chosen variant meets m, or None;
        #                                          the positions looked at]

    def meets(self, m: str, v: Variant) -> bool | None:
        """True: v uses m; False: v and m cannot fit together (or m is a kept part of a model v loads whole);
        None: neither."""
        sizes = self.sizes
        if sizes.uses(m, v):
            return True
        return False if sizes.excludes(m, v) or sizes.weights(v.models) + sizes.w(m) + v.activation > self.gpu \
            else None

    def _table(self, m: str) -> list[int]:
        """Per position, the first at or after it whose provisional variant meets m (meets, spelled out: a kept part
        meets the nodes that stream its model and those that load it whole); len(order) for none."""
        order, n = self.order, len(self.order)
        seq = self.memo.along(order)
        prov, alone, room = self.prov, self.sizes.alone, self.gpu - self.sizes.w(m)
        base = self.sizes.base(m)
        hits = set()  # the kinds that meet m (a kind's nodes share their provisional variant)
        for k, node in self.memo.some.items():
            v = prov[node]
            if base is None:
                h = m in v.models or alone(v) > room
            else:
                h = base in v.models or (v.blocks is not None and v.blocks.model == base) or alone(v) > room
            if h:
                hits.add(k)
        ahead = [n] * (n + 1)
        nxt = n
        for j in range(n - 1, -1, -1):
            if seq[j] in hits:
                nxt = j
            ahead[j] = nxt
        return ahead

    def first(self, m: str, i: int, chosen: list[Variant], cur: Variant) -> tuple[Variant, int] | None:
        """(variant, distance) of the first node after position i that meets m, `cur` (position i in the next run)
        last; None when none does."""
        order, n = self.order, len(self.order)
        ahead = self.ahead.get(m)
        if ahead is None:
            tables = self.memo.tables
            got = tables.get((id(order), m))
            if got is None or got[0] is not order:
                got = tables[(id(order), m)] = order, self._table(m)
            ahead = self.ahead[m] = got[1]
        j = ahead[i + 1]
        if j < n:
            return self.prov[order[j]], j - i
        if not self.repeat:
            return None
        seen = self.behind.setdefault(m, [None, 0])
        if seen[0] is None:
            seen[0] = next((k for k in range(seen[1], i) if self.meets(m, chosen[order[k]]) is not None), None)
            seen[1] = i
        if seen[0] is not None:
            return chosen[order[seen[0]]], n - i + seen[0]
        return (cur, n) if self.meets(m, cur) is not None else None


def alike(known: tuple[tuple[str, int, tuple[float, float]], ...],
          asked: list[tuple[str, Variant, tuple[float, float]]]) -> bool:
    """Whether the look ahead's answers `asked` (reload seconds, distance to the next use), whose seconds equal those
    of the remembered answers `known` one by one, order every pair of equal seconds by distance as `known` does. Pass
    3 uses a distance only for that, to rank evictions of equal cost (the farthest next use first), so a node of a
    queue whose next use is one node nearer than the last one's takes the same choice."""
    for x in range(len(asked)):
        for y in range(x + 1, len(asked)):
            (c, d), (_, e) = known[x][2], known[y][2]
            if c == known[y][2][0]:
                f, g = asked[x][2][1], asked[y][2][1]
                if (d > e) != (f > g) or (d < e) != (f < g):
                    return False
    return True


def assign(order: list[int], shape: Shape, sizes: Sizes, budget: Budget, cm: CostModel, start: Residency,
           prov: list[Variant], pins: frozenset[str], repeat: bool, memo: Memo
           ) -> Assigned:
    """Pass 3: residency and variants along a fixed order (see the module docstring).

    The nodes of a queue repeat, and so do their choices: a choice depends only on the node's variants, the resident
    models in their order (kept parts included), the pinned copies, and the look ahead's answers to the evictions it
    priced. So they are remembered in `memo.known` (for all the passes of one plan; None: weigh every node): a node of
    the same kind (`memo.kinds`: equal variants) in the same state takes the remembered choice once the look ahead
    gives answers alike to the same questions (asked in the same order, so that weighing it would follow the same
    path): the same reload seconds, and distances that rank alike (`alike`)."""
    gpu = budget.gpu
    w = {k: m.nbytes for k, m in sizes.models.items()}
    w.update((k, m.nbytes) for k, m in sizes.parts.items())
    resident: list[str] = sorted(start.gpu)
    kept: dict[str, str] = {}  # model -> the key of its kept part on the GPU (graph/plan/residency.py)
    for m in resident:
        if sizes.base(m) is not None:
            kept[sizes.base(m)] = m
    pinned: set[str] = set(start.pinned)
    names, costs = shape.names, shape.costs
    chosen: list[Any] = [None] * len(names)
    rows: list[tuple] = []
    loads: Counter[str] = Counter()
    unloaded: set[str] = set()
    weighed: set[str] = set()
    moved = 0
    part_bw = cm.h2d_pinned * residency.STREAM_COPY_EFFICIENCY  # a kept part comes back with its node's upload

    after = NextUse(order, prov, sizes, gpu, repeat, memo)
    kinds, known = memo.kinds, memo.known

    asked: list[tuple[str, Variant, tuple[float, float]]] = []  # evict_cost's questions and answers for one node
    targets: list[tuple[list[int], int]] = []  # ... and where each answer came from: the look ahead's table for the
    #                                            model and the position of its next use (-1: in the next run)
    n = len(order)

    uses: dict[tuple[str, int], bool] = {}  # (m, a kind of node) -> whether its provisional variant uses m
    reload: dict[str, float] = {}  # m -> the seconds of its reload with the pinned copies there are (cleared when a
    #                                copy is made)
    ahead = after.ahead

    def evict_cost(m: str, i: int, cur: Variant) -> tuple[float, float]:
        """(reload seconds this eviction causes, distance to the next use); 0 s when m must leave anyway."""
        weighed.add(m)
        table = ahead.get(m)
        j = table[i + 1] if table is not None else n
        if j < n:  # (NextUse.first, for a use in this run)
            kind = m, kinds[order[j]]
            use = uses.get(kind)
            if use is None:
                use = uses[kind] = sizes.uses(m, prov[order[j]])
            d = j - i
        else:
            got = after.first(m, i, chosen, cur)
            table = ahead[m]
            j = table[i + 1]
            use = got is not None and sizes.uses(m, got[0])
            d = got[1] if got is not None else _INF
        targets.append((table, j if j < n or not repeat else -1))
        if use:  # (the next node that meets m uses it, rather than not fitting beside it)
            r = reload.get(m)
            if r is None:  # a kept part: uploaded again by the next node that streams its model; a model: pinned by
                #            now if ever (it is resident)
                r = reload[m] = w[m] / part_bw if sizes.base(m) is not None else cm.load_seconds(w[m], m in pinned)
            answer = r, d
        else:
            answer = 0.0, _INF  # never used again, or forced out anyway: that node and m cannot fit together
        asked.append((m, cur, answer))
        return answer

    def gone(v: Variant) -> tuple[list[str], str | None]:
        """The kept parts v frees without an eviction: those of the models it loads whole (which must leave
        first), and the part of the model it streams by blocks (None if none), which it takes over."""
        drop = [kept[m] for m in sizes.unique(v.models) if m in kept]
        own = kept.get(v.blocks.model) if v.blocks is not None else None
        return drop, own

    def evictions(i: int, v: Variant, total: int, skip: list[str]) -> tuple[list[str], float]:
        """The models to unload before v runs at position i (`total`: the GPU bytes it needs with all resident
        but `skip`), and the reload seconds that costs."""
        keyed = sorted(((*evict_cost(m, i, v), m) for m in resident if m not in v.models and m not in skip),
                       key=lambda t: (t[0], -t[1], -w[t[2]]))
        out: list[tuple[float, float, str]] = []
        for t in keyed:
            if total <= gpu:
                break
            out.append(t)
            total -= w[t[2]]
        for t in reversed(out[:]):  # keep back any evicted model that still fits, most costly first
            if total + w[t[2]] <= gpu:
                out.remove(t)
                total += w[t[2]]
        return [m for _, _, m in out], sum(c for c, _, _ in out)

    def free(i: int, u: Variant) -> bool:
        """Whether u can run at position i without pushing out a model that would have to come back."""
        drop, _ = gone(u)
        total = held - sum(w[m] for m in drop) + sum(w[m] for m in sizes.unique(u.models) if m not in resident) \
            + u.activation
        return total <= gpu or evictions(i, u, total, drop)[1] == 0

    def read_first(v: Variant) -> float:
        """Reading a streamed model's file into its pinned host copy, the first time."""
        secs = 0.0  # (loops rather than generators in this pass: it runs them for every streamed node of a queue)
        for m in v.streams:
            if m not in pinned:
                secs += cm.load_seconds(w[m], False)
        return secs

    def streamed(i: int, v: Variant, missing: int, out: list[str], reload_s: float, own: str | None
                 ) -> tuple[float, list[str], BlockPlan]:
        """A block-streaming variant: the resident blocks that fit beside the models that stay (the kept part
        `own` reused where keeping its blocks is faster), and whether evicting more models (cheapest first) buys a
        faster node than their reloads cost."""
        assert v.blocks is not None
        bw = cm.h2d_pinned
        room = gpu - held - missing  # for the node's own bytes, beside the models that stay
        for m in out:
            room += w[m]
        if own is not None:
            room += w[own]

        def best_at(room: int) -> BlockPlan | None:
            bp = sizes.choose(v, room, bw)
            if own is not None:
                kb = sizes.keeping(v, own, room, bw)
                if kb is not None and (bp is None or kb.seconds < bp.seconds):
                    bp = kb
            return bp

        best_bp = best_at(room)
        best_t, best_out = (_INF if best_bp is None else best_bp.seconds + reload_s), out
        more = []
        for m in resident:
            if m not in out and m not in v.models and m != own:
                more.append((*evict_cost(m, i, v), m))
        if len(more) > 1:
            more.sort(key=lambda t: (t[0], -t[1], -w[t[2]]))
        extra_s = 0.0
        for k, (c, _, m) in enumerate(more, 1):
            extra_s += c
            room += w[m]
            bp = best_at(room)
            if bp is not None and bp.seconds + reload_s + extra_s < best_t:
                best_t, best_out, best_bp = bp.seconds + reload_s + extra_s, out + [m for _, _, m in more[:k]], bp
        assert best_bp is not None  # the variant's activation is its least need, which evictions made room for
        return best_t, best_out, best_bp

    def weigh(i: int, nc: NodeCost) -> tuple[int, list[str], BlockPlan | None, str | None, float, str | tuple]:
        """The variant of node `nc` at position i and what running it takes: (its index in nc.variants, the models to
        unload first, its block plan if it streams, the kept part it takes over, its Run's seconds, its note or
        _run_note's arguments)."""
        cands: list[tuple[float, int, int, list[str], BlockPlan | None, float, str | None]] = []  # (seconds, bytes
        #                                            copied, index, evictions, block plan, first read, kept part taken)
        options: list[tuple[Variant, float | None]] = []
        for k, v in enumerate(nc.variants):
            if sizes.alone(v) > gpu:
                options.append((v, None))
                continue
            if v.streams:
                for m in v.streams:  # streaming a resident model would hold it twice
                    if m in resident:
                        break
                else:
                    m = None
                if m is not None:
                    options.append((v, None))
                    continue
            if v.blocks is not None:  # streaming is for a model that cannot stay: not when it can
                for u in nc.variants:
                    if sizes.holds(u, v, gpu) and free(i, u):
                        break
                else:
                    u = None
                if u is not None:
                    options.append((v, None))
                    continue
            drop, own = gone(v) if kept else ([], None)
            missing, need = [], 0
            for m in sizes.unique(v.models):
                if m not in resident:
                    missing.append(m)
                    need += w[m]
            total = held + need + v.activation
            for m in drop:
                total -= w[m]
            if own is not None:
                total -= w[own]
            out, reload_s = ([], 0.0) if total <= gpu else evictions(i, v, total, [*drop, own] if own else drop)
            out = drop + out
            bp, read = None, 0.0
            if v.blocks is not None:
                t, out, bp = streamed(i, v, need, out, reload_s, own)
                read = read_first(v)
                t += read
            else:
                t = cm.run_seconds(v) + reload_s
                if v.streams:  # (an empty sum adds 0: skipping it leaves t as it is)
                    t += sum(cm.load_seconds(w[m], m in pinned) for m in v.streams)
            if missing:
                t += sum(cm.load_seconds(w[m], m in pinned) for m in missing)
            options.append((v, t))
            copied = need + (bp.uploaded if bp is not None else sum(w[m] for m in v.streams))
            cands.append((t, copied, k, out, bp, read, own))
        assert cands  # feasibility was checked up front
        best = fastest = min(cands, key=lambda c: c[0])  # (the first of equals)
        if len(cands) > 1:  # a near tie in predicted time goes to the option that copies fewer bytes
            best = min((c for c in cands if c[0] <= fastest[0] * (1 + TIE) and c[1] < fastest[1]),
                       key=lambda c: (c[1], c[0], c[2]), default=fastest)
        tie = None if best is fastest else (nc.variants[fastest[2]].name, fastest[0], fastest[1] - best[1])
        t, _, k, out, bp, read, own = best
        v = nc.variants[k]
        note: str | tuple = v.note
        if bp is not None or v is not nc.variants[0] or tie:  # written out only for the steps of the plan returned
            note = (v, nc.variants[0], bp, sizes.models[bp.model].name if bp is not None else "", t, options, tie)
        return k, out, bp, own, bp.seconds + read if bp is not None else cm.run_seconds(v), note

    held = sum(w[m] for m in resident)  # bytes of the resident weights
    now = tuple(resident)
    held_start = held
    held_after = [0] * len(names)  # per node: the resident weights' bytes after it
    copies = frozenset(pinned)  # `known` is by the node's kind, the resident models (in their order) and these
    # A node that left the GPU as it found it (the same resident models in the same order, the same pinned copies: a
    # queue's next encode or sample that takes over the last one's kept part, or a decode beside it) is `steady`: a
    # later node of its kind that finds the GPU still so (not a model moved since) takes the same choice where the look
    # ahead's answers for it are alike (`same_answers`): it would be asked the same questions and get the same reload
    # seconds, and distances that rank alike.
    steady: dict[int, tuple] = {}  # per kind: (resident, pinned copies, its answers' targets as (table, position of
    #                                the next use, its own position), variant, bytes copied, row)

    def same_answers(targets: tuple[tuple[list[int], int, int], ...], i: int) -> bool:
        """Whether the look ahead answers a node at position i as it answered the steady node of its kind: from the
        same nodes (all distances shorter by as much), or from nodes of the same kinds at the same distances."""
        for table, j, _ in targets:
            if table[i + 1] != j:
                break
        else:
            return True
        for table, j, at in targets:
            k = table[i + 1]
            if k == n or j == n:  # (no use left: in a run that does not repeat, the same answer either way)
                if k != j:
                    return False
            elif k - i != j - at or kinds[order[k]] != kinds[order[j]]:
                return False
        return True

    part_of: dict[int, str | None] = {}  # per block plan (by identity): the key of the part it leaves (Sizes.part)
    unique = sizes.unique
    for i, node in enumerate(order):
        nc = costs[node]
        vs = nc.variants
        if len(vs) == 1 and not vs[0].models and not vs[0].streams \
                and held + vs[0].activation <= gpu:  # a host node, or one without weights: nothing moves
            v = chosen[node] = vs[0]
            rows.append((Run, (names[node], v.name), held + v.activation, now, cm.run_seconds(v), v.note, (), None))
            held_after[node] = held
            continue
        kind = kinds[node]
        got = steady.get(kind)
        if got is not None and got[0] is now and got[1] is copies and same_answers(got[2], i):
            v = chosen[node] = got[3]  # its kind's steady choice (see above)
            moved += got[4]
            row = got[5]
            rows.append((Run, (names[node], v.name), row[2], now, row[4], row[5], row[6], row[7]))
            held_after[node] = held
            continue
        before = now, copies
        key = (kind, now, copies) if known is not None else None
        got = known.get(key) if key is not None else None
        asked.clear()
        targets.clear()
        if got is not None and got[1]:  # the same questions to the look ahead must get answers alike (alike)
            for m, j, answer in got[1]:
                if evict_cost(m, i, vs[j])[0] != answer[0]:
                    got = None
                    break
            else:
                if len(asked) > 1 and not alike(got[1], asked):
                    got = None
        if got is None:
            asked.clear()
            targets.clear()
            choice = weigh(i, nc)
            if key is not None:
                index = {id(x): j for j, x in enumerate(vs)}
                known[key] = choice, tuple((m, index[id(cur)], answer) for m, cur, answer in asked)
        else:
            choice = got[0]
        k, out, bp, own, secs, note = choice
        v = chosen[node] = vs[k]
        for m in out:
            resident.remove(m)
            held -= w[m]
            now = tuple(resident)
            unloaded.add(m)
            base = sizes.base(m)
            if base is not None:
                del kept[base]
            rows.append((Unload, (m, "pinned" if m in pinned or base is not None else "drop"), held, now, 0.0,
                         f"makes room for {names[node]} ({nc.class_type})", (), None))
        for m in unique(v.models):
            if m in resident:
                continue
            src = "pinned" if m in pinned else "file"
            pin = src == "file" and m in pins
            if pin:
                pinned.add(m)
                copies = frozenset(pinned)
                reload.clear()
            resident.append(m)
            held += w[m]
            now = tuple(resident)
            loads[m] += 1
            moved += w[m]
            why = f"for {names[node]}" + (_PINNING if pin else "")
            rows.append((Load, (m, src, pin), held, now, cm.load_seconds(w[m], src == "pinned"), why, (), None))
        for m in v.streams:  # the executor reads (and keeps) its pinned copy for the stream
            if m in pins and m not in pinned:
                pinned.add(m)
                copies = frozenset(pinned)
                reload.clear()
        gpu_bytes = held + v.activation
        if bp is not None:
            if own is not None:  # taken over by this node: reused, or freed as it starts when its blocks differ
                resident.remove(own)
                held -= w[own]
                del kept[bp.model]
            gpu_bytes = held + bp.gpu_bytes
            moved += bp.uploaded
            part = part_of.get(id(bp), ...)
            if part is ...:  # (the nodes of a remembered choice share its block plan)
                part = part_of[id(bp)] = sizes.part(bp)
                if part is not None:
                    w[part] = sizes.w(part)
            if part is not None:  # its resident part stays on the GPU after it, until a node needs the room
                kept[bp.model] = part
                resident.append(part)
                held += w[part]
            now = tuple(resident)
        rows.append((Run, (names[node], v.name), gpu_bytes, now, secs, note, tuple(v.streams), bp))
        held_after[node] = held
        if key is not None and copies is before[1] and now == before[0]:
            now = before[0]  # (the same object: the steady choices are by its identity)
            if all(j >= 0 for _, j in targets):
                steady[kind] = now, copies, tuple((t, j, i) for t, j in targets), v, \
                    bp.uploaded if bp is not None else 0, rows[-1]
    kept_parts = tuple(sizes.parts.get(m) or sizes.models[m] for m in kept.values())
    end = Residency(frozenset(resident), frozenset(pinned), kept_parts)
    return Assigned(rows, order, chosen, end, loads, unloaded, moved, weighed, held_after, held_start)


def choose_pins(first: Assigned, sizes: Sizes, costs: list[NodeCost], order: list[int],
                start: Residency, room: int, evicted: set[str]) -> frozenset[str]:
    """Pass 2: the models that get a pinned copy: start's, then among the candidates (`evicted`: models that get
    unloaded, or all used models when they cannot stay together), while host RAM allows, the most loaded ones,
    the largest first among equals (a pinned reload saves time in proportion to bytes)."""
    used = dict.fromkeys(m for n in order for v in costs[n].variants for m in v.models if m in evicted)
    rank = {m: (-first.loads[m], -sizes.w(m), k) for k, m in enumerate(used)}
    pins = set(start.pinned)
    for m in sorted((m for m in used if m not in pins), key=rank.__getitem__):
        if sizes.w(m) <= room:
            pins.add(m)
            room -= sizes.w(m)
    return frozenset(pins)
