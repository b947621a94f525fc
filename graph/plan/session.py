"""Residency for the runs to come, not for this one alone: the plan of a run that will run again.

A workflow run N times, an interactive session's next prompt, the server's queue one prompt at a time: the same
nodes run image after image. Pass 3 (graph/plan/gpu.py) weighs one node at a time. On a 12 GiB card at the sampler it
prices loading the transformer whole (and reloading the text encoder that this pushes out) against streaming the
transformer blocks that do not fit beside the resident text encoder, and streaming wins by a few hundredths of a
second, image after image: the transformer runs 4 to 100 passes an image and streams most of itself in each, the
text encoder runs once. Kept whole, the transformer would cost its load once, and the text encoder, streamed once
an image, a fraction of that.

**The rule.** Where the plan expects the same run again (`repeat`) and the run is small (`Session.small`: at most
SMALL_NODES nodes that use the GPU and SMALL_MODELS models), an exact dynamic programme over the next HORIZON runs of
the order, from the GPU as it is now, chooses for every node its variant, the models that leave the GPU before it,
and for a node that streams a model block by block which resident part it keeps (one of the model's `parts`):

- a streamed model's parts (`ladder`, `fill`): 1/PARTS, 2/PARTS, ... of its blocks (spread evenly or the first
  ones); near whole, where the 1/PARTS steps are coarse, all its blocks but 1, 2, 4, ... (the smallest stream: a
  block kept there spares its copy in every pass, 25 to 100 an image); beside each of another model's near-whole
  parts, the most of its blocks that stay with that part through the whole run (the two share the card); and
  pass 3's own choice beside each set of the other models held whole;
- a state between two nodes: per model, absent, whole, or one of its parts kept after a streamed node;
- a node goes from one state to the next by dropping models it does not use (free: they have pinned copies), loading
  the models its variant holds whole (their bytes at pinned speed) and running (its seconds); a streamed node uploads
  its resident part unless that same part is on the GPU, and streams the other blocks every pass
  (graph/plan/residency.py `seconds`); at its peak everything must fit in the budget;
- a path costs its seconds plus a price per byte copied host->GPU, one path per price: first the BYTE_PRICES
  (seconds alone, and bytes dear: 3 s per second of copy), then the price at which the chosen plan so far and the
  plan with the most bytes among those with fewer that are too slow cost the same (`tie`): a path between the two in
  bytes and seconds is the cheapest at that price, if the programme has one; again, up to TIES times, until no new
  path comes.

Pass 3's own plan stands without the programme where it moves nothing after the first run and its runs then take no
more than WITHIN over `floor` (every node in its fastest variant, held: no plan's run is faster).

Each path, and pass 3's own plan run HORIZON times, is carried out run after run by `GpuState.apply` (so all are
priced alike, pinned copies and file reads included). Of these, among the plans within WITHIN (1 %) of the fastest
total, the one that copies the fewest bytes (loads and streaming) is chosen, pass 3's on a tie; this run is its first
run. Its end is where the next run starts (`Plan.end`): what stays resident is chosen for the next prompt.

The choice is remembered (`Memory`, in the caller's PlanContext) for this start and, along the chosen path, for the
start each later run comes to: the next prompts follow the path without the programme.

Off by default (`PlanContext.session`; an engine turns it on with VRAMGRAPH_PLAN_AHEAD=on) until its plans are
measured on the GPU. Pure: it sees sizes and predicted seconds, never tensors.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from . import residency
from .gpu import Choice, GpuState, LookAhead
from .residency import BlockPlan
from .types import Budget, CostModel, NodeCost, Residency

if TYPE_CHECKING:
    from ...nodes.types import Blocks, Variant
    from .assign import Assigned
    from .sizes import Sizes

HORIZON = 8  # runs the programme looks at: this one and the seven after it
SMALL_NODES = 5  # at most this many nodes that use the GPU in one run (one image, not a queue)...
SMALL_MODELS = 4  # ... and this many models (resident at the start or used): the states stay few
PARTS = 6  # a streamed model's parts: 1/PARTS, 2/PARTS, ... of its blocks resident (spread or the first ones)
BYTE_PRICES = (0.0, 3.0)  # seconds charged per second of pinned copy (bytes / h2d_pinned): first these two...
TIES = 4  # ... then at most this many more, each where two paths tie (`tie`)
WITHIN = 0.01  # plans within 1 % of the fastest total count as fast: the fewest bytes wins
NEAR = (1, 2, 4, 8, 16)  # near whole, finer than 1/PARTS: all of a model's blocks but these many (the bytes halve)

ABSENT, WHOLE = 0, 1  # a model's level in a state; 2 + i: its i-th part


class Move(NamedTuple):
    """The programme's choice for one node: its variant (index), the models it drops (indices), its block plan."""

    pick: int
    drop: tuple[int, ...]
    blocks: BlockPlan | None


class Ways(NamedTuple):
    """A node's ways from one state, by columns: the state each comes to, its seconds, its bytes copied, its move."""

    after: list[tuple[int, ...]]
    secs: list[float]
    copied: list[int]
    moves: list[Move]


class Option(NamedTuple):
    """A variant of a node as the programme sees it: the models it holds whole, the one it streams by blocks (-1:
    none) and those it streams whole (they must be absent)."""

    pick: int
    variant: Variant
    need: tuple[int, ...]
    block: int
    streams: tuple[int, ...]


class Session:
    """The programme for one plan: the models, their parts, each node's options, and the paths."""

    def __init__(self, nodes: list[NodeCost], sizes: Sizes, budget: Budget, cm: CostModel, start: Residency) -> None:
        self.nodes, self.sizes, self.gpu, self.cm = nodes, sizes, budget.gpu, cm
        self.bw = cm.h2d_pinned
        self.models = self.keys(nodes, sizes, start)
        self.index = {m: j for j, m in enumerate(self.models)}
        self.specs: dict[int, Blocks] = {}  # per model: the first block spec that streams it
        for nc in nodes:
            for v in nc.variants:
                if v.blocks is not None:
                    self.specs.setdefault(self.index[v.blocks.model], v.blocks)
        self.parts: dict[int, list[tuple[int, ...]]] = {j: [] for j in self.specs}
        self.part_bytes: dict[tuple[int, tuple[int, ...]], int] = {}
        self.start = self.state_of(start)  # (adds the start's kept parts to `parts`)
        self.options = [self.options_of(nc) for nc in nodes]
        self.near: dict[int, list[tuple[int, ...]]] = {}
        for j in self.specs:
            self.ladder(j)
        for j in self.specs:
            self.fill(j)
        self.plans: dict[int, list[tuple[int, BlockPlan]]] = {}  # per spec (by identity): a plan per part
        self.moves: dict[tuple[int, tuple[int, ...]], Ways] = {}
        self.layers: dict[tuple[int, tuple[tuple[int, ...], ...]], Layer] = {}

    @staticmethod
    def keys(nodes: list[NodeCost], sizes: Sizes, start: Residency) -> list[str]:
        """The models of the programme's states, in its order: those the nodes use, then those resident at the start."""
        used = [m for nc in nodes for v in nc.variants for m in (*v.models, *v.streams)]
        held = [sizes.base(k) or k for k in sorted(start.gpu)]
        return list(dict.fromkeys(used + held))

    @staticmethod
    def small(nodes: list[NodeCost], start: Residency) -> bool:
        """Whether the programme's states stay few: one run's worth of nodes and models (a queue's run is not: it
        is told at its sixth node that uses the GPU)."""
        gpu_nodes = 0
        models: set[str] = {residency.part_of(k) or k for k in start.gpu}
        for nc in nodes:
            if any(v.models or v.streams for v in nc.variants):
                gpu_nodes += 1
                if gpu_nodes > SMALL_NODES:
                    return False
                models.update(m for v in nc.variants for m in (*v.models, *v.streams))
        return 0 < gpu_nodes and len(models) <= SMALL_MODELS

    # ---------------------------------------------------------------------------------------- states

    def state_of(self, res: Residency) -> tuple[int, ...]:
        level = [ABSENT] * len(self.models)
        for k in res.gpu:
            base = self.sizes.base(k)
            if base is None:
                level[self.index[k]] = WHOLE
            else:
                j = self.index[base]
                level[j] = self.part_level(j, residency.part_blocks(k))
        return tuple(level)

    def part_level(self, j: int, resident: tuple[int, ...]) -> int:
        parts = self.parts.setdefault(j, [])
        if resident not in parts:
            parts.append(resident)
            spec = self.specs.get(j)
            if spec is not None:
                self.part_bytes[(j, resident)] = spec.fixed + sum(spec.sizes[i] for i in resident)
            else:  # a kept part at the start of a model no node streams now: its bytes as the plan knows them
                self.part_bytes[(j, resident)] = self.sizes.w(residency.part_key(self.models[j], resident))
        return 2 + parts.index(resident)

    def held(self, j: int, level: int) -> int:
        """Bytes model j holds at `level`."""
        if level == ABSENT:
            return 0
        if level == WHOLE:
            return self.sizes.w(self.models[j])
        return self.part_bytes[(j, self.parts[j][level - 2])]

    def ladder(self, j: int) -> None:
        """Model j's parts: 1/PARTS, 2/PARTS, ... of its blocks resident, spread evenly over the model or its first
        blocks (whose compute hides the copies of the others in the first pass), all of them but 1, 2, 4, ... where
        that is finer than 1/PARTS (`near`: the smallest streamed), and the set
        that graph/plan/residency.py `choose` finds fastest in the room left beside each set of the other models held
        whole (pass 3's own choice). (`choose` alone does not do: where the streaming hides behind the compute it
        keeps the fewest blocks, whose upload is the only time it adds, but a part kept for the next run is uploaded
        once and spares its blocks' copies in every pass after.)"""
        spec = self.specs[j]
        n = len(spec.sizes)
        for k in range(1, PARTS + 1):
            count = round(n * k / PARTS)
            if count:
                self.part_level(j, tuple(sorted(residency.spread(list(range(n)), count))))
                self.part_level(j, tuple(range(count)))
        self.near[j] = [keep_all_but(spec, streamed) for streamed in NEAR if streamed * PARTS < n]
        for part in self.near[j]:
            self.part_level(j, part)
        others = [self.sizes.w(m) for i, m in enumerate(self.models) if i != j]
        bw = self.bw * residency.STREAM_COPY_EFFICIENCY
        for mask in itertools.product((0, 1), repeat=len(others)):
            room = self.gpu - sum(w for w, on in zip(others, mask, strict=True) if on)
            bp = self.sizes.blocks.choose(spec, room, bw) if room >= spec.min_gpu() else None
            if bp is not None and bp.resident_bytes:
                self.part_level(j, bp.resident)

    def fill(self, j: int) -> None:
        """Beside each near-whole part of another streamed model (`near`), the most of model j's blocks (all but the
        fewest, `keep_all_but`) that stay on the GPU with it through the whole run (`stays`): the two parts that
        share the card, which neither ladder pairs by itself."""
        n = len(self.specs[j].sizes)
        for i in self.specs:
            for part in self.near[i] if i != j else []:
                for streamed in range(n):
                    mine = keep_all_but(self.specs[j], streamed)
                    if self.stays({i: part, j: mine}):
                        self.part_level(j, mine)
                        break

    def stays(self, parts: dict[int, tuple[int, ...]]) -> bool:
        """Whether these parts (per model, its blocks kept) fit beside every node of the run, each node in one of its
        variants on the GPU (one moved to the CPU is no way to keep them): the models it holds whole, and its peak (a
        streamed node: with its own part, if it is one of them, kept)."""
        for options in self.options:
            on_gpu = [o for o in options if o.need or o.block >= 0 or o.streams] or options
            if not any(self.fits_beside(o, parts) for o in on_gpu):
                return False
        return True

    def fits_beside(self, o: Option, parts: dict[int, tuple[int, ...]]) -> bool:
        if any(j in o.need or j in o.streams for j in parts):
            return False
        used = sum(self.sizes.w(self.models[j]) for j in o.need)
        for j, kept in parts.items():
            if j != o.block:
                used += self.specs[j].fixed + sum(self.specs[j].sizes[b] for b in kept)
        spec = o.variant.blocks
        if spec is None:
            return used + o.variant.activation <= self.gpu
        own = parts.get(o.block)
        if own is None:
            return used + spec.min_gpu() <= self.gpu
        return used + spec.gpu_bytes(tuple(b for b in range(len(spec.sizes)) if b not in own)) <= self.gpu

    def options_of(self, nc: NodeCost) -> list[Option]:
        out = []
        for k, v in enumerate(nc.variants):
            if self.sizes.alone(v) > self.gpu:
                continue
            block = self.index[v.blocks.model] if v.blocks is not None else -1
            need = tuple(dict.fromkeys(self.index[m] for m in v.models))
            streams = tuple(self.index[m] for m in v.streams if self.index[m] != block)
            out.append(Option(k, v, need, block, streams))
        return out

    # ---------------------------------------------------------------------------------------- one node

    def load_seconds(self, j: int) -> float:
        """A load at pinned speed: a model's first read from its file is paid by every plan that uses it, loaded or
        streamed (the paths are then priced as they run, `follow`)."""
        return self.cm.load_seconds(self.sizes.w(self.models[j]), True)

    def block_plans(self, o: Option, own: int) -> list[tuple[int, BlockPlan]]:
        """(level after, plan) for each part the streamed node may keep (the part already there, `own`, reused), and
        every block streamed where that keeps nothing (no weights outside the blocks)."""
        spec = o.variant.blocks
        assert spec is not None
        fresh = self.plans.get(id(spec))
        if fresh is None:
            fresh = [(2 + i, residency.with_resident(spec, r, self.bw, self.sizes.blocks))
                     for i, r in enumerate(self.parts[o.block])]
            if not spec.fixed:
                fresh.append((ABSENT, residency.with_resident(spec, (), self.bw, self.sizes.blocks)))
            self.plans[id(spec)] = fresh
        if own < 2:
            return fresh
        return [(level, residency.reuse(bp, self.bw) if level == own else bp) for level, bp in fresh]

    def steps(self, i: int, s: tuple[int, ...]) -> list[tuple[tuple[int, ...], float, int, Move]]:
        """Every way node i can run from state s: (state after, seconds, bytes copied, move). A model it does not use
        is dropped only where it does not fit beside the node: dropping it later is free, so of the sets of such
        models kept, only the largest that fit (no model more fits) are tried."""
        out = []
        for o in self.options[i]:
            v = o.variant
            forced = [j for j in o.streams if s[j] != ABSENT]
            forced += [j for j in o.need if s[j] >= 2]  # a part leaves before its model loads whole
            if o.block >= 0 and s[o.block] == WHOLE:
                forced.append(o.block)  # (streamed, it is not held whole too)
            free = [j for j in range(len(s)) if s[j] != ABSENT and j not in o.need and j != o.block
                    and j not in forced]
            loads = [j for j in o.need if s[j] != WHOLE]
            secs0 = sum(self.load_seconds(j) for j in (*loads, *o.streams))
            copied0 = sum(self.sizes.w(self.models[j]) for j in (*loads, *o.streams))
            need_b = sum(self.sizes.w(self.models[j]) for j in o.need)
            plans = self.block_plans(o, s[o.block]) if o.block >= 0 else [(-1, None)]
            sets = self.keeps(s, free, o.need, forced)
            for level, bp in plans:
                peak = bp.gpu_bytes if bp is not None else v.activation
                room = self.gpu - need_b - peak
                secs, copied = (self.cm.run_seconds(v), 0) if bp is None else (bp.seconds, bp.uploaded)
                for held, larger, base, drop in sets:
                    if held > room or larger <= room:
                        continue  # (it does not fit, or a larger set fits: keeping that costs nothing more)
                    after = list(base)
                    if bp is not None:
                        after[o.block] = level
                    out.append((tuple(after), secs + secs0, copied + copied0, Move(o.pick, drop, bp)))
        return out

    def keeps(self, s: tuple[int, ...], free: list[int], need: tuple[int, ...],
              forced: list[int]) -> list[tuple[int, int | float, list[int], tuple[int, ...]]]:
        """Per set of the `free` models kept (the largest first): the bytes they hold, the least bytes of that set with
        one model more (where none of those fits, no larger set does: bytes only add), the state after it (with the
        models in `need` whole) and the models dropped."""
        out = []
        for kept in subsets(free):
            held = sum(self.held(j, s[j]) for j in kept)
            larger = min((held + self.held(j, s[j]) for j in free if j not in kept), default=math.inf)
            after = [ABSENT] * len(s)
            for j in kept:
                after[j] = s[j]
            for j in need:
                after[j] = WHOLE
            out.append((held, larger, after, tuple(forced + [j for j in free if j not in kept])))
        return out

    def ways(self, i: int, s: tuple[int, ...]) -> Ways:
        """`steps`, once per node and state, without a way to a state that another way reaches in no more seconds
        and with no more bytes (no price prefers it)."""
        key = (i, s)
        got = self.moves.get(key)
        if got is None:
            best: dict[tuple[int, ...], list[tuple[tuple[int, ...], float, int, Move]]] = {}
            for way in sorted(self.steps(i, s), key=lambda w: (w[1], w[2])):
                kept = best.setdefault(way[0], [])
                if not kept or way[2] < kept[-1][2]:  # (sorted by seconds: only fewer bytes can still count)
                    kept.append(way)
            flat = [w for ways in best.values() for w in ways]
            got = self.moves[key] = Ways([w[0] for w in flat], [w[1] for w in flat], [w[2] for w in flat],
                                         [w[3] for w in flat])
        return got

    # ---------------------------------------------------------------------------------------- the programme

    def layer(self, i: int, states: tuple[tuple[int, ...], ...]) -> Layer:
        """Node i's ways from each of `states` (`ways`), once per node and states: a path's runs come back to the
        same states, and every price goes the same ways."""
        key = (i, states)
        got = self.layers.get(key)
        if got is None:
            afters: dict[tuple[int, ...], int] = {}
            src: list[int] = []
            dst: list[int] = []
            secs: list[float] = []
            copied: list[int] = []
            moves: list[Move] = []
            for k, s in enumerate(states):
                ways = self.ways(i, s)
                src += [k] * len(ways.after)
                dst += [afters.setdefault(after, len(afters)) for after in ways.after]
                secs += ways.secs
                copied += ways.copied
                moves += ways.moves
            got = self.layers[key] = Layer.of(tuple(afters), src, dst, secs, copied, moves)
        return got

    def paths(self, runs: int, price: float) -> list[list[Move]]:
        """The cheapest path over `runs` runs of the order from the start (seconds + price x bytes at pinned speed),
        as each run's moves."""
        per_byte = price / self.bw
        n = len(self.nodes)
        cost = np.zeros(1)
        states: tuple[tuple[int, ...], ...] = (self.start,)
        back: list[tuple[Layer, np.ndarray]] = []  # per node run: the way that came to each state
        for step in range(runs * n):
            lay = self.layer(step % n, states)
            if not lay.states:
                return []
            cost, came = lay.cheapest(cost, per_byte)
            states = lay.states
            back.append((lay, came))
        at = int(np.argmin(cost))  # (the first of the cheapest, as every choice here)
        moves: list[Move] = []
        for lay, came in reversed(back):
            way = int(came[at])
            moves.append(lay.moves[way])
            at = int(lay.src[way])
        moves.reverse()
        return [moves[r * n:(r + 1) * n] for r in range(runs)]


class Layer(NamedTuple):
    """One node's ways from a list of states, grouped by the state they come to (in the order each is first come
    to, and in each group in the order of the ways): `src` the state each comes from, `states` those it comes to."""

    states: tuple[tuple[int, ...], ...]
    src: np.ndarray
    dst: np.ndarray
    secs: np.ndarray
    copied: np.ndarray
    moves: list[Move]
    starts: np.ndarray  # where each group begins

    @staticmethod
    def of(states: tuple[tuple[int, ...], ...], src: list[int], dst: list[int], secs: list[float],
           copied: list[int], moves: list[Move]) -> Layer:
        order = np.argsort(np.array(dst, dtype=np.int64), kind="stable")
        to = np.array(dst, dtype=np.int64)[order]
        starts = np.flatnonzero(np.r_[True, to[1:] != to[:-1]]) if len(to) else np.zeros(0, dtype=np.int64)
        # (bytes < 2**53 are exact as floats: `cheapest` adds the very numbers a walk over the ways in Python would)
        return Layer(states, np.array(src, dtype=np.int64)[order], to, np.array(secs, dtype=np.float64)[order],
                     np.array(copied, dtype=np.float64)[order], [moves[k] for k in order], starts)

    def cheapest(self, cost: np.ndarray, per_byte: float) -> tuple[np.ndarray, np.ndarray]:
        """Each state's least cost (the cost of the state it comes from + seconds + bytes x per_byte) and the way
        that gives it: the first of the cheapest in the group (as a walk over the ways that keeps only a cheaper one
        would)."""
        total = cost[self.src] + self.secs + self.copied * per_byte
        least = np.minimum.reduceat(total, self.starts)
        at = np.flatnonzero(total == least[self.dst])
        came = at[np.r_[True, self.dst[at][1:] != self.dst[at][:-1]]]
        return total[came], came


def keep_all_but(spec: Blocks, streamed: int) -> tuple[int, ...]:
    """The blocks kept where all but `streamed` of them are: those streamed are the smallest (the fewest bytes a
    pass), spread evenly among the blocks of one size."""
    out: list[int] = []
    for size in sorted(set(spec.sizes)):
        group = [i for i, b in enumerate(spec.sizes) if b == size]
        take = min(streamed - len(out), len(group))
        out += residency.spread(group, take) if take else []
    gone = set(out)
    return tuple(i for i in range(len(spec.sizes)) if i not in gone)


def subsets(items: list[int]) -> list[tuple[int, ...]]:
    """Every subset of `items`, the largest first."""
    return [c for k in range(len(items), -1, -1) for c in itertools.combinations(items, k)]


def follow(moves: list[Move], order: list[int], names: list[str], nodes: list[NodeCost], sizes: Sizes,
           budget: Budget, cm: CostModel, start: Residency, pins: frozenset[str], models: list[str],
           prov: list[Variant]) -> Assigned:
    """One run carried out by pass 3's own `GpuState.apply`, each node as the programme chose."""
    from .assign import assigned

    state = GpuState(names, sizes, budget, cm, start, pins, LookAhead(order, prov, sizes, budget.gpu, True))
    for node, nc, move in zip(order, nodes, moves, strict=True):
        v = nc.variants[move.pick]
        unload = []
        for j in move.drop:
            m = models[j]
            unload.append(m if m in state.resident else state.kept[m])
        takes = state.kept.get(v.blocks.model) if v.blocks is not None else None
        bp = move.blocks
        if bp is not None:  # reused exactly where the part on the GPU now is the one it keeps
            assert v.blocks is not None
            bp = residency.with_resident(v.blocks, bp.resident, cm.h2d_pinned, sizes.blocks)
            if takes is not None and residency.part_blocks(takes) == bp.resident:
                bp = residency.reuse(bp, cm.h2d_pinned)
        secs = bp.seconds + state.read_first(v) if bp is not None else cm.run_seconds(v)
        note = v.note
        if bp is not None:
            label = sizes.models[bp.model].name
            note = "; ".join([*([v.note] if v.note else []), bp.describe(label)])
        if move.pick or bp is not None:
            note += ("; " if note else "") + "chosen for the runs to come (graph/plan/session.py)"
        state.apply(node, nc, Choice(move.pick, tuple(unload), bp, takes, secs, note))
    return assigned(state, order)


def total(runs: list[Assigned]) -> tuple[float, int]:
    """(predicted seconds, bytes copied host->GPU) of runs one after the other."""
    return sum(sum(r.seconds for r in a.rows) for a in runs), sum(a.moved for a in runs)


class Chosen(NamedTuple):
    """What `best` chose for one run, remembered by `Memory`: the programme's moves (None: pass 3's own plan) and the
    models its path unloads or streams (they get pinned copies); `after`: for each later run of the chosen path, the
    start it comes to (the run before's end) and its moves, which the next prompts take without the programme."""

    moves: tuple[Move, ...] | None
    moved: frozenset[str]
    after: tuple[tuple[Residency, tuple[Move, ...] | None], ...] = ()


class Memory:
    """`best`'s choices for the plans of one caller (its graph/plan/planner.py `PlanContext`), by the run's variants,
    the start and the budget: a session's runs come back to the same start image after image, and take the same
    choice again without the programme. Cleared when it reaches `limit` entries."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self.chosen: dict[tuple, Chosen] = {}

    def get(self, key: tuple) -> Chosen | None:
        return self.chosen.get(key)

    def put(self, key: tuple, chosen: Chosen) -> None:
        if len(self.chosen) >= self.limit:
            self.chosen.clear()
        self.chosen[key] = chosen

    def put_path(self, key: tuple, chosen: Chosen) -> None:
        """`chosen` for the run at `key` (its start at key[1]) and the rest of its path for the starts that path comes
        to, where nothing was chosen for them yet: a session follows the path it planned, and plans again where the
        path ends or the GPU is not as the path said."""
        self.put(key, chosen)
        for end, moves in chosen.after:
            later = (key[0], end, *key[2:])
            if later not in self.chosen:
                self.put(later, Chosen(moves, chosen.moved))


def best(greedy: Callable[[Residency], Assigned], first: Assigned, order: list[int], names: list[str],
         nodes: list[NodeCost], sizes: Sizes, budget: Budget, cm: CostModel, start: Residency,
         pins_for: Callable[[set[str]], frozenset[str]], prov: list[Variant], memory: Memory) -> Assigned:
    """This run's pass 3 for the runs to come (the module's rule): pass 3's own (`first`, and `greedy` from each end
    after it) against the programme's paths, over HORIZON runs; the chosen plan's first run."""
    key = (tuple(nc.variants for nc in nodes), start, budget.gpu, cm)
    got = memory.get(key)
    if got is None:
        got = choose(greedy, first, order, names, nodes, sizes, budget, cm, start, pins_for, prov)
        memory.put_path(key, got)
    if got.moves is None:
        return first
    done = follow(list(got.moves), order, names, nodes, sizes, budget, cm, start, pins_for(set(got.moved)),
                  Session.keys(nodes, sizes, start), prov)
    if [(r.step, r.blocks) for r in done.rows] == [(r.step, r.blocks) for r in first.rows]:
        return first  # this run as pass 3 makes it (only later runs differ): its notes say why
    return done


def choose(greedy: Callable[[Residency], Assigned], first: Assigned, order: list[int], names: list[str],
           nodes: list[NodeCost], sizes: Sizes, budget: Budget, cm: CostModel, start: Residency,
           pins_for: Callable[[set[str]], frozenset[str]], prov: list[Variant]) -> Chosen:
    """The module's rule: pass 3's plan and the programme's paths, first at each of BYTE_PRICES, then at up to TIES
    more prices, each the one at which the fewest-bytes path within WITHIN of the fastest and the path after it in
    bytes, which is not within, cost the same (a path between the two, if the programme has one, is the cheapest
    there); of those within WITHIN of the fastest, the fewest bytes."""
    runs = [first]
    while len(runs) < HORIZON:
        runs.append(greedy(runs[-1].end))
    greedy_path = Chosen(None, frozenset(), tuple((r.end, None) for r in runs[:-1]))
    if not any(a.moved for a in runs[1:]) and total(runs[-1:])[0] <= floor(nodes, cm) * (1 + WITHIN):
        return greedy_path  # pass 3 moves nothing after the first run, whose loads read each model once,
    # and then runs as fast as any plan can: its plan stands (streaming them instead is not for a first run)
    candidates = [(total(runs), greedy_path)]
    session = Session(nodes, sizes, budget, cm, start)
    tried: set[float] = set()

    def priced(price: float) -> bool:
        """Whether the path at `price` is new (not the same seconds and bytes as a candidate already there)."""
        tried.add(price)
        path = session.paths(HORIZON, price)
        if not path:
            return False
        moved = {session.models[j] for run in path for mv in run for j in mv.drop}
        moved |= {mv.blocks.model for run in path for mv in run if mv.blocks is not None}
        pins = pins_for(moved)
        done, at = [], start
        for run in path:
            done.append(follow(run, order, names, nodes, sizes, budget, cm, at, pins, session.models, prov))
            at = done[-1].end
        got = total(done)
        if any(t == got for t, _ in candidates):
            return False
        after = tuple((d.end, tuple(run)) for d, run in zip(done, path[1:], strict=False))
        candidates.append((got, Chosen(tuple(path[0]), frozenset(moved), after)))
        return True

    for price in BYTE_PRICES:
        priced(price)
    for _ in range(TIES):  # (a path found again: none lies between the two)
        at = tie(candidates, cm.h2d_pinned)
        if at is None or at in tried or not priced(at):
            break
    return within(candidates)[1]


def floor(nodes: list[NodeCost], cm: CostModel) -> float:
    """The least seconds any run of `nodes` takes: each node in its fastest variant with its models on the GPU (a
    streamed one with all its blocks kept there already), nothing loaded."""
    least = 0.0
    for nc in nodes:
        times = []
        for v in nc.variants:
            if v.blocks is None:
                times.append(cm.run_seconds(v))
            else:
                every = tuple(range(len(v.blocks.sizes)))
                times.append(residency.reuse(residency.with_resident(v.blocks, every, cm.h2d_pinned),
                                             cm.h2d_pinned).seconds)
        least += min(times)
    return least


def within(candidates: list[tuple[tuple[float, int], Chosen]]) -> tuple[tuple[float, int], Chosen]:
    """Of the candidates within WITHIN of the fastest, the one that copies the fewest bytes (the first on a tie)."""
    fastest = min(t for (t, _), _ in candidates)
    return min((c for c in candidates if c[0][0] <= fastest * (1 + WITHIN)), key=lambda c: c[0][1])


def tie(candidates: list[tuple[tuple[float, int], Chosen]], bandwidth: float) -> float | None:
    """The price at which the chosen candidate (`within`) and the one with the most bytes of those with fewer that
    are not within cost the same; None where there is no such candidate."""
    (secs, nbytes), _ = within(candidates)
    fastest = min(t for (t, _), _ in candidates)
    slower = [t for t, _ in candidates if t[0] > fastest * (1 + WITHIN) and t[1] < nbytes]
    if not slower:
        return None
    hi_secs, hi_bytes = max(slower, key=lambda t: t[1])
    return (hi_secs - secs) * bandwidth / (nbytes - hi_bytes)
