"""Block-granular residency: which blocks of a streamed model stay on the GPU during a node, and what it costs.

Pure (no torch). A node whose variant carries `Blocks` (nodes/types.py) runs its model pass after pass through
the same blocks (the transformer once per sampling step, the text encoder once per encode). For that node the
plan keeps a set R of blocks on the GPU (uploaded once, when the node starts, with the weights outside the
blocks) and streams the others from their pinned host copy in every pass, through two staging buffers the size
of the largest streamed block: while one block computes, the next streamed one is copied into the other buffer
(models/streaming.py does exactly this, on a second CUDA stream, with events).

The time model (`seconds`) replays that pipeline: one copy engine at `bandwidth` bytes/s and one compute
stream. The copy of the g-th streamed block (counting over all passes) starts once the copy engine is free and
the buffer it fills has been released by the streamed block two before it; a block computes once the block
before it is done and, if streamed, its copy has landed. The resident upload comes first. Passes beyond the
third repeat the third's duration (the pipeline is periodic by then).

After the node the resident part stays on the GPU as a *kept part* of the model (`part_key`): a planner model of
`resident_bytes` that the next node streaming the same model with the same resident blocks takes over instead of
uploading it again (`reuse`), and that any node short of room may push out like a whole model.

`choose` minimises that time under the memory the node may use: for every count of streamed blocks per kind
of block (same size and time), the streamed ones spread evenly among their kind; from the best few of those a
local search (stream one block more or fewer, or swap a streamed and a resident block) goes on while that helps.
Only sets that could win are timed: a floor under a set's time (the upload, and per pass the compute or the copies,
whichever is longer) skips the others, and times are remembered per spec. tests/test_residency.py checks the choice
against brute force on small cases, tests/test_fast_paths.py against the same search timing every set.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...nodes.types import Blocks

GiB = 2**30
# The share of the pinned host->GPU bandwidth (CostModel.h2d_pinned, one 2 GiB copy) that block-sized copies of
# separate tensors reach while the other stream computes. Measured on the H200 by bench/streaming.py at commit 02d12f9
# (bench/results/streaming-02d12f9.json, "constants"; tests/test_constants.py reads it): a klein-4B single block
# (234 MiB, 4 tensors) copies at 55.1 GB/s alone (0.996 of the 55.35 GB/s of one 2 GiB copy); a copy and a 3.25 ms
# single-block compute side by side take 4.94 ms, i.e. 49.7 GB/s of copy with the compute hidden: 0.897 of pinned.
STREAM_COPY_EFFICIENCY = 0.897
SEEDS = 3  # the local search starts from the best few evenly spread candidates ...
WIDE = 12  # ... and tries every swap, up to this many blocks; beyond, from the best one, swaps within 2 places


@dataclass(frozen=True)
class BlockPlan:
    """The plan's choice for one node that streams a model: what stays, what streams, what it costs."""

    model: str
    resident: tuple[int, ...]  # indices of the blocks kept on the GPU for the node
    streamed: tuple[int, ...]  # indices of the blocks streamed in every pass
    n: int  # blocks in all
    resident_bytes: int  # uploaded once when the node starts: the resident blocks and the fixed weights
    streamed_bytes: int  # copied in every pass
    staging: int  # bytes of the staging buffers
    passes: int
    seconds: float  # predicted time of the node: upload, passes and their stalls
    compute_seconds: float  # the compute alone (all passes)
    gpu_bytes: int  # the node's GPU peak above other resident models (fixed + resident + staging + activation)
    unit: str = "step"
    passes_per_unit: int = 1
    reused: int = 0  # bytes of the resident part already on the GPU, kept from an earlier node (not uploaded)

    @property
    def uploaded(self) -> int:
        """Bytes copied host->GPU over the whole node: the resident part unless it was kept, and every pass."""
        return self.resident_bytes - self.reused + self.total_streamed

    @property
    def total_streamed(self) -> int:
        """Bytes copied host->GPU by the streaming over the whole node (the upload of resident blocks aside)."""
        return self.streamed_bytes * self.passes

    def describe(self, label: str) -> str:
        """E.g. 'transformer 14/25 blocks resident, 3.10 GiB streamed per step'."""
        per = self.streamed_bytes * self.passes_per_unit / GiB
        kept = f" ({self.reused / GiB:.2f} GiB of them kept from before)" if self.reused else ""
        return (f"{label} {len(self.resident)}/{self.n} blocks resident{kept}, {per:.2f} GiB streamed per "
                f"{self.unit}")

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}


def seconds(spec: Blocks, streamed: tuple[int, ...], bandwidth: float) -> float:
    """Predicted time of the node with `streamed` (sorted block indices) streamed and the others resident.

    The copy of streamed block g waits for the copy engine and for the compute of block g - 2 (g - 1 with one
    staging buffer), which frees the buffer it fills; block g computes once block g - 1 is done and its copy has
    landed. tests/test_fast_paths.py checks it, to the last bit, against a replay of the pipeline event by event."""
    sizes, secs = spec.sizes, spec.seconds
    mask = [False] * len(sizes)
    for i in streamed:
        mask[i] = True
    t0 = (spec.fixed + sum(s for s, m in zip(sizes, mask, strict=True) if not m)) / bandwidth
    copy = [sizes[i] / bandwidth for i, m in enumerate(mask) if m]  # copy seconds of each streamed block, in order
    k = len(copy)
    passes = spec.passes
    if k == 0:
        return t0 + passes * sum(secs)
    sim = min(passes, 3)
    nbuf = min(2, k)
    total = k * sim
    ready = [0.0] * total  # when the copy of streamed block g (counting over all passes) has landed
    engine = t0  # when the copy engine is free
    for g in range(nbuf):  # the first copies wait for the resident upload only
        engine = max(engine, t0) + copy[g]
        ready[g] = engine
    pipe = list(zip(secs, mask, strict=True))
    c = prev = t0
    g = 0
    for _ in range(sim):
        prev = c
        for s, m in pipe:
            if m:
                r = ready[g]
                c = (c if c >= r else r) + s  # (max(), spelled out: this loop is the planner's hottest)
                h = g + nbuf
                if h < total:  # block g's buffer is free: the copy engine fills it with block g + nbuf
                    engine = (engine if engine >= c else c) + copy[h % k]
                    ready[h] = engine
                g += 1
            else:
                c += s
    if passes > sim:  # periodic from the third pass on
        c += (passes - sim) * (c - prev)
    return c


def _plan(spec: Blocks, streamed: tuple[int, ...], secs: float) -> BlockPlan:
    gone = set(streamed)
    resident = tuple(i for i in range(len(spec.sizes)) if i not in gone)
    return BlockPlan(spec.model, resident, streamed, len(spec.sizes),
                     spec.fixed + sum(spec.sizes[i] for i in resident), sum(spec.sizes[i] for i in streamed),
                     spec.staging(streamed), spec.passes, secs, spec.passes * sum(spec.seconds),
                     spec.gpu_bytes(streamed), spec.unit, spec.passes_per_unit)


PART = "#kept="  # a kept part's key: the model's key, this, the resident blocks (e.g. "transformer:..#kept=0-10")


def part_key(model: str, resident: tuple[int, ...]) -> str:
    """The planner's key of `model`'s resident part kept on the GPU after a node that streamed it."""
    runs = []
    for _, grp in itertools.groupby(enumerate(resident), lambda t: t[1] - t[0]):
        idx = [i for _, i in grp]
        runs.append(str(idx[0]) if len(idx) == 1 else f"{idx[0]}-{idx[-1]}")
    return f"{model}{PART}{','.join(runs)}"


def part_of(key: str) -> str | None:
    """The model whose kept part `key` is, None for a whole model's key."""
    model, sep, _ = key.rpartition(PART)
    return model if sep else None


def part_blocks(key: str) -> tuple[int, ...]:
    """The resident blocks a kept part's key names."""
    out: list[int] = []
    for run in filter(None, key.rpartition(PART)[2].split(",")):  # (none: only the weights outside the blocks)
        a, _, b = run.partition("-")
        out += range(int(a), int(b or a) + 1)
    return tuple(out)


def part_label(label: str, resident: tuple[int, ...]) -> str:
    return f"{label} ({len(resident)} blocks kept)"


def reuse(bp: BlockPlan, bandwidth: float) -> BlockPlan:
    """`bp` run with its resident part already on the GPU: nothing is uploaded before the first pass, which the
    pipeline of `seconds` starts that much earlier (its times are all counted from the end of the upload)."""
    upload = bp.resident_bytes / (bandwidth * STREAM_COPY_EFFICIENCY)
    return dataclasses.replace(bp, reused=bp.resident_bytes, seconds=max(0.0, bp.seconds - upload))


def keeping(spec: Blocks, resident: tuple[int, ...], room: int, bandwidth: float) -> BlockPlan | None:
    """The plan with exactly `resident` kept (a part already on the GPU), reused, if it fits in `room`."""
    gone = set(resident)
    streamed = tuple(i for i in range(len(spec.sizes)) if i not in gone)
    if spec.gpu_bytes(streamed) > room:
        return None
    bw = bandwidth * STREAM_COPY_EFFICIENCY
    return reuse(_plan(spec, streamed, seconds(spec, streamed, bw)), bandwidth)


def with_resident(spec: Blocks, resident: tuple[int, ...], bandwidth: float, cache: BlockCache | None = None
                  ) -> BlockPlan:
    """The plan that keeps exactly `resident` (sorted block indices) and streams the others, uploaded afresh (`reuse`
    for one whose part is already on the GPU); its fit is the caller's to check (`BlockPlan.gpu_bytes`)."""
    bw = bandwidth * STREAM_COPY_EFFICIENCY
    gone = set(resident)
    streamed = tuple(i for i in range(len(spec.sizes)) if i not in gone)
    times = (cache or BlockCache()).times_of(spec, bw)
    secs = times.get(streamed)
    if secs is None:
        secs = times[streamed] = seconds(spec, streamed, bw)
    return _plan(spec, streamed, secs)


def spread(positions: list[int], k: int) -> list[int]:
    """k of `positions`, evenly spaced (the middle of k equal parts)."""
    n = len(positions)
    return [positions[(2 * j + 1) * n // (2 * k)] for j in range(k)]


class BlockCache:
    """The block choices (`choose`) and the times of streamed sets, by spec, for the plans of one caller (owned by its
    graph/plan/planner.py `PlanContext`): a queue of N prompts asks N times for the same node at the same room, the
    searches of one node at several rooms time many of the same sets, and the next queue asks again. Each table is
    cleared when it reaches `limit` entries. Shared by threads it stays correct: an answer is the same whoever makes
    it, and a lost race only makes it twice."""

    def __init__(self, limit: int = 512) -> None:
        self.limit = limit
        self.chosen: dict[tuple[Blocks, int, float], BlockPlan | None] = {}
        self.times: dict[tuple[Blocks, float], dict[tuple[int, ...], float]] = {}

    def choose(self, spec: Blocks, room: int, bw: float) -> BlockPlan | None:
        key = (spec, room, bw)
        if key in self.chosen:
            return self.chosen[key]
        got = _choose(spec, room, bw, self)
        if len(self.chosen) >= self.limit:
            self.chosen.clear()
        self.chosen[key] = got
        return got

    def times_of(self, spec: Blocks, bw: float) -> dict[tuple[int, ...], float]:
        """`seconds` of the streamed sets looked at so far, for one spec and bandwidth (the room does not matter)."""
        got = self.times.get((spec, bw))
        if got is None:
            if len(self.times) >= self.limit:
                self.times.clear()
            got = self.times[(spec, bw)] = {}
        return got


def choose(spec: Blocks, room: int, bandwidth: float, cache: BlockCache | None = None) -> BlockPlan | None:
    """The resident set with the least predicted time whose `gpu_bytes` fits in `room`, or None if none fits
    (`cache`: the caller's, else one for this call)."""
    return (cache or BlockCache()).choose(spec, room, bandwidth * STREAM_COPY_EFFICIENCY)


def _choose(spec: Blocks, room: int, bw: float, cache: BlockCache) -> BlockPlan | None:
    n = len(spec.sizes)
    kinds: dict[tuple[int, float], list[int]] = {}
    for i in range(n):
        kinds.setdefault((spec.sizes[i], spec.seconds[i]), []).append(i)
    groups = list(kinds.values())
    search = _Search(spec, room, bw, cache.times_of(spec, bw))
    evenly = []
    for counts in itertools.product(*(range(len(g) + 1) for g in groups)):
        streamed = tuple(sorted(i for g, k in zip(groups, counts, strict=True) for i in spread(g, k)))
        if search.fits(streamed):
            evenly.append((search.floor(streamed), streamed))
    if not evenly:
        return None
    # The best `keep` of the spread sets start the local search. Timed in the order of their floors, the ones left
    # once a floor is above the keep-th best time so far cannot be among them: their times are above it too.
    keep = SEEDS if n <= WIDE else 1
    starts: list[tuple[float, int, tuple[int, ...]]] = []
    best: list[float] = []  # the keep best (rounded) times so far, negated: a heap whose top is the keep-th best
    for low, streamed in sorted(evenly):
        if len(best) == keep and low > -best[0] + 1e-9:
            break
        t = round(search.seconds(streamed), 9)
        starts.append((t, sum(spec.sizes[i] for i in streamed), streamed))
        heapq.heappush(best, -t)
        if len(best) > keep:
            heapq.heappop(best)
    starts.sort()
    found = [_improve(search, st, t) for t, _, st in starts[:keep]]
    secs, streamed = min(found, key=lambda f: (round(f[0], 9), sum(spec.sizes[i] for i in f[1])))
    return _plan(spec, streamed, secs)


class _Search:
    """What the search asks many times of one (spec, room, bandwidth): whether a streamed set fits, a floor under
    its time, and its time (each computed once)."""

    def __init__(self, spec: Blocks, room: int, bw: float, times: dict[tuple[int, ...], float] | None = None) -> None:
        self.spec, self.room, self.bw = spec, room, bw
        self.total = spec.fixed + sum(spec.sizes)
        self.pass_compute = sum(spec.seconds)
        self.times = {} if times is None else times

    def fits(self, streamed: tuple[int, ...]) -> bool:
        return self.spec.gpu_bytes(streamed) <= self.room

    def floor(self, streamed: tuple[int, ...]) -> float:
        """A little below `seconds(streamed)` (sorted indices), from what the pipeline cannot beat: the resident upload
        comes first; then each of the first min(passes, 3) passes costs at least its compute, and the copy engine
        copies every streamed byte of them; each later pass (the third's duration) costs at least its compute and
        the copies of all but its first two streamed blocks, which only start once it has. Less a billionth, which
        is far more than the rounding of either computation."""
        sp = self.spec
        sizes = sp.sizes
        each = sum(sizes[i] for i in streamed) / self.bw  # copy seconds of one pass
        sim = min(sp.passes, 3)
        low = (self.total - sum(sizes[i] for i in streamed)) / self.bw + sim * max(self.pass_compute, each)
        if sp.passes > sim:
            late = each - sum(sizes[i] for i in streamed[:2]) / self.bw
            low += (sp.passes - sim) * max(self.pass_compute, late)
        return low - 1e-9 * max(1.0, low)

    def seconds(self, streamed: tuple[int, ...]) -> float:
        t = self.times.get(streamed)
        if t is None:
            t = self.times[streamed] = seconds(self.spec, streamed, self.bw)
        return t


def _improve(search: _Search, streamed: tuple[int, ...], secs: float) -> tuple[float, tuple[int, ...]]:
    """Local search from `streamed`: stream one block more or fewer, or swap a streamed and a resident one, while
    that is faster (a move whose floor is not faster is not timed)."""
    n = len(search.spec.sizes)
    while True:
        cur = set(streamed)
        moves = [cur - {i} for i in cur] + [cur | {j} for j in range(n) if j not in cur]
        moves += [(cur - {i}) | {j} for i in cur for j in range(n) if j not in cur and (n <= WIDE or abs(i - j) <= 2)]
        found = None
        for m in moves:
            cand = tuple(sorted(m))
            if not search.fits(cand):
                continue
            limit = secs - 1e-9 * max(1.0, secs)  # faster, not a rounding error's worth
            if search.floor(cand) >= limit:
                continue
            t = search.seconds(cand)
            if t < limit:
                found, secs = cand, t
        if found is None:
            return secs, streamed
        streamed = found


def floor_text(spec: Blocks) -> str:
    """What the least budget of a streamed node is made of, for the message that rejects a smaller one."""
    largest = max(spec.sizes)
    return (f"streaming needs at least {spec.min_gpu() / GiB:.2f} GiB: the largest block {largest / GiB:.2f} GiB "
            f"in two staging buffers, the weights outside the blocks {spec.fixed / GiB:.2f} GiB and the activation "
            f"{spec.activation / GiB:.2f} GiB")
