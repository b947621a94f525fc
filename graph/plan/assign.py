"""Passes 2 and 3 of the planner (graph/plan/planner.py): the pinned host copies, and residency and variants along a
fixed order.

Pass 3 walks the order with the rules of graph/plan/gpu.py (`GpuState`, the reference). Its fast path (`Recall`,
where `Memo.known` is not None) changes no choice, only how often a node is weighed: a queue's nodes repeat, and a node
of the same kind that finds the GPU as an earlier one found it, and whose look ahead answers alike, takes the earlier
choice; the look ahead answers from a table per model (`NextUse`) instead of walking the order. tests/
test_plan_reference.py checks it plan for plan against the reference.

Pure: it sees sizes and predicted seconds (graph/plan/types.py), never tensors.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from .gpu import INF, PINNING, TIE, Answer, Choice, GpuState, LookAhead, Row, RunNote, Use
from .order import Shape
from .types import Budget, CostModel, Load, NodeCost, PlannedStep, Residency, Run, Unload

if TYPE_CHECKING:
    from ...nodes.types import Variant
    from .residency import BlockPlan
    from .sizes import Sizes

__all__ = ["TIE", "Assigned", "Memo", "NextUse", "alike", "assign", "assigned", "choose_pins"]


@dataclass
class Assigned:
    """One pass 3: its rows (plan() makes steps only of the pass it returns) and what the passes after it read."""

    rows: list[Row]
    order: list[int]  # the nodes (graph/plan/order.py `Shape` numbers) in their order
    chosen: list[Variant]  # the chosen variants
    end: Residency
    loads: Counter[str]
    unloaded: set[str]  # models an Unload step frees
    moved: int  # bytes copied host->GPU, as Plan.bytes_moved + Plan.streamed_bytes count them
    weighed: set[str]  # models whose eviction was priced (evict_cost asked)
    held_after: list[int]  # per node: the bytes of the weights resident after it
    held_start: int  # ... and at the start

    @property
    def streams(self) -> bool:
        """Whether a node of this pass streams a model block by block."""
        return any(r.blocks is not None for r in self.rows)

    def steps(self, shape: Shape, cm: CostModel, start: tuple[str, ...]) -> tuple[PlannedStep, ...]:
        """The plan's steps, with the nodes that need nothing (plan/order.py `Shape`) where they run: before the first
        node (on the GPU as it is at the start, `start`) or right after the node they waited for."""
        notes: dict[int, str] = {}  # each RunNote written out once (the nodes of a remembered choice share one)
        first, followers = shape.expand(self.order)
        out: list[PlannedStep] = []

        def run_free(nodes: list[int], held: int, res: tuple[str, ...]) -> None:
            for f in nodes:
                v = shape.free_costs[f].variants[0]
                out.append(PlannedStep(Run(shape.free_names[f], v.name), held, res, cm.run_seconds(v), v.note))

        if first:
            run_free(first, self.held_start, start)
        runs = iter(self.order)
        for r in self.rows:
            note = r.note
            if isinstance(note, RunNote):
                text = notes.get(id(note))
                if text is None:
                    text = notes[id(note)] = note.text()
                note = text
            out.append(PlannedStep(r.step, r.gpu_bytes, r.resident, r.seconds, note, r.streams, r.blocks))
            if isinstance(r.step, Run):
                n = next(runs)
                if n in followers:
                    run_free(followers[n], self.held_after[n], r.resident)
        return tuple(out)

    def repinned(self, pins: frozenset[str]) -> Assigned:
        """This pass, made with every model pinned once loaded, as the same order gets it with only `pins` (which hold
        the start's pinned copies): its Loads of the other models make no copy, and the end keeps only those of `pins`.

        Valid where no model outside `pins` is unloaded, streamed or weighed for eviction in this pass (plan() checks):
        pass 3 asks whether a model has a pinned copy only to price its reload, its stream or its eviction, and a model
        outside `pins` has a copy here only once loaded; loaded, it stays, so nothing asks, and every choice is the
        same."""
        rows = [dataclasses.replace(r, step=Load(r.step.model, "file", False), note=str(r.note).removesuffix(PINNING))
                if isinstance(r.step, Load) and r.step.pin and r.step.model not in pins else r for r in self.rows]
        end = Residency(self.end.gpu, self.end.pinned & pins, self.end.kept)
        return Assigned(rows, self.order, self.chosen, end, self.loads, self.unloaded, self.moved, self.weighed,
                        self.held_after, self.held_start)


class Question(NamedTuple):
    """A remembered choice's question to the look ahead: the index of the variant that asked, and the answer (with
    the model asked about)."""

    pick: int  # the variant's index in the node's variants
    answer: Answer


class Known(NamedTuple):
    choice: Choice
    questions: tuple[Question, ...]


@dataclass(slots=True)
class Steady:
    """A node that left the GPU as it found it: the resident models and pinned copies (by identity), where its look
    ahead's answers came from (per answer the model's table and the position of its next use) and its position, its
    variant, the bytes it uploaded, its row. (Slotted, as Row.)"""

    now: tuple[str, ...]
    copies: frozenset[str]
    targets: tuple[tuple[list[int], int], ...]
    at: int
    variant: Variant
    uploaded: int
    row: Row


@dataclass
class Memo:
    """What the passes 3 of one plan share: each node's kind (`node_kinds`), the choices remembered by kind and state
    (`known`; None: the reference, every node weighed and the look ahead walked) and the look ahead's tables
    ((id(order), model) -> (order, table))."""

    kinds: list[int]  # per node (a number)
    known: dict[tuple[int, tuple[str, ...], frozenset[str]], Known] | None = field(default_factory=dict)
    tables: dict[tuple[int, str], tuple[list[int], list[int]]] = field(default_factory=dict)
    orders: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)  # id(order) -> (order, the kinds
    #                                                                                  of its nodes)
    some: dict[int, int] = field(default_factory=dict)  # a node of each kind
    steps: dict[tuple[str, ...], Run | Load | Unload] = field(default_factory=dict)  # the step records made so far

    def along(self, order: list[int]) -> list[int]:
        """The kinds of `order`'s nodes."""
        got = self.orders.get(id(order))
        if got is None or got[0] is not order:
            kinds = self.kinds
            got = self.orders[id(order)] = order, [kinds[x] for x in order]
            if not self.some:
                self.some = {k: n for n, k in enumerate(kinds)}
        return got[1]


class NextUse(LookAhead):
    """The look ahead from tables: the nodes after i have their provisional variant, so a table per model (shared by
    the passes of one plan through `memo`) answers the first part; the ones before i have their chosen one, which
    stays as it is, so a mark per model answers the second. Ask with positions that never go down, as pass 3 does.
    Records where each answer came from (`targets`) for `Recall`."""

    def __init__(self, order: list[int], prov: list[Variant], sizes: Sizes, gpu: int, repeat: bool,
                 memo: Memo) -> None:
        super().__init__(order, prov, sizes, gpu, repeat)
        self.memo = memo
        self.ahead: dict[str, list[int]] = {}  # m -> per position, the first at or after it whose provisional variant
        #                                        meets m (len(order): none)
        self.behind: dict[str, tuple[int | None, int]] = {}  # m -> (the first position whose chosen variant meets m,
        #                                                       or None; the positions looked at)
        self.targets: list[tuple[list[int], int]] = []  # per answer: the table and the next use (-1: the next run)

    def _table(self, m: str) -> list[int]:
        """Per position, the first at or after it whose provisional variant meets m; len(order) for none."""
        order, n = self.order, len(self.order)
        seq = self.memo.along(order)
        hits = {k for k, node in self.memo.some.items() if self.meets(m, self.prov[node]) is not None}
        ahead = [n] * (n + 1)
        nxt = n
        for j in range(n - 1, -1, -1):
            if seq[j] in hits:
                nxt = j
            ahead[j] = nxt
        return ahead

    def first(self, m: str, i: int, chosen: list[Variant | None], cur: Variant) -> Use | None:
        order, n = self.order, len(self.order)
        ahead = self.ahead.get(m)
        if ahead is None:
            tables = self.memo.tables
            got = tables.get((id(order), m))
            if got is None or got[0] is not order:
                got = tables[(id(order), m)] = order, self._table(m)
            ahead = self.ahead[m] = got[1]
        j = ahead[i + 1]
        self.targets.append((ahead, j if j < n or not self.repeat else -1))
        if j < n:
            return Use(self.prov[order[j]], j - i)
        if not self.repeat:
            return None
        found, looked = self.behind.get(m, (None, 0))
        if found is None:
            found = next((k for k in range(looked, i) if self._meets_chosen(m, chosen[order[k]])), None)
            self.behind[m] = found, i
        if found is not None:
            v = chosen[order[found]]
            assert v is not None  # (chosen before position i)
            return Use(v, n - i + found)
        return Use(cur, n) if self.meets(m, cur) is not None else None

    def _meets_chosen(self, m: str, v: Variant | None) -> bool:
        return v is not None and self.meets(m, v) is not None


def alike(known: tuple[Question, ...], asked: list[Answer]) -> bool:
    """Whether the look ahead's answers `asked`, whose seconds equal those of the remembered answers `known` one by
    one, order every pair of equal seconds by distance as `known` does. Pass 3 uses a distance only for that, to rank
    evictions of equal cost (the farthest next use first), so a node of a queue whose next use is one node nearer
    than the last one's takes the same choice."""
    for x in range(len(asked)):
        for y in range(x + 1, len(asked)):
            a, b = known[x].answer, known[y].answer
            if a.seconds == b.seconds:
                f, g = asked[x].distance, asked[y].distance
                if (a.distance > b.distance) != (f > g) or (a.distance < b.distance) != (f < g):
                    return False
    return True


class FastGpuState(GpuState):
    """GpuState as the fast path runs it: the same rules, with what one pass asks again and again remembered: whether
    a kind's provisional variant uses a model, a model's reload seconds (until a pinned copy is made), the look
    ahead's table read here, and the step records (the same Run, Load and Unload for all the passes of a plan)."""

    def __init__(self, names: list[str], sizes: Sizes, budget: Budget, cm: CostModel, start: Residency,
                 pins: frozenset[str], look: NextUse, memo: Memo) -> None:
        super().__init__(names, sizes, budget, cm, start, pins, look)
        self.next_use = look
        self.kinds, self.steps = memo.kinds, memo.steps
        self.uses_by_kind: dict[tuple[str, int], bool] = {}
        self.reloads: dict[str, float] = {}
        self.parts: dict[int, str | None] = {}  # per block plan (by identity): the kept part it leaves

    def evict_cost(self, m: str, i: int, cur: Variant) -> Answer:
        self.weighed.add(m)
        look = self.next_use
        n = len(look.order)
        table = look.ahead.get(m)
        j = table[i + 1] if table is not None else n
        if table is not None and j < n:  # (NextUse.first, for a use in this run)
            look.targets.append((table, j))
            kind = m, self.kinds[look.order[j]]
            use = self.uses_by_kind.get(kind)
            if use is None:
                use = self.uses_by_kind[kind] = self.sizes.uses(m, look.prov[look.order[j]])
            distance: float = j - i
        else:
            got = look.first(m, i, self.chosen, cur)
            use = got is not None and self.sizes.uses(m, got.variant)
            distance = got.distance if got is not None else INF
        if use:
            r = self.reloads.get(m)
            if r is None:
                r = self.reloads[m] = self.reload_seconds(m)
            answer = Answer(m, cur, r, distance)
        else:
            answer = Answer(m, cur, 0.0, INF)
        self.asked.append(answer)
        return answer

    def pin(self, m: str) -> None:
        super().pin(m)
        self.reloads.clear()

    def kept_part(self, bp: BlockPlan) -> str | None:
        got = self.parts.get(id(bp), ...)  # (the nodes of a remembered choice share its block plan)
        if got is ...:
            got = self.parts[id(bp)] = super().kept_part(bp)
        return got

    def apply(self, node: int, nc: NodeCost, choice: Choice) -> Variant:
        """GpuState.apply, spelled out in one place (a queue applies a choice for most of its nodes)."""
        v = self.chosen[node] = nc.variants[choice.pick]
        resident, w, rows, steps, sizes = self.resident, self.w, self.rows, self.steps, self.sizes
        if choice.unload:
            why = f"makes room for {self.names[node]} ({nc.class_type})"
            for m in choice.unload:
                resident.remove(m)
                self.held -= w[m]
                self.now = tuple(resident)
                self.unloaded.add(m)
                base = sizes.base(m)
                if base is not None:
                    del self.kept[base]
                step = self.unload_step(m, "pinned" if m in self.pinned or base is not None else "drop")
                rows.append(Row(step, self.held, self.now, 0.0, why))
        for m in sizes.unique(v.models):
            if m not in resident:
                self.load(m, f"for {self.names[node]}")
        for m in v.streams:
            if m in self.pins and m not in self.pinned:
                self.pin(m)
        gpu_bytes = self.held + v.activation
        bp = choice.blocks
        if bp is not None:
            if choice.takes is not None:
                resident.remove(choice.takes)
                self.held -= w[choice.takes]
                del self.kept[bp.model]
            gpu_bytes = self.held + bp.gpu_bytes
            self.moved += bp.uploaded
            part = self.kept_part(bp)
            if part is not None:
                self.kept[bp.model] = part
                resident.append(part)
                self.held += w[part]
            self.now = tuple(resident)
        key = (self.names[node], v.name)
        run = steps.get(key)
        if run is None:
            run = steps[key] = Run(*key)
        rows.append(Row(run, gpu_bytes, self.now, choice.seconds, choice.note, tuple(v.streams), bp))
        self.held_after[node] = self.held
        return v

    def run_step(self, node: int, v: Variant) -> Run:
        key = (self.names[node], v.name)
        got = self.steps.get(key)
        if got is None:
            got = self.steps[key] = Run(*key)
        assert isinstance(got, Run)
        return got

    def load_step(self, m: str, src: str, pin: bool) -> Load:
        key = ("load", m, src, "pin" if pin else "")
        got = self.steps.get(key)
        if got is None:
            got = self.steps[key] = Load(m, src, pin)
        assert isinstance(got, Load)
        return got

    def unload_step(self, m: str, to: str) -> Unload:
        key = ("unload", m, to)
        got = self.steps.get(key)
        if got is None:
            got = self.steps[key] = Unload(m, to)
        assert isinstance(got, Unload)
        return got


class Recall:
    """Pass 3's fast path: the nodes of a queue repeat, and so do their choices. A choice depends only on the node's
    variants, the resident models in their order (kept parts included), the pinned copies, and the look ahead's
    answers to the evictions it priced. So a node takes a remembered choice, instead of being weighed, where
    - `steady`: the last node of its kind left the GPU as it found it (the same resident models in the same order,
      the same pinned copies: a queue's next encode or sample that takes over the last one's kept part, or a decode
      beside it), nothing has moved since, and the look ahead answers it from the same nodes (all distances shorter
      by as much) or from nodes of the same kinds at the same distances (`same_answers`); or
    - `known`: a node of its kind met the same state (in this or another pass 3 of the plan), and the same questions,
      asked again in the same order, get the same reload seconds and distances that rank alike (`alike`)."""

    def __init__(self, state: GpuState, look: NextUse, memo: Memo, order: list[int]) -> None:
        assert memo.known is not None
        self.state, self.look, self.known, self.kinds, self.order = state, look, memo.known, memo.kinds, order
        self.steady: dict[int, Steady] = {}  # per kind

    def same_answers(self, steady: Steady, i: int) -> bool:
        """Whether the look ahead answers a node at position i as it answered the steady node of its kind."""
        for table, j in steady.targets:
            if table[i + 1] != j:
                break
        else:
            return True
        n, kinds, order = len(self.order), self.kinds, self.order
        for table, j in steady.targets:
            k = table[i + 1]
            if k == n or j == n:  # (no use left: in a run that does not repeat, the same answer either way)
                if k != j:
                    return False
            elif k - i != j - steady.at or kinds[order[k]] != kinds[order[j]]:
                return False
        return True

    def remembered(self, key: tuple[int, tuple[str, ...], frozenset[str]], i: int, nc: NodeCost) -> Choice | None:
        got = self.known.get(key)
        if got is None or not got.questions:
            return got.choice if got is not None else None
        for q in got.questions:
            if self.state.evict_cost(q.answer.model, i, nc.variants[q.pick]).seconds != q.answer.seconds:
                return None
        if len(self.state.asked) > 1 and not alike(got.questions, self.state.asked):
            return None
        return got.choice

    def run(self, i: int, node: int, nc: NodeCost) -> None:
        """Node `node` at position i: a remembered choice where one holds, else weighed (and remembered)."""
        state, kind = self.state, self.kinds[node]
        got = self.steady.get(kind)
        if got is not None and got.now is state.now and got.copies is state.copies and self.same_answers(got, i):
            state.chosen[node] = got.variant
            state.moved += got.uploaded
            row = got.row
            state.rows.append(Row(state.run_step(node, got.variant), row.gpu_bytes, state.now, row.seconds, row.note,
                                  row.streams, row.blocks))
            state.held_after[node] = state.held
            return
        before, copies = state.now, state.copies
        key = (kind, before, copies)
        state.asked.clear()
        self.look.targets.clear()
        choice = self.remembered(key, i, nc)
        if choice is None:
            state.asked.clear()
            self.look.targets.clear()
            choice = state.weigh(i, nc)
            index = {id(x): j for j, x in enumerate(nc.variants)}
            self.known[key] = Known(choice, tuple(Question(index[id(a.cur)], a) for a in state.asked))
        v = state.apply(node, nc, choice)
        if state.copies is copies and state.now == before:
            state.now = before  # (the same object: the steady choices are by its identity)
            targets = self.look.targets
            for _, j in targets:
                if j < 0:
                    break
            else:
                self.steady[kind] = Steady(before, copies, tuple(targets), i, v,
                                           choice.blocks.uploaded if choice.blocks is not None else 0, state.rows[-1])


def assign(order: list[int], shape: Shape, sizes: Sizes, budget: Budget, cm: CostModel, start: Residency,
           prov: list[Variant], pins: frozenset[str], repeat: bool, memo: Memo) -> Assigned:
    """Pass 3: residency and variants along a fixed order, by the rules of graph/plan/gpu.py `GpuState`: a node
    without weights that fits beside the resident ones runs as it is; every other node is weighed, and its choice
    applied. With `memo.known` (not None) the fast path: `Recall`, and the look ahead from tables (`NextUse`)."""
    state: GpuState
    recall = None
    if memo.known is not None:
        look = NextUse(order, prov, sizes, budget.gpu, repeat, memo)
        state = FastGpuState(shape.names, sizes, budget, cm, start, pins, look, memo)
        recall = Recall(state, look, memo, order)
    else:
        state = GpuState(shape.names, sizes, budget, cm, start, pins, LookAhead(order, prov, sizes, budget.gpu, repeat))
    for i, node in enumerate(order):
        nc = shape.costs[node]
        vs = nc.variants
        if len(vs) == 1 and not vs[0].models and not vs[0].streams and state.held + vs[0].activation <= budget.gpu:
            state.run_as_is(node, vs[0])
        elif recall is not None:
            recall.run(i, node, nc)
        else:
            state.asked.clear()
            state.apply(node, nc, state.weigh(i, nc))
    return assigned(state, order)


def assigned(state: GpuState, order: list[int]) -> Assigned:
    """The pass 3 that `state` walked along `order`."""
    chosen = [v for v in state.chosen if v is not None]
    return Assigned(state.rows, order, chosen, state.end(), state.loads, state.unloaded, state.moved, state.weighed,
                    state.held_after, state.held_start)


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
