"""The Python API: a pipeline that loads once and keeps its models across calls.

    from vramgraph import Pipeline

    pipe = Pipeline(models="~/ComfyUI/models", vram="12GiB")     # or Pipeline.demo() for tiny random weights
    fox = pipe.generate("a red fox", seed=7, width=768, height=512)
    fox.images[0].save("fox.png"); fox.seed                        # PIL images; the seed that was used
    many = pipe.generate(["a boat", "a lighthouse"])               # planned as one queue: one load per model
    out = pipe.run("workflows/edit.json", set={"Prompt.text": "make it blue"})
    out.images["8"], out.files["8"]                                # per output node: PIL images, PNG paths
    plan = pipe.plan("workflows/text_to_image.json", vram="8GiB", size="1536x1536")   # loads no weights

The same settings, budget (graph/engine/budget.py), planner and errors as the command line, which is a thin layer
over this module: a workflow that does not validate raises `ValidationFailed` (ComfyUI's /prompt answer in
`.response`), one that does not fit raises `PlanError`, a failing node `NodeExecutionError`, an impossible
argument `ValueError` naming it and its allowed range. Nothing is printed; `progress=True` draws a progress bar
per node (`progress=callable` gets api.progress.Progress records instead), and `events=` receives the
engine's events (ComfyUI's websocket message types).
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import secrets
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..graph.engine.runtime import (
    Settings,
    engine_from,
    folders_from,
    parse_device,
    prepare_demo,
    read_config,
    settings_of,
)
from ..graph.workflow.roles import build_prompt

WORKFLOWS = Path(__file__).parent.parent / "workflows"
DEFAULT_FILES = {"transformer": "flux-2-klein-4b.safetensors", "text_encoder": "qwen_3_4b.safetensors",
                 "vae": "flux2-vae.safetensors"}
Events = Callable[[str, dict], None]
Progress = bool | Callable[[Any], None] | None  # True: a bar per node; a callable: api.progress.Progress records
log = logging.getLogger("vramgraph")
SIZE_NODES = ("EmptyFlux2LatentImage", "VGEmptyLatent", "Flux2Scheduler")


@dataclass
class Generated:
    """One prompt's pictures: PIL images (with the PNG's text chunks in `.info`), their files, the seed used."""

    text: str
    seed: int
    images: list[Any]
    paths: list[Path]
    prompt: dict  # the API-format prompt that ran


@dataclass
class Outputs:
    """A workflow's outputs: per output node id its images (PIL) and files."""

    images: dict[str, list[Any]] = field(default_factory=dict)
    files: dict[str, list[Path]] = field(default_factory=dict)
    result: Any = None  # graph.engine.executor.RunResult: the plan, per-node times and peaks

    @property
    def paths(self) -> list[Path]:
        return [p for files in self.files.values() for p in files]


# ------------------------------------------------------------------------------------------ workflows

def load(workflow: str | Path | Mapping[str, Any], set: Mapping[str, Any] | None = None, *,
         prefix: str = "set ") -> Any:
    """A workflow (graph.workflow.parse.Workflow) from a file, a shipped workflow's name, or a dict (API or UI format),
    with `set` applied: {"NODE.INPUT": value}, NODE an id or a node title."""
    from ..graph.workflow.parse import load_workflow

    if not isinstance(workflow, Mapping):
        path = Path(workflow).expanduser()
        if not path.exists() and (WORKFLOWS / path.name).exists():
            path = WORKFLOWS / path.name
        workflow = path
    wf = load_workflow(workflow)
    targets = set_inputs(wf.prompt, set or {}, prefix=prefix)
    if targets and wf.ui is not None:  # the PNGs' workflow chunk holds the values that ran (workflow/uiedit.py)
        from ..graph.workflow.uiedit import ui_with_sets
        from ..nodes import ENGINE_NODES

        ui, why = ui_with_sets(wf.ui, targets, ENGINE_NODES)
        if ui is None:
            log.warning("%s: the PNGs will carry no 'workflow' chunk, only the 'prompt' chunk with the values used "
                        "(ComfyUI opens that too): %s", wf.source, why)
        wf = replace(wf, ui=ui)
    return wf


def apply_sets(prompt: dict, sets: Mapping[str, Any], *, prefix: str = "set ") -> dict:
    """Set inputs: each key is NODE.INPUT, NODE an id or a node title (`_meta.title`)."""
    set_inputs(prompt, sets, prefix=prefix)
    return prompt


@dataclass(frozen=True)
class Typed:
    """A `set` value as typed on a command line: it becomes the input's type when the input is known (text for a
    STRING input or a list of names, so `Prompt.text=1984` stays "1984"), else JSON when it parses (7, 1.5, true),
    else the text."""

    text: str

    def value(self, declared: Any) -> Any:
        kind = declared[0] if isinstance(declared, tuple | list) and declared else None
        if kind == "STRING" or (isinstance(kind, list) and self.text in kind):
            return self.text
        try:
            return json.loads(self.text)
        except ValueError:
            return self.text


def _declared_inputs(class_type: str) -> dict[str, Any] | None:
    """A node class's declared inputs by name (None: a class we do not know, or whose inputs cannot be listed)."""
    from ..nodes import ENGINE_NODES

    cls = ENGINE_NODES.get(class_type)
    try:
        spec = cls.INPUT_TYPES() if cls is not None else None
    except Exception:  # a class whose INPUT_TYPES needs its runtime: nothing to check against
        return None
    return None if spec is None else {**spec.get("required", {}), **spec.get("optional", {})}


def _closest(word: str, names: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, list(names), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def set_inputs(prompt: dict, sets: Mapping[str, Any], *, prefix: str = "set ") -> list[tuple[str, str, Any]]:
    """`apply_sets`, returning what was set as (node id, input, value). A node that is not there, or an input its
    class does not declare, is refused naming the closest one (a typo would otherwise set nothing)."""
    done = []
    for target, value in sets.items():
        node, dot, name = str(target).rpartition(".")
        shown = value.text if isinstance(value, Typed) else value
        what = f"{prefix}{target}={shown}"
        if not dot or not node or not name:
            raise ValueError(f"{what}: write NODE.INPUT=VALUE, e.g. 6.seed=7 or Sampler.seed=7")
        ids = [node] if node in prompt else [i for i, n in prompt.items()
                                            if n.get("_meta", {}).get("title") == node]
        if len(ids) != 1:
            titles = [str(n.get("_meta", {}).get("title")) for n in prompt.values() if n.get("_meta", {}).get("title")]
            raise ValueError(f"{what}: no node with id or title '{node}'{_closest(node, [*titles, *prompt])}" if not ids
                             else f"{what}: several nodes are titled '{node}' ({', '.join(ids)}); use the id")
        declared = _declared_inputs(str(prompt[ids[0]].get("class_type")))
        if declared is not None and name not in declared and name not in prompt[ids[0]].get("inputs", {}):
            raise ValueError(f"{what}: node {node} ({prompt[ids[0]]['class_type']}) has no input '{name}'"
                             f"{_closest(name, list(declared))}")
        if isinstance(value, Typed):
            value = value.value((declared or {}).get(name))
        prompt[ids[0]].setdefault("inputs", {})[name] = value
        done.append((ids[0], name, value))
    return done


def parse_size(size: str | tuple[int, int], option: str = "size") -> tuple[int, int]:
    if isinstance(size, str):
        w, _, h = size.lower().partition("x")
        if not (w.strip().isdigit() and h.strip().isdigit()):
            raise ValueError(f"{option} {size}: write WxH, e.g. 1536x1536")
        return int(w), int(h)
    w, h = size
    return int(w), int(h)


def resize(prompt: dict, width: int, height: int) -> None:
    """Every latent/scheduler size of `prompt` (and ComfyUI templates' Width/Height primitives) set to WxH."""
    for node in prompt.values():
        inputs = node.get("inputs", {})
        if node.get("class_type") in SIZE_NODES:
            for name, v in (("width", width), ("height", height)):
                if name in inputs and not isinstance(inputs[name], list):
                    inputs[name] = v
        title = str(node.get("_meta", {}).get("title", "")).lower()  # ComfyUI's templates title them "Width"
        if node.get("class_type") in ("PrimitiveInt",) and title in ("width", "height"):
            inputs["value"] = width if title == "width" else height


# ------------------------------------------------------------------------------------------ arguments

def _declared(class_type: str, name: str) -> dict:
    from ..nodes import ENGINE_NODES

    spec = ENGINE_NODES[class_type].INPUT_TYPES()
    return {**spec.get("required", {}), **spec.get("optional", {})}[name][1]


def check_generate(*, width: int, height: int, steps: int | None, guidance: float | None, seed: int | None,
                   spell: Mapping[str, str] | None = None) -> None:
    """Refuse impossible values (never change them): ranges are the nodes' own (VGEmptyLatent, VGSampler)."""
    spell = spell or {}

    def say(name: str, value: Any, rule: str) -> ValueError:
        label = spell.get(name, name)
        return ValueError(f"{label} {value}: {rule}" if name in spell else f"{label}={value!r}: {rule}")

    for name, value in (("width", width), ("height", height)):
        opts = _declared("VGEmptyLatent", name)
        lo, hi, step = opts["min"], opts["max"], opts.get("step", 16)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi or value % step:
            raise say(name, value, f"must be a multiple of {step} from {lo} to {hi}")
    for name, value, kind in (("steps", steps, int), ("guidance", guidance, float), ("seed", seed, int)):
        if value is None:
            continue
        opts = _declared("VGSampler", name)
        number = isinstance(value, int | float) and not isinstance(value, bool) and value == value
        if not number or (kind is int and not isinstance(value, int)) or not opts["min"] <= value <= opts["max"]:
            whole = "a whole number " if kind is int else "a number "
            raise say(name, value, f"must be {whole}from {opts['min']} to {opts['max']}")


def _png_bytes(image: Any, label: str) -> bytes:
    from PIL import Image

    try:
        if isinstance(image, str | Path):
            with Image.open(Path(image).expanduser()) as im:
                im.load()
                image = im.convert("RGB") if im.mode not in ("RGB", "RGBA", "L") else im.copy()
        elif not isinstance(image, Image.Image):
            raise ValueError(f"{label}: give a PIL image or the path of an image file, not {type(image).__name__}")
    except OSError as e:
        raise ValueError(f"{label}: not a readable image ({e})") from e
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ the pipeline

class Pipeline:
    """Settings made into an engine once; models stay loaded across `generate` and `run` calls.

    `models` is a ComfyUI models folder (or several); the other arguments are the command line's options of
    the same names. `checkpoint` is a whole-model folder: a name from the checkpoints list of the models
    folders, or a path (its parent becomes a checkpoint root). `transformer`, `text_encoder`, `vae` name the
    files `generate` loads when no checkpoint is given.
    """

    def __init__(self, models: str | Path | Sequence[str | Path] | None = None, *, vram: str | int | None = None,
                 reserve: str | int | None = None, device: str | None = None, dtype: str | None = None,
                 input: str | Path | None = None, output: str | Path | None = None, config: str | Path | None = None,
                 host: str | int | None = None, checkpoint: str | Path | None = None, profile: str | None = None,
                 devices: str | None = None,
                 transformer: str = DEFAULT_FILES["transformer"], text_encoder: str = DEFAULT_FILES["text_encoder"],
                 vae: str = DEFAULT_FILES["vae"], settings: Settings | Any = None) -> None:
        base = settings_of(settings) if settings is not None else Settings()
        given = {"models": models, "vram": vram, "reserve": reserve, "device": device, "dtype": dtype,
                 "input": input, "output": output, "config": config, "host": host, "profile": profile,
                 "devices": devices}
        s = base.replace(**{k: v for k, v in given.items() if v is not None})
        self.checkpoint: str | None = None
        if checkpoint is not None:
            path = Path(checkpoint).expanduser()
            if path.is_dir():  # a path: its parent is one more checkpoint root, for this pipeline only
                s = s.replace(checkpoints=(*s.checkpoints, path.resolve().parent))
                self.checkpoint = path.resolve().name
            elif path.is_absolute() or str(checkpoint).startswith((".", "~")) or path.exists():
                raise ValueError(f"checkpoint {checkpoint}: no such folder (give a model folder, or the name of "
                                 "one in the checkpoints list of the models folders)")
            else:
                self.checkpoint = str(checkpoint)
        from ..nodes.catalog import FOLDERS
        from ..nodes.modelpaths import file_or_name

        self.files = {}
        for kind, value in (("transformer", transformer), ("text_encoder", text_encoder), ("vae", vae)):
            self.files[kind], extra = file_or_name(FOLDERS[kind], value)
            s = s.replace(extra_folders=(*s.extra_folders, extra)) if extra is not None else s
        self.settings = s
        self.folders = folders_from(s)
        if s.device is not None:  # a wrong device or size is refused now, not at the first image
            parse_device(s.device)
        if s.profile is not None:
            from ..graph.engine.costs import profile as named

            named(s.profile)
        from ..graph.engine.budget import parse_size as size_of

        for name in ("vram", "reserve", "host"):
            value = getattr(s, name)
            try:
                for part in (str(value).split(",") if name == "vram" and s.devices and value is not None else
                             [value] if value is not None else []):
                    size_of(part)
            except ValueError as e:
                raise ValueError(f"--{name} {value}: {e}" if settings is not None else f"{name}={value!r}: {e}") \
                    from None
        self._engine: Any = None
        self._planners: dict[Any, Any] = {}
        self.previews = False  # step previews as "preview" events

    @classmethod
    def demo(cls, folder: str | Path = "vramgraph-demo", **kw: Any) -> Pipeline:
        """A pipeline on tiny random-weight models written to `folder/models` (with the shipped workflows' input
        images in `folder/input`, outputs in `folder/output`): the whole path on any machine, pictures of noise."""
        models, inputs = prepare_demo(folder)
        kw.setdefault("output", Path(folder) / "output")
        return cls(models=models, input=kw.pop("input", inputs), **kw)

    @property
    def engine(self) -> Any:
        """The running engine (graph.engine.executor.Engine), made on first use."""
        if self._engine is None:
            self._engine = engine_from(self.settings)
        self._engine.previews = self.previews
        return self._engine

    # -- generate
    def generate(self, prompt: str | Sequence[str], *, seed: int | None = None, width: int = 1024,
                 height: int = 1024, steps: int | None = None, guidance: float | None = None,
                 negative: str | None = None, images: Sequence[Any] = (), events: Events | None = None,
                 progress: Progress = None, spell: Mapping[str, str] | None = None,
                 loras: Sequence[str | Path | tuple[str | Path, float]] = ()) -> Generated | list[Generated]:
        """Text to image (edit with `images`: PIL images or paths), with the shipped workflows. Several prompts
        are planned as one queue; seeds count up from `seed` (random when None). Returns one Generated per
        prompt (a list for a list). `progress`: True draws a progress bar per node; a callable gets each step as a
        api.progress.Progress (node, class_type, title, value, total). `loras`: LoRA files (paths, or names in the
        loras folder of the models folders), each alone (strength 1) or as (file, strength), applied to the model
        and the text encoder in this order."""
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise ValueError("give a prompt: a non-empty string, or a list of them")
        check_generate(width=width, height=height, steps=steps, guidance=guidance, seed=seed, spell=spell)
        if negative is not None and not isinstance(negative, str):
            raise ValueError(f"negative={negative!r}: give a string")
        refs = self._references(images, (spell or {}).get("images", "image"))
        base = secrets.randbelow(2**32) if seed is None else seed
        names = {"checkpoint": self.checkpoint} if self.checkpoint else dict(self.files)
        chain = self.resolve_loras(loras, (spell or {}).get("loras", "loras"))
        prompts = [build_prompt(t, width=width, height=height, seed=base + i, steps=steps, guidance=guidance,
                                negative=negative, references=refs, loras=chain, **names)
                   for i, t in enumerate(texts)]
        outs = self._run_prompts(prompts, [None] * len(prompts), events, progress)
        made = [Generated(t, base + i, [im for ims in o.images.values() for im in ims], o.paths, p)
                for i, (t, p, o) in enumerate(zip(texts, prompts, outs, strict=True))]
        return made[0] if isinstance(prompt, str) else made

    def resolve_loras(self, loras: Sequence[Any], label: str) -> tuple[tuple[str, float], ...]:
        """(name in the loras list, strength) of each LoRA; a path's folder becomes one more LoRA folder."""
        import math

        if isinstance(loras, str | Path):
            loras = [loras]
        out = []
        for item in loras:
            file, strength = (item if isinstance(item, tuple) and len(item) == 2 else (item, 1.0))
            if isinstance(strength, bool) or not isinstance(strength, int | float) or not math.isfinite(strength):
                raise ValueError(f"{label}: the strength of {file} must be a finite number (got {strength!r})")
            path = Path(file).expanduser()
            if path.is_file():
                root = path.resolve().parent
                if root not in self.folders.loras:
                    self._add_lora_folder(root)
                out.append((path.name, float(strength)))
            elif path.is_absolute() or str(file).startswith((".", "~")):
                raise ValueError(f"{label}: {file}: no such file")
            else:
                out.append((str(file), float(strength)))
        return tuple(out)

    def _add_lora_folder(self, root: Path) -> None:
        self.settings = self.settings.replace(loras=(*self.settings.loras, root))
        self.folders = replace(self.folders, loras=(*self.folders.loras, root))
        if self._engine is not None:  # the running engine keeps its models; only where LoRAs are looked up grows
            for holder in (self._engine, getattr(self._engine, "catalog", None)):
                if holder is not None and getattr(holder, "folders", None) is not None:
                    holder.folders = replace(holder.folders, loras=self.folders.loras)

    def _references(self, images: Sequence[Any], label: str) -> tuple[str, ...]:
        """Reference images reach the workflow through the input folder, under names made of their content."""
        if isinstance(images, str | Path) or not isinstance(images, Sequence):
            images = [images]
        names = []
        for i, image in enumerate(images):
            data = _png_bytes(image, f"{label} {image}" if isinstance(image, str | Path) else f"{label} {i + 1}")
            name = f"vramgraph-ref-{hashlib.sha1(data).hexdigest()[:16]}.png"
            target = self.folders.input / name
            if not target.is_file():
                self.folders.input.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            names.append(name)
        return tuple(names)

    # -- workflows
    def run(self, workflow: str | Path | Mapping[str, Any] | Sequence[str | Path | Mapping[str, Any]], *,
            set: Mapping[str, Any] | None = None, events: Events | None = None, progress: Progress = None
            ) -> Outputs | list[Outputs]:
        """Run a workflow (a file, a shipped workflow's name, or a dict in API or UI format) with `set` applied;
        several (a list) are planned as one queue. Returns the Outputs (a list for a list). `progress` as for
        `generate`."""
        several = isinstance(workflow, list | tuple)
        wfs = [load(w, set) for w in (workflow if several else [workflow])]
        outs = self._run_prompts([wf.prompt for wf in wfs],
                                 [{"workflow": wf.ui} if wf.ui is not None else None for wf in wfs], events,
                                 progress)
        return outs if several else outs[0]

    def _run_prompts(self, prompts: list[dict], extras: list[dict | None], events: Events | None,
                     progress: Progress = None) -> list[Outputs]:
        from .progress import with_progress

        engine = self.engine

        def prepare() -> tuple[Any, list[dict[str, str]]]:
            if len(prompts) == 1:
                return engine.prepare(prompts[0]), [{n: n for n in prompts[0]}]
            prep, merged = engine.prepare_queue(prompts, extras)
            return prep, merged.members

        prep, members = prepare()
        if any(getattr(engine.nodes[prep.prompt[n]["class_type"]], "OUTPUT_NODE", False) for n in prep.cached):
            # the very same prompt again: its outputs were made by an earlier call (their files may have moved
            # since), so forget the cached outputs (the models stay loaded) and make them again
            engine.free(unload_models=False, free_memory=True)
            prep, members = prepare()
        result = engine.run(prep, extra_pnginfo=extras[0] if len(prompts) == 1 else None,
                            events=with_progress(events, progress, prep.prompt))
        outs = []
        for rename in members:
            out = Outputs(result=result)
            for old, new in rename.items():
                files = self._files(result.ui.get(new))
                if new in result.ui:
                    out.files[old] = files
                    out.images[old] = [_open(p) for p in files]
            outs.append(out)
        return outs

    def _files(self, ui: Mapping | None) -> list[Path]:
        folders = self.engine.folders
        return [(folders.output if im.get("type") == "output" else folders.temp) / im.get("subfolder", "")
                / im["filename"] for im in (ui or {}).get("images", [])]

    def validate(self, workflow: str | Path | Mapping[str, Any], *, set: Mapping[str, Any] | None = None) -> Any:
        """Validate without running (graph.workflow.validate's result: `.ok`, `.response()` as ComfyUI's /prompt)."""
        from ..graph.workflow.validate import validate
        from ..nodes import ENGINE_NODES

        return validate(load(workflow, set).prompt, ENGINE_NODES, self.folders)

    def plan(self, workflow: str | Path | Mapping[str, Any] | Sequence[str | Path | Mapping[str, Any]], *,
             vram: str | int | None = None, size: str | tuple[int, int] | None = None,
             set: Mapping[str, Any] | None = None, prompts: int = 1) -> Any:
        """The memory plan (graph.plan.planner.Plan) of a workflow, without loading any weight: files that are
        present give their real sizes, absent ones the built-in klein sizes. `vram` plans for another card
        (default: this pipeline's budget); `size` ("WxH") sets every latent size. Several workflows (a list), or
        `prompts` > 1 (each workflow queued that many times, with seeds counting up and texts told apart), are
        planned as one queue, as `run` plans them. Models this pipeline holds do not count: the plan starts from
        an empty GPU."""
        return self.planned(workflow, vram=vram, size=size, set=set, prompts=prompts)[0].plan

    def planned(self, workflow: str | Path | Mapping[str, Any] | Sequence[str | Path | Mapping[str, Any]], *,
                vram: str | int | None = None, size: str | tuple[int, int] | None = None,
                set: Mapping[str, Any] | None = None, prompts: int = 1) -> tuple[Any, Any]:
        """`plan`'s work in full: the prepared prompt (engine.planning.Prepared: the prompt as planned, its costs and
        the plan) and the budget it was planned for (what the plan picture's title names)."""
        if isinstance(prompts, bool) or not isinstance(prompts, int) or prompts < 1:
            raise ValueError(f"prompts={prompts!r}: give a whole number of prompts, 1 or more")
        wfs = [load(w, set) for w in (workflow if isinstance(workflow, list | tuple) else [workflow])]
        queue = []
        for wf in wfs:
            if size is not None:
                resize(wf.prompt, *parse_size(size))
            queue += [queued_copy(wf.prompt, i) for i in range(prompts)]
        planning = self._planner(vram)
        with tempfile.TemporaryDirectory() as tmp:  # input images that are not here: planned at the size inferred
            from ..nodes.catalog import ModelCatalog
            from ..nodes.standins import stand_ins

            folders, notes = stand_ins(queue, planning.nodes, planning.folders, Path(tmp))
            for note in notes:
                log.warning("%s", note)
            if notes:
                planning = replace(planning, folders=folders,
                                   catalog=ModelCatalog(folders, planning.catalog.dtype, allow_builtin=True))
            if len(queue) == 1:
                return planning.prepare(queue[0]), planning.budget
            from ..graph.workflow.queue import merge

            outputs = frozenset(k for k, c in planning.nodes.items() if getattr(c, "OUTPUT_NODE", False))
            return planning.prepare(merge(queue, outputs).prompt), planning.budget

    def placed(self, workflow: str | Path | Mapping[str, Any] | Sequence[str | Path | Mapping[str, Any]], *,
               size: str | tuple[int, int] | None = None, set: Mapping[str, Any] | None = None, prompts: int = 1
               ) -> tuple[Any, Any, dict[str, int | None]]:
        """The placement (graph.plan.placement.Placement) of a workflow (or a queue, as `planned` makes it) on this
        pipeline's `devices`, without loading any weight; with a size in --vram per device, for cards of those
        sizes (no GPU needed). Returns the prepared prompt, the placement and each device's card size."""
        from ..graph.engine.budget import budget_for
        from ..graph.plan import placement
        from ..graph.workflow import estimate

        s = self.settings
        if not s.devices:
            raise ValueError("placed() needs devices, e.g. Pipeline(devices='cuda:0,cuda:1')")
        vram = s.vram if s.vram is not None else _config_value(s, "vram")
        if vram is not None:  # cards of these sizes: the names need not exist here
            names = placement.parse_devices(s.devices, None) if s.devices != "all" else ["cuda:0"]
        else:
            import torch

            names = placement.parse_devices(s.devices, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        sizes = placement.split_sizes(None if vram is None else str(vram), len(names))
        reserve = s.reserve or _config_value(s, "reserve")
        budgets = {n: budget_for(n if v is None else None, v, reserve, s.host, cap=False)
                   for n, v in zip(names, sizes, strict=True)}
        prep, _ = self.planned(workflow, vram=sizes[0], size=size, set=set, prompts=prompts)
        node_costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
        placed = placement.place(prep.dag, node_costs, models, [placement.Device(n, b) for n, b in budgets.items()],
                                 outputs=prep.outputs, context=self._planner(sizes[0]).context)
        return prep, placed, {n: b.card for n, b in budgets.items()}

    def assumed(self, vram: str | int | None = None) -> str:
        """What `plan` assumes, in one line (graph.engine.budget.assumed): card or memory, reserve, costs."""
        from ..graph.engine.budget import assumed

        s, planning = self.settings, self._planner(vram)
        vram = vram if vram is not None else s.vram if s.vram is not None else _config_value(s, "vram")
        device = s.device if s.device is not None or vram is not None else parse_device(None)
        return assumed(planning.budget, planning.cost.name, device)

    def _planner(self, vram: str | int | None) -> Any:
        """A torch-free planning context (graph.engine.planning.Planning). Torch is imported only to measure a device:
        when one is named, or when no --vram says which card to plan for; with --vram and no device the plan
        is for a card of that size, as a process finds it before it holds any of it."""
        from ..graph.engine.budget import budget_for
        from ..graph.engine.costs import cost_for
        from ..graph.engine.planning import Planning
        from ..nodes.catalog import ModelCatalog

        s = self.settings
        vram = vram if vram is not None else s.vram
        if vram not in self._planners:
            cfg_vram = vram if vram is not None else _config_value(s, "vram")
            device = s.device if s.device is not None or cfg_vram is not None else parse_device(None)
            budget = budget_for(device, cfg_vram, s.reserve or _config_value(s, "reserve"), s.host, cap=False)
            # a plan is for the GPU, where the models run in bf16 (fp32 is only the CPU's run default)
            dtype = s.dtype or "bf16"
            self._planners[vram] = Planning(self.folders, ModelCatalog(self.folders, dtype, allow_builtin=True),
                                            budget, cost=cost_for(device, s.profile))
        return self._planners[vram]


def queued_copy(prompt: dict, i: int) -> dict:
    """The i-th prompt of a planned queue of one workflow: the same graph with its seeds counted up by i and, past
    the first, its prompt texts told apart (so that, as in a queue of real prompts, no encode or sample is shared)."""
    if i == 0:
        return prompt
    out = copy.deepcopy(prompt)
    for node in out.values():
        inputs = node.get("inputs", {})
        for key in ("seed", "noise_seed"):
            if isinstance(inputs.get(key), int) and not isinstance(inputs[key], bool):
                inputs[key] += i
        if isinstance(inputs.get("text"), str) and inputs["text"]:
            inputs["text"] = f"{inputs['text']} ({i + 1})"
    return out


def _config_value(s: Settings, key: str) -> Any:
    return read_config(s).get(key)


def _open(path: Path) -> Any:
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        copy = im.copy()
        copy.info = dict(im.info)
    return copy


__all__ = ["Generated", "Outputs", "Pipeline", "Typed", "apply_sets", "check_generate", "load", "resize"]
