"""The executor: carries out a Plan, measures every step, caches node outputs across runs.

It makes no decisions. `Engine.prepare` validates a prompt, estimates every node from shapes,
drops the nodes whose outputs are cached (same input signature as before) and asks the planner
for a Plan; `Engine.run` then executes the plan step by step: Load/Unload through the residency
ledger, Run by calling the node. Each Run's real GPU peak is measured and reported against the
prediction. A failing node (an allocation failure included) stops the run with an error that names
it; no later node runs, so no PNG is written from partial work. The nodes that finished before a failure
or an interrupt stay cached, so the next run starts at the node that stopped. A node's signature holds
what its `IS_CHANGED` says of the files it reads (graph/engine/planning.py), so a changed file runs it again.
The cache is the engine's one `OutputCache` (graph/engine/cache.py): each node's outputs and ui by signature.
What a run changes as it goes is its `RunState` (graph/engine/run.py), made by `Engine.run` for that run alone.

A run can also lose some of its outputs while it goes on (`Cancel`, a targeted interrupt of one prompt
of a merged queue): the nodes that only those outputs need are left out of the rest of the plan (the
one running is stopped at its next progress report), the others run as planned, so every other output
is computed by the same nodes with the same inputs as before.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import torch

from ...models.dtypes import torch_dtype
from ...models.qwen3 import PromptTokenizer
from ...models.step import StepOptions
from ...models.streaming import Kept
from ...nodes import ENGINE_NODES
from ...nodes.catalog import ModelCatalog
from ...nodes.files import Folders
from ...nodes.types import ModelInfo, Variant, is_link
from ...nodes.values import ModelHandle
from ..plan import planner
from ..workflow import estimate, queue
from ..workflow.errors import InterruptedRun, NodeExecutionError, _type_name
from ..workflow.validate import inputs_with_defaults
from . import budget as budget_mod
from .budget import DeviceMemory, Probe, budget_for, cuda_probe, live, short_plan_error, shortage
from .cache import CacheEntry, OutputCache
from .costs import cost_for
from .ledger import Ledger
from .planning import Prepared, prepare
from .run import Cancel, Cuts, Events, NodeReport, RunResult, RunState, _Dropped, _quiet

log = logging.getLogger("vramgraph.executor")
HIDDEN_VALUES = ("PROMPT", "EXTRA_PNGINFO", "UNIQUE_ID", "VG_CONTEXT")
SEED_INPUTS = ("noise_seed", "seed")


def seed_source(dag: nx.DiGraph, prompt: Mapping[str, dict], node: str) -> tuple[str, str] | None:
    """Where the seed a node's PNG records comes from: the node's own seed input, else that of the nearest node
    above it that has one (fewest links away; among nodes as near, the lowest id, numbers by value), as
    (node, input name); None when no node above it is seeded. Deterministic: two seeded samplers above a save
    always give the same answer (an image-to-image chain records its last sampler's seed)."""
    seen, ring = {node}, [node]
    while ring:
        for n in sorted(ring, key=_id_key):
            inputs = prompt[n]["inputs"]
            name = next((s for s in SEED_INPUTS if s in inputs), None)
            if name is not None:
                return n, name
        ring = list(dict.fromkeys(p for n in ring for p in dag.predecessors(n) if p not in seen))
        seen.update(ring)
    return None


def _id_key(node: str) -> tuple:
    """Node ids in a stable order: numbers by value before other names ("2" < "10" < "q0:1")."""
    return (0, int(node), "") if node.isdigit() else (1, 0, node)


def estimate_exceeded(report: NodeReport) -> dict | None:
    """The `vg_estimate_exceeded` event for a node whose measured GPU peak (above the weights resident when it
    started) passed the activation its plan predicted, or None when it stayed within. The measurement is the torch
    allocator's (CUDA only: on the CPU nothing is measured and nothing is flagged)."""
    if report.measured_bytes <= report.predicted_bytes:
        return None
    return {"node": report.node, "class_type": report.class_type, "variant": report.variant,
            "predicted_bytes": report.predicted_bytes, "measured_bytes": report.measured_bytes,
            "over_bytes": report.measured_bytes - report.predicted_bytes,
            "ratio": round(report.measured_bytes / report.predicted_bytes, 4) if report.predicted_bytes else None}


class NodeContext:
    """What a running node may ask of the engine (the `vg` hidden input): nodes/context.py `Context`, answered by
    the plan (where each model lives for this node's variant)."""

    def __init__(self, engine: Engine, node: str, class_type: str, variant: str, seed: int | None,
                 run: RunState, chosen: Variant | None = None, blocks: planner.BlockPlan | None = None) -> None:
        self.engine, self.node, self.class_type, self.variant = engine, node, class_type, variant
        self.seed, self.run, self._events = seed, run, run.events  # `run`: the run this node is part of
        self.chosen = chosen  # the plan's Variant for this node: which models it put on the GPU, which it streams
        self.blocks = blocks  # for a variant that streams a model block by block: the blocks the plan keeps

    def resident_blocks(self, handle: ModelHandle) -> tuple[int, ...]:
        """The blocks of a streamed model the plan keeps on the GPU for this node (the others stream)."""
        b = self.blocks
        return b.resident if b is not None and b.model == handle.key else ()

    def module(self, handle: ModelHandle) -> torch.nn.Module:
        """The model where the plan put it for this node's variant: resident on the GPU when the variant names it
        in `models`, the host copy when it streams it, else (a variant that runs off the GPU, as the CPU decode)
        its weights in host memory, so the node computes on the CPU."""
        key, v = handle.key, self.chosen
        if v is None or key in v.models:
            return self.engine.ledger.module(key)
        if key in v.streams:
            return self.engine.ledger.host_module(key)
        return self.engine.ledger.cpu_module(key)

    def host_module(self, handle: ModelHandle) -> torch.nn.Module:
        """The model's pinned host copy (for a node that streams it), waiting for its background read."""
        return self.engine.ledger.host_module(handle.key)

    def host_weights(self, handle: ModelHandle) -> dict[str, torch.Tensor] | None:
        """The model's host copy by parameter name, once read (a LoRA merged into GPU weights is undone from it)."""
        e = self.engine.ledger.entries.get(handle.key)
        return e.copy.host if e is not None and e.copy is not None else None

    def lora_applied(self, handle: ModelHandle, done: Any) -> None:
        """A merge (or its undoing) on the model's weights, noted in the ledger (graph/engine/ledger.py `note_lora`)."""
        self.engine.ledger.note_lora(handle.key, done)

    def kept_blocks(self, handle: ModelHandle) -> Kept:
        """Where a node that streams the model finds the resident part an earlier node left on the GPU, and leaves
        its own (models/streaming.py; the plan counts it as resident until a node needs the room)."""
        return self.engine.ledger.kept(handle.key)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def tokenizer(self, handle: ModelHandle) -> PromptTokenizer:
        return self.engine.tokenizer(handle.tokenizer)

    def model_info(self, kind: str, name: str, dtype: str = "default") -> ModelInfo:
        return self.engine.catalog.model_info(kind, name, dtype)

    def checkpoint_infos(self, name: str) -> tuple[ModelInfo, ModelInfo, ModelInfo]:
        return self.engine.catalog.checkpoint_infos(name)

    def tokenizer_for(self, info: ModelInfo) -> Path | None:
        return self.engine.catalog.tokenizer_for(info)

    @property
    def folders(self) -> Folders:
        return self.engine.folders

    def resolve(self, folder: str, name: str) -> Path:
        return self.engine.folders.resolve(folder, name)

    @property
    def max_image_pixels(self) -> int:
        return self.engine.folders.max_image_pixels

    def progress(self, value: int, total: int) -> None:
        self.check_interrupted()
        self._events("progress", {"node": self.node, "value": value, "max": total})

    def check_interrupted(self) -> None:
        self.engine.check_interrupted(self.node, self.class_type, self.run)

    @property
    def preview(self) -> Callable[[torch.Tensor, int, int], None] | None:
        """Step previews (when the engine's `previews` is on): the denoised latent as a small RGB picture."""
        if not self.engine.previews:
            return None

        def send(latent: torch.Tensor, step: int, steps: int) -> None:
            from ...models.preview import preview_images

            for i, image in enumerate(preview_images(latent, max_side=0)):
                self._events("preview", {"node": self.node, "step": step, "max": steps, "index": i, "image": image})

        return send

    @property
    def output_dir(self) -> Path:
        return self.engine.folders.output

    @property
    def temp_dir(self) -> Path:
        return self.engine.folders.temp


@dataclass
class _Short(Exception):
    """The GPU has less free than the plan counts on (caught by the run, which plans the rest again): before a load
    (`error` empty) or an allocation failure in a node or a load that was not ours to foresee (the node had used no
    more than its estimate). It holds the failure's text, never the exception, so that its frames' tensors are freed."""

    node: str  # the node that failed, or that the load was for
    class_type: str
    key: str  # what is retried once: the node, "load <model>" (failed), "check load <model>" (found short)
    error: str = ""  # "torch.OutOfMemoryError: ..." as the node raised it
    exception_type: str = ""
    traceback: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)  # the node's plain inputs, as errors show them
    predicted: int = 0
    used: int = 0  # what the node had allocated (its measured peak + the failed request)


def plan_ahead() -> bool:
    """$VRAMGRAPH_PLAN_AHEAD: "on" plans each prompt for the ones to come (graph/plan/session.py), "off" or unset
    with pass 3 alone; any other value is refused (ValueError naming the variable), never read as off."""
    value = os.environ.get("VRAMGRAPH_PLAN_AHEAD", "off")
    if value not in ("on", "off"):
        raise ValueError(f"VRAMGRAPH_PLAN_AHEAD={value!r}: use on or off")
    return value == "on"


def _tried(message: str) -> int:
    """The bytes a CUDA out-of-memory message says were asked for ("Tried to allocate 2.00 GiB"), else 0."""
    m = re.search(r"Tried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB)", message)
    return int(float(m.group(1)) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[m.group(2)]) \
        if m else 0


class Engine:
    """One process's engine: the model catalog, the residency ledger, the output cache and the budget, which
    outlive its runs; each run's own state is a RunState (graph/engine/run.py), never the engine's."""

    def __init__(self, folders: Folders, *, device: str | None = None, dtype: str | None = None,
                 budget: planner.Budget | None = None, nodes: Mapping[str, type] = ENGINE_NODES,
                 cost: planner.CostModel | None = None, allow_builtin: bool = False, previews: bool = False,
                 probe: Probe | None = None) -> None:
        self.folders = folders
        self.previews = previews  # step previews as "preview" events
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or ("bf16" if self.device.type == "cuda" else "fp32")
        self.nodes = dict(nodes)
        self.catalog = ModelCatalog(folders, self.dtype, allow_builtin)  # model infos and tokenizers
        self.ledger = Ledger(self.device)
        self.budget = budget or budget_for(self.device)
        # reads the device's free memory before each prompt and planned load (graph/engine/budget.py: the live budget)
        self.probe = probe if probe is not None else cuda_probe(self.device) if self.device.type == "cuda" else None
        self.cost = cost or cost_for(self.device)  # a CUDA device is probed; elsewhere the H200's, named as assumed
        # what this engine's plans share (the planner's caches); VRAMGRAPH_PLAN_AHEAD=on: plan each prompt for the
        # ones to come (graph/plan/session.py, docs/planner.md; off by default until measured on the GPU)
        self.planning = planner.PlanContext(session=plan_ahead())
        StepOptions.from_env()  # a bad $VRAMGRAPH_COMPILE or $VRAMGRAPH_ATTENTION is refused now, not mid-run
        self.cache = OutputCache()  # node outputs and ui by signature (graph/engine/cache.py); guarded by _lock
        self._interrupt = threading.Event()  # /interrupt, from any thread: the running run stops at its next check
        self._lock = threading.Lock()
        self._peaks = (0, 0)  # torch allocator peaks (allocated, reserved) since `peaks(reset=True)`, across nodes

    # -- services for nodes
    def tokenizer(self, path: Path | None) -> PromptTokenizer:
        return self.catalog.tokenizer(path)

    def interrupt(self) -> None:
        self._interrupt.set()

    def check_interrupted(self, node: str | None = None, class_type: str | None = None,
                          run: RunState | None = None) -> None:
        """Raise InterruptedRun when the engine was interrupted, or (a run with a Cancel) when `node` is no longer
        needed by `run`."""
        if self._interrupt.is_set():
            self._interrupt.clear()
            raise InterruptedRun(node, class_type)
        if run is not None and run.cuts is not None and run.cuts.apply(run, node):
            raise _Dropped(node, class_type)

    def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        """ComfyUI's /free: forget cached outputs and unload every model (weights and pinned copies)."""
        with self._lock:
            if free_memory or unload_models:
                self.cache.clear()
            if unload_models:
                self.ledger.forget(set())
            self._release()

    def close(self) -> None:
        """The engine's end: its output cache closed (it keeps nothing more) and every model unloaded."""
        with self._lock:
            self.cache.close()
            self.ledger.forget(set())
            self._release()

    def warm_up(self) -> None:
        """Pay the process's first-use costs before the first prompt comes: the GPU kernels' code and the
        bundled tokenizer (together 0.9-2.6 s on the H200). `vramgraph serve` calls this before it listens."""
        from ...models.common import warm_up_kernels

        with self._lock:
            t0 = time.perf_counter()
            try:
                self.tokenizer(None)
            except Exception as e:  # no bundled tokenizer here: prompts will name theirs
                log.debug("no bundled tokenizer to warm up: %s", e)
            try:
                if self.device.type == "cuda":
                    warm_up_kernels(self.device, torch_dtype(self.dtype))
                    self._release()
            except Exception:  # a slower first image, nothing worse
                log.exception("warming up the GPU kernels failed")
            log.info("warmed up (GPU kernels, tokenizer) in %.2f s", time.perf_counter() - t0)

    def peaks(self, reset: bool = False) -> tuple[int, int]:
        """The torch allocator's peak bytes (allocated, reserved) since the last reset. Torch's own counters
        restart before every node (each node's peak is measured apart), so they are folded in here."""
        if self.device.type != "cuda":
            return (0, 0)
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._peaks = (0, 0)
        self._fold_peaks()
        return self._peaks

    def _fold_peaks(self) -> None:
        self._peaks = (max(self._peaks[0], torch.cuda.max_memory_allocated(self.device)),
                       max(self._peaks[1], torch.cuda.max_memory_reserved(self.device)))

    # -- planning
    def live_budget(self) -> tuple[planner.Budget, DeviceMemory | None]:
        """The budget now: the one given, within what the device has free (graph/budget.live), and the reading."""
        if self.probe is None:
            return self.budget, None
        mem = self.probe()
        return live(self.budget, mem), mem

    def prepare(self, prompt: dict, *, repeat: bool = True, outputs: Iterable[str] | None = None) -> Prepared:
        """Validate, estimate and plan `prompt` (API format) from where the weights are now and what is cached;
        `outputs` limits the output nodes run (ComfyUI's partial_execution_targets), None runs them all.
        Raises ValidationFailed or planner.PlanError."""
        budget, mem = self.live_budget()
        try:
            prep = self._prepare(prompt, repeat, outputs, budget)
        except planner.PlanError as e:  # other processes took what it needs: say so
            if mem is None or budget.gpu >= self.budget.gpu or e.needed > self.budget.gpu:
                raise
            raise short_plan_error(e, self.budget, mem) from None
        infos = [o for c in prep.costs.values() for o in c.outputs if isinstance(o, ModelInfo)]
        held = self.ledger.entries
        stale = {i.key for i in infos if i.key in held and held[i.key].info.source != i.source}
        if stale:  # a model file replaced since its weights were read: drop them and plan again from the file
            log.info("model files changed on disk, their weights are read again: %s", ", ".join(sorted(stale)))
            self.ledger.forget(set(held) - stale)
            prep = self._prepare(prompt, repeat, outputs, budget)
        for info in infos:
            self.ledger.register(info)
        return prep

    def _prepare(self, prompt: dict, repeat: bool, outputs: Iterable[str] | None, budget: planner.Budget) -> Prepared:
        resident = self.ledger.model_costs()
        return prepare(prompt, self.nodes, self.folders, self.catalog, budget, self.cost, repeat=repeat,
                       outputs=outputs, cached=self.cache.signatures(),
                       start=self.ledger.residency(), resident=resident, context=self.planning,
                       merged=self.ledger.merged())

    # -- running
    def _blas_workspace(self) -> None:
        """This thread's cuBLAS workspace, made before the prompt rather than inside its first node. Torch keeps one per
        thread: the budget counted the one of the thread that made it; the server runs prompts on its worker thread,
        whose own workspace comes out of the budget here, once."""
        if self.device.type != "cuda":
            return
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if not budget_mod.has_blas_workspace(index):
            extra = budget_mod.blas_workspace(index)
            self.budget = dataclasses.replace(self.budget, gpu=max(0, self.budget.gpu - extra))

    def run(self, prompt: dict | Prepared, *, extra_pnginfo: dict | None = None, prompt_id: str | None = None,
            events: Events = _quiet, cancel: Cancel | None = None, exchange: Any = None) -> RunResult:
        """Run `prompt` (or a prepared one); `cancel` may take outputs out of it while it runs (see Cancel).
        `exchange` (graph/engine/devices.py): this engine runs one device's lane of a prompt placed on several; inputs
        made in other lanes come from it (waiting for them) and every node's outputs go to it."""
        with self._lock:
            self._interrupt.clear()
            self._blas_workspace()
            prep = prompt if isinstance(prompt, Prepared) else self.prepare(prompt)
            pid = prompt_id or uuid.uuid4().hex
            run = RunState(pid, prep, RunResult(pid, prep.plan, cached=prep.cached), events, extra_pnginfo,
                           exchange=exchange)
            events("execution_start", {"prompt_id": pid})
            events("plan", {"prompt_id": pid, "plan": prep.plan.to_json()})
            events("execution_cached", {"prompt_id": pid, "nodes": list(prep.cached)})  # as ComfyUI: empty too
            t0 = time.perf_counter()
            for n in prep.cached:
                self._take(run, n, self.cache[prep.signatures[n]])
            run.cuts = None if cancel is None else Cuts(cancel)
            try:
                i = 0
                while i < len(run.prep.plan.steps):
                    try:
                        self._step(run, i, run.prep.plan.steps[i])
                        i += 1
                    except _Short as short:  # other processes took memory: the rest of the run is planned again
                        run.prep, i = self._recover(short, run), 0
            except BaseException:
                self._keep(run)  # interrupted or failed: the nodes that finished stay cached
                self._release()
                raise
            self._keep(run)
            self.ledger.forget(_models_in(e.outputs for e in self.cache.entries()))
            self._release()
            run.result.seconds = time.perf_counter() - t0
            events("executing", {"node": None, "prompt_id": pid})
            events("execution_success", {"prompt_id": pid})
            return run.result

    @staticmethod
    def _take(run: RunState, node: str, entry: CacheEntry) -> None:
        """`node`'s outputs and ui from a cache entry (or another lane's), as if it had run in `run`."""
        run.values[node] = entry.outputs
        if entry.ui is not None:
            run.ui[node] = entry.ui

    def _recover(self, short: _Short, run: RunState) -> Prepared:
        """The rest of the run planned again within what the device has free now (its caches freed first), after a
        load found too little free or an allocation failed that the plan had room for; a failed node or load is
        retried once. When nothing fits, or it fails again, the error says what other processes hold."""
        again = bool(short.error) and short.key in run.retried
        run.retried.add(short.key)
        self._release()
        budget, mem = self.live_budget()
        mem = mem or DeviceMemory(0, 0)
        used = f"it used {short.used / 2**30:.2f} GiB of the {short.predicted / 2**30:.2f} GiB planned for it"
        if again:
            raise self._short_failure(short, run, f"{short.error}; it ran out of GPU memory again after the rest of "
                                      f"the prompt was planned again ({used}): {shortage(self.budget, mem)}; free GPU "
                                      "memory in the other processes, then queue again")
        try:
            new = self._replan(run, budget)
        except planner.PlanError as e:
            if not short.error:
                raise short_plan_error(e, self.budget, mem) from None
            raise self._short_failure(short, run, f"{short.error}; other processes took GPU memory while it ran "
                                      f"({used}): {shortage(self.budget, mem)}, and no plan of the rest of the prompt "
                                      f"fits: {e.message}") from None
        why = "ran out of GPU memory" if short.error else "is next and the device has less free than planned"
        log.warning("node %s (%s) %s: the rest of the run is planned again within %.2f GiB (%s)", short.node,
                    short.class_type, why, budget.gpu / 2**30, shortage(self.budget, mem))
        run.result.replans.append(new.plan)
        run.events("vg_replan", {"prompt_id": run.prompt_id, "node": short.node, "reason": "out_of_memory"
                                 if short.error else "load", "budget_bytes": budget.gpu, "others_bytes": mem.others,
                                 "free_bytes": mem.free, "plan": new.plan.to_json()})
        return new

    def _replan(self, run: RunState, budget: planner.Budget) -> Prepared:
        """`run.prep` planned again for its nodes not yet run (nor left out by a Cancel), from where weights are now."""
        prep, done = run.prep, set(run.values) | run.dropped()
        todo = prep.dag.subgraph(n for n in prep.dag.nodes if n not in done).copy()
        costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
        for key, m in self.ledger.model_costs().items():
            models.setdefault(key, m)
        plan = planner.plan(todo, {n: costs[n] for n in todo.nodes}, models, budget, self.cost,
                            self.ledger.residency(), context=self.planning)
        if run.cuts is not None:
            run.cuts.step = 0
        return dataclasses.replace(prep, plan=plan)

    def _short_failure(self, short: _Short, run: RunState, message: str) -> NodeExecutionError:
        return NodeExecutionError(short.node, short.class_type, message, short.exception_type, short.traceback,
                                  short.inputs, run.prompt_id, run.done())

    def _keep(self, run: RunState) -> None:
        """The output cache after a run: every node of this prompt that has its outputs (cached or finished), its
        outputs and ui under its signature, in the order the run had them; outputs of earlier prompts that this one
        does not share are dropped (graph/engine/cache.py: within the cache's bounds)."""
        sigs = run.prep.signatures
        self.cache.keep({sigs[n]: CacheEntry(out, run.ui.get(n)) for n, out in run.values.items() if n in sigs})

    def prepare_queue(self, prompts: list[dict], extra_pnginfo: list[dict | None] | None = None,
                      outputs: list[list[str] | None] | None = None) -> tuple[Prepared, queue.Merged]:
        """Several prompts merged into one graph (see workflow/queue.py) and planned at once; `outputs` limits each
        prompt's output nodes (None: all). Output nodes get their own prompt and pnginfo as hidden inputs, so each
        saved PNG carries its own prompt."""
        extras = extra_pnginfo or [None] * len(prompts)
        wanted = outputs or [None] * len(prompts)
        parts = [p if o is None else queue.needed(p, o) for p, o in zip(prompts, wanted, strict=True)]
        merged = queue.merge(parts, frozenset(k for k, c in self.nodes.items() if getattr(c, "OUTPUT_NODE", False)))
        prep = self.prepare(merged.prompt)
        hidden = {new: (prompts[i], extras[i]) for i, rename in enumerate(merged.members) for new in rename.values()
                  if prep.prompt.get(new, {}).get("class_type") in self.nodes
                  and getattr(self.nodes[prep.prompt[new]["class_type"]], "OUTPUT_NODE", False)}
        return dataclasses.replace(prep, hidden=hidden), merged

    def run_queue(self, prompts: list[dict], *, extra_pnginfo: list[dict | None] | None = None,
                  events: Events = _quiet) -> tuple[RunResult, list[list[Path]]]:
        """Run several prompts planned as one graph; returns the run and each prompt's images."""
        prep, merged = self.prepare_queue(prompts, extra_pnginfo)
        result = self.run(prep, events=events)
        images = []
        for rename in merged.members:
            mine = []
            for new in dict.fromkeys(rename.values()):
                mine += self._image_paths(result.ui.get(new))
            images.append(mine)
        return result, images

    def _image_paths(self, ui: dict | None) -> list[Path]:
        """The files an output node's ComfyUI `ui` entry names, in the output or temp folder."""
        out = []
        for im in (ui or {}).get("images", []):
            root = self.folders.output if im.get("type") == "output" else self.folders.temp
            out.append(root / im.get("subfolder", "") / im["filename"])
        return out

    def _release(self) -> None:
        """Return the activations' cached blocks, so the next encode and sampling find the GPU as planned."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _step(self, run: RunState, i: int, ps: planner.PlannedStep) -> None:
        prep, result, events, step = run.prep, run.result, run.events, ps.step
        if isinstance(step, planner.Load):
            short = None
            user = next((s.step.node for s in prep.plan.steps[i:] if isinstance(s.step, planner.Run)), "")
            cls = prep.prompt.get(user, {}).get("class_type", "")
            key = f"load {step.model}"
            if self.probe is not None and f"check {key}" not in run.retried \
                    and self.live_budget()[0].gpu < max(s.gpu_bytes for s in prep.plan.steps[i:]):
                raise _Short(user, cls, f"check {key}")  # the rest no longer fits: planned again first (once a load)
            try:
                self.ledger.load(step.model, step.source, pin=step.pin)
            except torch.OutOfMemoryError as e:  # taken by another process since the check: planned again
                short = _Short(user, cls, key, f"loading {self.ledger.entries[step.model].info.label} "
                               f"failed: {e}", _type_name(type(e)), traceback.format_exception(e), {},
                               self.ledger.entries[step.model].info.nbytes, 0)
            except Exception as e:  # a damaged file, no host memory left: the loader node that named it failed
                node = next((n for n, out in run.values.items()
                             if any(isinstance(v, ModelHandle) and v.key == step.model for v in out)), None)
                if node is None:
                    raise
                raise self._failure(node, prep.prompt[node]["class_type"], f"loading its model failed: {e}", e,
                                    prep.prompt[node]["inputs"], run) from e
            if short is not None:
                raise short
            result.loads += 1
            later = (s.step for s in prep.plan.steps[i + 1:] if isinstance(s.step, planner.Load))
            ahead = next((s for s in later if s.source == "file" and s.pin), None)
            if ahead is not None:  # read the next model's file while this one computes
                self.ledger.pin(ahead.model)
            events("vg_step", {"step": i, "kind": "load", "model": step.model, "source": step.source})
        elif isinstance(step, planner.Unload):
            self.ledger.unload(step.model, step.to)
            result.unloads += 1
            self._release()
            events("vg_step", {"step": i, "kind": "unload", "model": step.model, "to": step.to})
        else:
            cuts = run.cuts
            if cuts is not None:
                cuts.step = i
                cuts.apply(run, None)
                if step.node in cuts.dropped:  # only cancelled outputs needed it
                    return
            try:
                self.check_interrupted(step.node, prep.prompt[step.node]["class_type"], run)
                report = self._run_node(run, step.node, step.variant, ps)
            except _Dropped:  # stopped while it ran: nothing it made is kept
                self._release()
                return
            if run.exchange is not None:
                run.exchange.put(step.node, CacheEntry(run.values[step.node], run.ui.get(step.node)))
            result.nodes.append(report)
            ui = run.ui.get(step.node)
            if ui is not None:
                result.ui[step.node] = ui
                result.images += self._image_paths(ui)

    def _inputs(self, run: RunState, node: str) -> dict[str, Any]:
        prompt = run.prep.prompt
        cls = self.nodes[prompt[node]["class_type"]]
        out = {}
        for name, v in prompt[node]["inputs"].items():
            out[name] = self._value(run, v[0])[v[1]] if is_link(v) else v
        return inputs_with_defaults(cls, out, self.folders)

    def _value(self, run: RunState, node: str) -> tuple:
        """A node's outputs: this run's, else (a lane of a placed prompt) the other lane's, once it has them."""
        if node not in run.values and run.exchange is not None:
            self._take(run, node, run.exchange.get(node))
        return run.values[node]

    def _seed(self, run: RunState, node: str) -> int | None:
        prompt = run.prep.prompt
        found = seed_source(run.prep.dag, prompt, node)
        if found is None:
            return None
        v = prompt[found[0]]["inputs"][found[1]]
        return self._value(run, v[0])[v[1]] if is_link(v) else v

    def _failure(self, node: str, class_type: str, message: str, e: Exception, inputs: Mapping[str, Any],
                 run: RunState) -> NodeExecutionError:
        """ComfyUI's execution_error for `node`: its plain inputs shown as lists, the nodes done before it."""
        shown = {k: [v] for k, v in inputs.items() if isinstance(v, int | float | str | bool)}
        return NodeExecutionError(node, class_type, message, _type_name(type(e)), traceback.format_exception(e),
                                  shown, run.prompt_id, run.done())

    def _run_node(self, run: RunState, node: str, variant: str, ps: planner.PlannedStep) -> NodeReport:
        prep, events = run.prep, run.events
        class_type = prep.prompt[node]["class_type"]
        cls = self.nodes[class_type]
        events("executing", {"node": node, "display_node": node, "prompt_id": run.prompt_id})
        inputs = self._inputs(run, node)
        chosen = next((o for o in prep.costs[node].variants if o.name == variant), None)
        ctx = NodeContext(self, node, class_type, variant, self._seed(run, node), run, chosen, ps.blocks)
        own_prompt, own_extra = prep.hidden.get(node, (prep.prompt, run.extra_pnginfo))
        hidden = {"PROMPT": own_prompt, "EXTRA_PNGINFO": own_extra, "UNIQUE_ID": node, "VG_CONTEXT": ctx}
        for name, kind in cls.INPUT_TYPES(folders=self.folders).get("hidden", {}).items():
            if kind in hidden:
                inputs[name] = hidden[kind]
        # (a streamed node's kept part, reused, was allocated before its peak is measured from)
        predicted = ps.blocks.gpu_bytes - ps.blocks.reused if ps.blocks is not None \
            else chosen.activation if chosen is not None else 0
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            self._fold_peaks()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        short = None
        try:
            out = getattr(cls(), cls.FUNCTION)(**inputs)
        except InterruptedRun:
            raise
        except Exception as e:
            hint = ""
            used = (torch.cuda.max_memory_allocated() - base if cuda else 0) + _tried(str(e))
            if isinstance(e, torch.OutOfMemoryError) and used <= predicted:  # not ours: other processes took it
                shown = {k: [v] for k, v in inputs.items() if isinstance(v, int | float | str | bool)}
                short = _Short(node, class_type, node, f"{e}", _type_name(type(e)), traceback.format_exception(e),
                               shown, predicted, used)
            elif isinstance(e, torch.OutOfMemoryError):  # our own peak passed the estimate
                hint = (f"; the plan predicted {predicted / 2**30:.2f} GiB for this node within a "
                        f"{self.budget.gpu / 2**30:.2f} GiB budget, so its estimate is wrong: please report it, "
                        "and meanwhile lower the size or pass a smaller --vram")
            if short is None:
                raise self._failure(node, class_type, f"{e}{hint}", e, inputs, run) from e
        if short is not None:  # raised here, the failure's frames (and their tensors) are gone
            raise short
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        measured = torch.cuda.max_memory_allocated() - base if cuda else 0
        if isinstance(out, dict):
            if out.get("ui") is not None:
                run.ui[node] = out["ui"]
            out = tuple(out.get("result", ()))
        run.values[node] = tuple(out)
        report = NodeReport(node, class_type, variant, seconds, predicted, measured)
        over = estimate_exceeded(report)
        if over is not None:  # the plan was optimistic here: say so (before "executed" ends the node for listeners)
            log.warning("node %s (%s, %s) peaked at %.3f GiB on the GPU, above its estimate of %.3f GiB; please "
                        "report it", node, class_type, variant, measured / 2**30, predicted / 2**30)
            events("vg_estimate_exceeded", {**over, "prompt_id": run.prompt_id})
        events("executed", {"node": node, "output": run.ui.get(node), "seconds": seconds,
                            "predicted_bytes": predicted, "measured_bytes": measured})
        return report


def _models_in(outputs: Any) -> set[str]:
    keys = set()
    for out in outputs:
        for v in out:
            if isinstance(v, ModelHandle):
                keys.add(v.key)
    return keys
