"""The engine's torch-free half: a prompt validated, estimated and planned, before anything runs.

`prepare` is what `Engine.prepare` does and what `vramgraph plan` needs on its own: validate the prompt,
estimate every node from shapes (model sizes from the catalogue: checkpoint headers, or the built-in
klein specs), drop the nodes whose outputs are cached (same input signature as before: the same inputs
and the same files read, by each file-reading node's `IS_CHANGED`) and ask the planner for a Plan.
`Planning` holds its settings for callers that plan without an Engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from ...nodes import ENGINE_NODES
from ...nodes.catalog import ModelCatalog
from ...nodes.files import MODEL_EXTENSIONS, Folders
from ...nodes.lora import identity_of as _identity
from ...nodes.lora import share_merges
from ...nodes.types import is_link, is_mapping
from ..plan import planner
from ..workflow import estimate
from ..workflow.errors import ValidationFailed
from ..workflow.queue import digest
from ..workflow.validate import Defaults, inputs_with_defaults, validate
from .budget import with_card


@dataclass(frozen=True)
class Prepared:
    """A validated prompt with its estimates and plan, ready to run."""

    prompt: dict
    dag: nx.DiGraph
    outputs: tuple[str, ...]
    costs: Mapping[str, Any]
    signatures: Mapping[str, str]
    cached: tuple[str, ...]
    plan: planner.Plan
    hidden: Mapping[str, tuple[dict, dict | None]] = field(default_factory=dict)  # queued: node -> own prompt, pnginfo


def signatures(prompt: Mapping[str, dict], dag: nx.DiGraph, changed: Mapping[str, Any] | None = None,
               signed: Mapping[str, tuple] | None = None) -> dict[str, str]:
    """Per node a hash of its class, its inputs (linked inputs by their source's signature, so a change anywhere
    reaches every node after it) and its `changed` value: what `IS_CHANGED` said of the files it reads (ComfyUI's
    cache key). `signed`: nodes whose outputs sign themselves (LoRA loaders: a model by its file and LoRA chain), so
    a consumer of one output does not see changes that only touch another (a text encoding keeps its cache when only
    the model's LoRA changed)."""
    sig: dict[str, str] = {}
    changed = changed or {}
    signed = signed or {}

    def link(v: list) -> list:
        if v[0] in signed and v[1] < len(signed[v[0]]):
            return ["value", digest(signed[v[0]][v[1]])[:24]]
        return ["link", sig.get(v[0], v[0]), v[1]]

    for node in nx.topological_sort(dag):
        spec = prompt[node]
        inputs = {k: link(v) if is_link(v) else v for k, v in spec["inputs"].items()}
        key = [spec["class_type"], inputs] + ([changed[node]] if node in changed else [])
        sig[node] = digest(key)[:24]
    return sig


def changes(prompt: Mapping[str, dict], dag: nx.DiGraph, nodes: Mapping[str, type], folders: Folders,
            costs: Mapping[str, Any]) -> dict[str, Any]:
    """Per node with an `IS_CHANGED` classmethod (the nodes that read files: images, masks, models) its value now,
    from its inputs (a linked one by the value its source is known to give ahead of time, e.g. a primitive's)."""
    known = {n: c.outputs for n, c in costs.items()}
    out: dict[str, Any] = {}
    for node in dag.nodes:
        cls = nodes[prompt[node]["class_type"]]
        if callable(getattr(cls, "IS_CHANGED", None)):
            inputs = inputs_with_defaults(cls, estimate.inputs_of(prompt, node, known), folders)
            out[node] = cls.IS_CHANGED(folders=folders, **inputs)
    return out


@dataclass(frozen=True)
class _AssumedFiles(Folders):
    """Folders whose model lists also hold the files a prompt names: a plan from the built-in specs needs none."""

    assumed: frozenset[str] = frozenset()

    def list(self, folder: str) -> list[str]:
        found = super().list(folder)
        return found if folder == "input" else sorted({*found, *self.assumed})


def _model_names(prompt: Any) -> frozenset[str]:
    """Every literal input of `prompt` that looks like a model file name."""
    nodes = prompt.values() if is_mapping(prompt) else ()
    return frozenset(v for n in nodes if is_mapping(n) and is_mapping(n.get("inputs"))
                     for v in n["inputs"].values() if isinstance(v, str) and v.lower().endswith(MODEL_EXTENSIONS))


def prepare(prompt: dict, nodes: Mapping[str, type], folders: Folders, catalog: ModelCatalog, budget: planner.Budget,
            cost: planner.CostModel, *, repeat: bool = True, cached: Collection[str] = (),
            start: planner.Residency | None = None, resident: Mapping[str, planner.ModelCost] | None = None,
            outputs: Iterable[str] | None = None, context: planner.PlanContext | None = None,
            merged: Mapping[str, tuple] | None = None) -> Prepared:
    """Validate, estimate and plan `prompt` (API format). Raises ValidationFailed or planner.PlanError.

    `cached`: signatures whose outputs the caller holds (those nodes are not planned); `start`: where weights
    are now; `resident`: models held from earlier prompts (the planner may have to evict them); `outputs`: the
    output nodes to run (ComfyUI's partial_execution_targets), None for all; `context`: the caller's planner context
    (graph/plan/planner.py `PlanContext`: its caches); `merged`: per GPU-resident model the LoRAs merged into its
    weights now (graph/engine/ledger.py `merged`), counted as done for the nodes applying the same ones."""
    shown = folders
    if catalog.allow_builtin:  # planning without weights: a named model file is taken as present
        shown = _AssumedFiles(**{f.name: getattr(folders, f.name) for f in dataclasses.fields(Folders)},
                              assumed=_model_names(prompt))
    check = validate(prompt, nodes, shown, None if outputs is None else list(outputs))
    if not check.ok:
        raise ValidationFailed(check.response())
    prompt = {n: check.prompt[n] for n in check.dag.nodes}
    estimated = estimate.propagate(prompt, check.dag, nodes, catalog, Defaults(folders))
    merged = dict(merged or {})
    costs = share_merges(estimated, merged)
    signed = {n: tuple(_identity(o) for o in costs[n].outputs) for n in check.dag.nodes
              if getattr(nodes[prompt[n]["class_type"]], "VG_SIGNS_OUTPUTS", False)}
    sigs = signatures(prompt, check.dag, changes(prompt, check.dag, nodes, folders, costs), signed)
    held = set(cached)
    done = tuple(n for n in check.dag.nodes if sigs[n] in held)
    # the planner only reads the graph: a copy is made only of the part that is not cached
    todo = check.dag.subgraph(n for n in check.dag.nodes if n not in done).copy() if done else check.dag
    while True:
        node_costs, models = estimate.planner_inputs(prompt, costs)
        for key, m in (resident or {}).items():
            models.setdefault(key, m)
        try:
            plan = planner.plan(todo, {n: node_costs[n] for n in todo.nodes}, models, budget, cost,
                                start or planner.Residency(), repeat=repeat, context=context)
        except planner.PlanError as e:  # a node larger than the budget: say which card it needs (the --vram to type)
            raise with_card(e, budget) from None
        lost = merges_lost(plan, costs)
        if not lost:
            return Prepared(prompt, check.dag, check.outputs, costs, sigs, done, plan)
        for key in lost:  # planned again without counting on those merges (at most once per model)
            del merged[key]
        costs = share_merges(estimated, merged)


def merges_lost(plan: planner.Plan, costs: Mapping[str, Any]) -> set[str]:
    """The models whose merged LoRAs a node's variant counts as done (nodes/lora.py `share_merges`) while the plan
    loads or unloads the model before that node: the move gives it its base weights again, so the merge is not there."""
    moved: set[str] = set()
    lost = set()
    for s in plan.steps:
        step = s.step
        if isinstance(step, planner.Run):
            v = next((v for v in costs[step.node].variants if v.name == step.variant), None)
            choice = getattr(v, "lora", None)
            if choice is not None and choice.warm and choice.chain[0] in moved:
                lost.add(choice.chain[0])
        else:
            moved.add(step.model)
    return lost


@dataclass
class Planning:
    """Settings to plan with and no GPU: what `vramgraph plan` uses instead of an Engine (no torch)."""

    folders: Folders
    catalog: ModelCatalog
    budget: planner.Budget
    nodes: Mapping[str, type] = field(default_factory=lambda: dict(ENGINE_NODES))
    cost: planner.CostModel = field(default_factory=planner.CostModel)
    context: planner.PlanContext = field(default_factory=planner.PlanContext)  # what its plans share

    def prepare(self, prompt: dict, *, repeat: bool = True) -> Prepared:
        return prepare(prompt, self.nodes, self.folders, self.catalog, self.budget, self.cost, repeat=repeat,
                       context=self.context)
