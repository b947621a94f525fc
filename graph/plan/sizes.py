"""What the planner's passes ask of sizes: byte sums of model sets and variants, the block choices of streamed
variants (memoised for one plan), each node's kind, and the error for a node that fits with no variant.

Pure: it sees sizes (graph/plan/types.py), never tensors.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import networkx as nx

from . import residency
from .order import cycle_error
from .residency import BlockPlan
from .types import GiB, ModelCost, NodeCost, PlanError, Residency, gib

if TYPE_CHECKING:
    from ...nodes.types import Variant


class Sizes:
    """Byte sums of model sets and variants, and the block choices of streamed variants, memoised for one plan (the
    planner's inner loops ask often; variants and specs by identity: they live as long as the plan's costs)."""

    def __init__(self, models: Mapping[str, ModelCost]) -> None:
        self.models = models
        self._cache: dict[tuple[str, ...], int] = {}
        self._unique: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._blocks: dict[tuple[int, int, float], BlockPlan | None] = {}
        self._specs: dict[tuple, Any] = {}  # a Blocks' fields -> the first Blocks seen with them
        self._of_blocks: Any = None
        self._spec: dict[int, Any] = {}  # id of a Blocks -> the first equal one seen
        self._alone: dict[int, int] = {}
        self.parts: dict[str, ModelCost] = {}  # kept parts (graph/plan/residency.py) made by pass 3, by key
        self._base: dict[str, str | None] = {}
        self._keeping: dict[tuple[int, str, int, float], BlockPlan | None] = {}
        self._part: dict[tuple[str, tuple[int, ...]], str] = {}

    def w(self, key: str) -> int:
        m = self.models.get(key)
        return (m if m is not None else self.parts[key]).nbytes

    def base(self, key: str) -> str | None:
        """The model whose kept part `key` is; None for a whole model."""
        got = self._base.get(key, ...)
        if got is ...:
            got = self._base[key] = residency.part_of(key)
        return got

    def part(self, bp: BlockPlan) -> str | None:
        """The key of the part a streamed node leaves on the GPU (its fixed weights and resident blocks), made
        known to the plan; None when it leaves nothing."""
        if not bp.resident_bytes:
            return None
        key = self._part.get((bp.model, bp.resident))
        if key is None:
            key = self._part[(bp.model, bp.resident)] = residency.part_key(bp.model, bp.resident)
        if key not in self.models and key not in self.parts:
            label = residency.part_label(self.models[bp.model].name, bp.resident)
            self.parts[key] = ModelCost(key, bp.resident_bytes, label)
            self._base[key] = bp.model
        return key

    def uses(self, m: str, v: Variant) -> bool:
        """Whether v needs m on the GPU: a model it names, or a kept part of the model it streams by blocks."""
        base = self.base(m)
        if base is None:
            return m in v.models
        return v.blocks is not None and v.blocks.model == base

    def excludes(self, m: str, v: Variant) -> bool:
        """Whether m must leave before v runs: a kept part of a model v loads whole."""
        base = self.base(m)
        return base is not None and base in v.models

    def keeping(self, v: Variant, part: str, room: int, bandwidth: float) -> BlockPlan | None:
        """residency.keeping for v with the blocks of the kept part `part`, once per spec, part and room."""
        spec = self._canonical(v)
        key = (id(spec), part, room, bandwidth)
        if key not in self._keeping:
            self._keeping[key] = residency.keeping(spec, residency.part_blocks(part), room, bandwidth)
        return self._keeping[key]

    @property
    def nbytes(self) -> dict[str, int]:
        return {k: m.nbytes for k, m in self.models.items()}

    def weights(self, keys: tuple[str, ...]) -> int:
        got = self._cache.get(keys)
        if got is None:
            got = self._cache[keys] = sum(self.w(k) for k in dict.fromkeys(keys))
        return got

    def unique(self, keys: tuple[str, ...]) -> tuple[str, ...]:
        """`keys` without repeats, in their order."""
        got = self._unique.get(keys)
        if got is None:
            got = self._unique[keys] = tuple(dict.fromkeys(keys))
        return got

    def choose(self, v: Variant, room: int, bandwidth: float) -> BlockPlan | None:
        """residency.choose for the blocks of v, once per distinct spec and room: the nodes of a queue have equal
        specs in distinct objects, and the cache behind residency.choose hashes and compares a whole spec per call."""
        spec = self._canonical(v)
        key = (id(spec), room, bandwidth)
        if key not in self._blocks:
            self._blocks[key] = residency.choose(spec, room, bandwidth)
        return self._blocks[key]

    def _canonical(self, v: Variant) -> Any:
        """The first spec seen equal to v's blocks (the caches above key specs by its identity)."""
        b = v.blocks
        assert b is not None
        spec = self._spec.get(id(b))
        if spec is None:
            spec = self._spec[id(b)] = self._specs.setdefault(self.of_blocks(b), b)
        return spec

    def of_blocks(self, b: Any) -> tuple:
        """A Blocks' fields as a plain tuple (hashed and compared in C, where a dataclass's own methods build the same
        tuple in Python)."""
        if self._of_blocks is None:
            self._of_blocks = operator.attrgetter(*(f.name for f in dataclasses.fields(b)))
        return self._of_blocks(b)

    def holds(self, u: Variant, v: Variant, gpu: int) -> bool:
        """Whether u, a variant that fits alone, holds whole the models v streams (pass 3 streams only a model that
        cannot stay)."""
        return u.blocks is None and self.alone(u) <= gpu and set(v.streams) <= set(u.models)

    def alone(self, v: Variant) -> int:
        """GPU bytes a variant needs with nothing else resident."""
        got = self._alone.get(id(v))
        if got is None:
            got = self._alone[id(v)] = self.weights(v.models) + v.activation
        return got


def node_kinds(dag: nx.DiGraph, costs: list[NodeCost], sizes: Sizes, gpu: int, shortcuts: bool = True
               ) -> tuple[list[int], list[Variant]]:
    """Each node's kind for pass 3's remembered choices, and its provisional variant (the first that fits alone), by
    the nodes' numbers (`costs`: their NodeCosts, graph/plan/order.py `Shape`).

    Two nodes are of a kind exactly when their variants are equal, field by field: the key is made of plain tuples of
    every field, which hash and compare in C (a variant's blocks by theirs, `Sizes.of_blocks`), and nodes that list
    the same variant objects are of a kind without that key (a queue's nodes do: nodes/estimates.py). A node that
    lists one variant object twice is of a kind of its own (a choice names its variant by its index, and so do the
    look ahead's questions), and so is one with one variant without weights, where a key would cost more than it
    saves (`shortcuts` False: every kind by its key).
    Raises PlanError at the first node that fits with no variant."""
    of_variant = of_blocks = None
    by_key: dict[tuple, int] = {}
    by_ids: dict[tuple[int, ...], int] = {}  # the same variant objects: the same kind, without a look at their fields
    #                                          (the estimates of a queue's nodes share them, nodes/estimates.py)
    fit: list[int] = []  # per kind: the index of its first variant that fits alone
    kinds: list[int] = []
    prov: list[Variant] = []
    by_list: dict[int, int] = {}  # ... at a glance by the id of their tuple, which such nodes share too
    for nc in costs:
        vs = nc.variants
        k = by_list.get(id(vs)) if shortcuts else None
        if k is not None:
            pass
        elif len(vs) == 1 and not vs[0].models and not vs[0].streams:
            k = len(fit)  # (one without weights: pass 3 runs it as it is unless it does not fit beside the resident
            #               models, which is rare enough to weigh it every time)
        else:
            ids = (id(vs[0]),) if len(vs) == 1 else tuple(map(id, vs))
            k = by_ids.get(ids) if shortcuts else None
            if k is None:
                if len(set(ids)) < len(ids):
                    k = len(fit)
                else:
                    if of_variant is None:
                        of_variant = operator.attrgetter(*(f.name for f in dataclasses.fields(vs[0])
                                                           if f.name != "blocks"))
                        of_blocks = sizes.of_blocks
                    key = tuple([(of_variant(u), u.blocks and of_blocks(u.blocks)) for u in vs])
                    k = by_ids[ids] = by_key.setdefault(key, len(fit))
            if shortcuts and (len(ids) == 1 or len(set(ids)) == len(ids)):
                by_list[id(vs)] = k
        if k == len(fit):
            j = next((j for j, u in enumerate(vs) if sizes.alone(u) <= gpu), None)
            if j is None:
                raise cycle_error(dag) or infeasible(nc, sizes, gpu)
            fit.append(j)
        kinds.append(k)
        prov.append(vs[fit[k]])
    return kinds, prov


def infeasible(nc: NodeCost, sizes: Sizes, budget: int) -> PlanError:
    v = min(nc.variants, key=sizes.alone)
    needed, w = sizes.alone(v), sizes.weights(v.models)
    at_least = -(-needed * 100 // GiB) / 100  # rounded up to the hundredth: a budget that surely fits
    if v.blocks is not None:
        fit = (f"{residency.floor_text(v.blocks)}; it needs a budget of at least {at_least:.2f} GiB "
               "(or a smaller image or batch)")
    elif w < budget:
        fit = (f"it would fit with a budget of at least {at_least:.2f} GiB, or with {v.name!r} at an activation "
               f"of at most {(budget - w) * 100 // GiB / 100:.2f} GiB (a smaller image or batch)")
    else:
        fit = (f"its weights alone ({gib(w)} GiB) exceed the budget; it needs a budget of at least "
               f"{at_least:.2f} GiB")
    what = "streamed" if v.blocks is not None else f"(weights {gib(w)} GiB + activation {gib(v.activation)} GiB)"
    msg = (f"node {nc.node!r} ({nc.class_type}) needs {gib(needed)} GiB of GPU memory with its smallest variant "
           f"{v.name!r} {what} but the budget is {gib(budget)} GiB; {fit}")
    details = "; ".join(f"{x.name}: {gib(sizes.alone(x))} GiB (weights {gib(sizes.weights(x.models))} + "
                        f"activation {gib(x.activation)})" for x in nc.variants)
    extra = {"variants": [{"name": x.name, "needed_bytes": sizes.alone(x)} for x in nc.variants],
             "min_budget_gib": at_least}
    return PlanError(nc.node, nc.class_type, needed, budget, msg, details, extra)


def all_fit(kinds: Iterable[tuple[Variant, ...]], sizes: Sizes, gpu: int, resident: Residency) -> bool:
    """Whether pass 3 from `resident` surely unloads no model and streams none (`kinds`: the variants of each kind of
    node): the variants it weighs need models that fit on the GPU together, beside what is resident (kept parts too)
    and the largest of their activations (it evicts only for a variant that does not fit), and none of them streams.
    It never weighs a variant that streams a model another variant of its node holds whole: that one fits and is
    free."""
    weighed = []
    for vs in kinds:
        for v in vs:
            if sizes.alone(v) > gpu:
                continue
            if v.streams or v.blocks is not None:
                if v.blocks is None or not any(sizes.holds(u, v, gpu) for u in vs):
                    return False
                continue
            weighed.append(v)
    held = {m for v in weighed for m in v.models} | resident.gpu
    return sum(sizes.w(m) for m in held) + max((v.activation for v in weighed), default=0) <= gpu
