"""Command line: run, validate and plan saved workflows; one-shot generation; inspect; the demo; the server.

    vramgraph run WORKFLOW.json [--models DIR] [--set NODE.INPUT=VALUE ...] [-o DIR]
    vramgraph validate WORKFLOW.json
    vramgraph plan WORKFLOW.json [WORKFLOW2.json ...] [--prompts N] [--vram 12GiB] [--size 1536x1536] [--json]
    vramgraph generate -p PROMPT [-W 1024 -H 1024 -S SEED --steps N --guidance G -i REF ...] [-o FILE]
    vramgraph inspect MODEL...      vramgraph demo      vramgraph session
    vramgraph fetch WORKFLOW|PNG ... [--model NAME] [--models DIR] [--dry-run]
    vramgraph serve [--host 127.0.0.1] [--port 8188] [--models DIR] [--vram 12GiB] [--broker amqp://...]
    vramgraph worker --broker amqp://... --models DIR [--vram 80GiB]

Every command is a thin layer over the Python API (api/pipeline.py). Models resolve under a ComfyUI-style
models folder (diffusion_models/ or unet/, text_encoders/ or clip/, vae/, checkpoints/) given by --models,
$VRAMGRAPH_MODELS, or "models" in a config file (--config, else ./vramgraph.json, else
~/.config/vramgraph/config.json); --demo uses tiny random-weight models instead. Errors are one line
on stderr (--json: ComfyUI's error JSON); exit codes: 1 invalid workflow or failed node, 2 bad option
or file, 3 does not fit the budget, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .. import __version__
from ..graph.engine.costs import PROFILES
from ..graph.engine.runtime import DEMO_FOLDER, Settings, folders_from, no_models_hint, prepare_demo
from ..graph.plan.planner import DEFAULT_RESERVE

log = logging.getLogger("vramgraph")
GENERATE_OPTIONS = {"width": "--width", "height": "--height", "steps": "--steps", "guidance": "--guidance",
                    "seed": "--seed", "images": "--image", "loras": "--lora"}


def _engine_args(p: argparse.ArgumentParser, outputs: bool = True, json_flag: bool = True) -> None:
    p.add_argument("--models", action="append", default=None,
                   help="a ComfyUI models folder, or ComfyUI's own folder (repeatable)")
    p.add_argument("--extra-model-paths-config", dest="extra_model_paths", action="extend", nargs="+", default=[],
                   metavar="YAML", help="ComfyUI's extra_model_paths.yaml (repeatable; the one in a ComfyUI root "
                                        "given to --models is read anyway)")
    p.add_argument("--demo", action="store_true",
                   help=f"tiny random-weight models and input images (written to ./{DEMO_FOLDER}) instead of --models")
    p.add_argument("--config", default=None, help="JSON config with models/input/output/vram/reserve")
    p.add_argument("--input", default=None, help="folder of input images (default ./input)")
    if outputs:
        p.add_argument("-o", "--output", default=None, help="output folder (default ./output)")
    p.add_argument("--vram", default=None, help="GPU budget as a card size, e.g. 12GiB (default: free memory)")
    p.add_argument("--reserve", default=None,
                   help=f"memory kept free below the budget (default {DEFAULT_RESERVE // 2**20}MiB)")
    p.add_argument("--profile", default=None, choices=sorted(PROFILES),
                   help="cost profile the plan predicts seconds with (default: probe the GPU; without one: h200)")
    p.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    p.add_argument("--devices", default=None, metavar="cuda:0,cuda:1|all",
                   help="several GPUs: the plan places the models on them (--vram then one size or one per device)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    if json_flag:
        p.add_argument("--json", action="store_true", help="errors as ComfyUI's full error JSON on stderr")


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker-secret-file", default=None, metavar="PATH",
                   help="the fleet's shared secret that signs every broker message (its first line; default: the "
                        "environment variable VRAMGRAPH_BROKER_SECRET); the same on every frontend and worker")
    p.add_argument("--max-batch", type=int, default=16, help="prompts of one model set planned as one run, at most")
    p.add_argument("--steal-after", type=float, default=30.0, metavar="SECONDS",
                   help="take prompts of a model set other workers hold once its queue has waited this long")
    p.add_argument("--grace", type=float, default=1.0, metavar="SECONDS",
                   help="a worker that holds models takes a set nobody holds only after its queue waited this long")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vramgraph", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"vramgraph {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a saved workflow (ComfyUI API or UI format)")
    r.add_argument("workflow", nargs="+", help="one workflow, or several: they are planned as one queue")
    r.add_argument("--preview", default=None, metavar="DIR", help="write a preview PNG of every sampling step")
    r.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE",
                   help="override an input; NODE is the id or the title (repeatable)")
    r.add_argument("--report", default=None, help="write the run report (plan, per-node peaks) as JSON")
    _engine_args(r)
    v = sub.add_parser("validate", help="check a workflow: exit 0, or one line per error and exit 1")
    v.add_argument("workflow")
    v.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE")
    _engine_args(v, outputs=False, json_flag=False)
    v.add_argument("--json", action="store_true", help="print ComfyUI's /prompt answer as JSON on stdout")
    p = sub.add_parser("plan", help="print the memory plan (no weights needed) and write its timeline SVG")
    p.add_argument("workflow", nargs="+", help="one workflow, or several: they are planned as one queue, as run does")
    p.add_argument("--prompts", type=int, default=1, metavar="N",
                   help="queue each workflow N times (seeds counted up, texts told apart), as N queued prompts")
    p.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE")
    p.add_argument("--size", default=None, help="WxH for every latent/scheduler size in the workflow")
    p.add_argument("--json", action="store_true", help="print the plan (and errors) as JSON")
    p.add_argument("--svg", default="plan.svg", help="timeline picture (default plan.svg; '' for none)")
    p.add_argument("--host", default=None, help="host RAM budget, e.g. 64GiB (default: available memory)")
    _engine_args(p, outputs=False, json_flag=False)
    g = sub.add_parser("generate", help="one-shot text to image or edit with the shipped workflows")
    g.add_argument("-p", "--prompt", action="append", default=[],
                   help="the prompt; repeat it to queue several (planned together: one load per model)")
    g.add_argument("--prompts", default=None, metavar="FILE",
                   help="a file of prompts, one per line, queued ('#' starts a comment line)")
    g.add_argument("--preview", default=None, metavar="DIR", help="write a preview PNG of every sampling step")
    g.add_argument("-n", "--negative", default=None, help="negative prompt (turns on guidance 4 if not given)")
    g.add_argument("-W", "--width", type=int, default=1024, help="a multiple of 16 (default 1024)")
    g.add_argument("-H", "--height", type=int, default=1024, help="a multiple of 16 (default 1024)")
    g.add_argument("-S", "--seed", type=int, default=None, help="default: a random seed (printed, and in the PNG)")
    g.add_argument("--steps", type=int, default=None, help="default 4 (distilled) or 50 (with --negative)")
    g.add_argument("--guidance", type=float, default=None, help="default 1 (distilled) or 4 (with --negative)")
    g.add_argument("-i", "--image", action="append", default=[], help="reference image for editing (repeatable)")
    g.add_argument("-o", "--out", default="vramgraph.png", help="PNG path (-1, -2, ... added for several prompts)")
    g.add_argument("--force", action="store_true", help="overwrite existing PNGs")
    g.add_argument("--checkpoint", default=None,
                   help="a whole-model folder (HF, or the three files): a path, or a name in <models>/checkpoints")
    g.add_argument("--transformer", default="flux-2-klein-4b.safetensors", metavar="FILE",
                   help="the transformer: a path, or a name in <models>/diffusion_models (default %(default)s)")
    g.add_argument("--text-encoder", default="qwen_3_4b.safetensors", metavar="FILE",
                   help="the text encoder: a path, or a name in <models>/text_encoders (default %(default)s)")
    g.add_argument("--vae", default="flux2-vae.safetensors", metavar="FILE",
                   help="the VAE: a path, or a name in <models>/vae (default %(default)s)")
    g.add_argument("--lora", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="a LoRA (a path, or a name in <models>/loras) on the model and text encoder, strength 1 "
                        "unless given (repeatable: chained in order)")
    _engine_args(g, outputs=False)
    i = sub.add_parser("inspect", help="recognise checkpoints and print their spec (reads headers only)")
    i.add_argument("models", nargs="+")
    i.add_argument("--json", action="store_true", help="errors as JSON")
    s = sub.add_parser("serve", help="a local server with ComfyUI's API and a page that shows the memory plan")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8188, help="port (default 8188, ComfyUI's; 0 for any free one)")
    s.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE",
                   help="a plugin whose setup(app, engine) adds routes (repeatable; bench/peer_routes.py)")
    s.add_argument("--previews", action="store_true",
                   help="step previews for every prompt (default: only for prompts whose extra_data asks, as ComfyUI)")
    s.add_argument("--front-end", default=None, metavar="comfyui|vramgraph|DIR",
                   help="the page at /: vramgraph (ours, the default; always also at /vramgraph/), comfyui (ComfyUI's "
                        "official front end: pip install 'vramgraph[frontend]') or a built front end's folder; "
                        "config key front_end (docs/frontend.md)")
    s.add_argument("--user-dir", default=None, metavar="DIR",
                   help="ComfyUI's user folder, where settings and saved workflows are kept (DIR/default/...); "
                        "default with --front-end comfyui: ./user; config key user_dir")
    s.add_argument("--enable-cors-header", nargs="?", const="*", default=None, metavar="ORIGIN",
                   help="allow requests from other sites (ORIGIN, default *), as ComfyUI's flag; by default pages of "
                        "other sites, foreign Host headers and cross-site websockets are refused")
    s.add_argument("--broker", default=None, metavar="AMQP_URL",
                   help="be a frontend of a fleet: validate and plan prompts for this card (--vram), publish them to "
                        "this RabbitMQ (amqp://user:pass@host:5672/); `vramgraph worker` runs them")
    s.add_argument("--frontend-id", default=None, help="this frontend's name on the broker (default: host-port)")
    s.add_argument("--work", action="store_true", help="with --broker: also run a worker in this process")
    s.add_argument("--handshake-wait", type=float, default=10.0, metavar="SECONDS",
                   help="with --broker: wait this long at start for a worker, and refuse to start when it writes its "
                        "images into an output folder this server cannot read")
    _fleet_args(s)
    _engine_args(s)
    w = sub.add_parser("worker", help="run prompts that `serve --broker` frontends published (model-aware)")
    w.add_argument("--broker", required=True, metavar="AMQP_URL", help="the RabbitMQ the frontends publish to")
    w.add_argument("--id", default=None, help="this worker's name in the fleet (default: host-random)")
    _fleet_args(w)
    _engine_args(w)
    ss = sub.add_parser("session", help="interactive: prompt lines in, images out, models kept (also: no command)")
    ss.add_argument("--checkpoint", default=None)
    ss.add_argument("-o", "--out-dir", default="output", help="where images are saved (!save DIR changes it)")
    _engine_args(ss, outputs=False)
    from .fetch import add_parser as fetch_parser

    fetch_parser(sub)
    d = sub.add_parser("demo", help="tiny random-weight models + the shipped workflows, end to end (any machine)")
    d.add_argument("--out", default=str(DEMO_FOLDER), help="folder for the tiny models, inputs and PNGs")
    d.add_argument("--json", action="store_true", help="errors as JSON")
    return ap


# ------------------------------------------------------------------------------------------ settings

def parse_sets(items: list[str]) -> dict[str, Any]:
    """--set NODE.INPUT=VALUE ...: VALUE becomes the input's type (api.pipeline.Typed: text for a text input, else JSON
    such as numbers and true, else text)."""
    from ..api.pipeline import Typed

    sets: dict[str, Any] = {}
    for item in items:
        target, sep, value = item.partition("=")
        if not sep or "." not in target:
            raise ValueError(f"--set {item}: write NODE.INPUT=VALUE, e.g. --set 6.seed=7")
        sets[target] = Typed(value)
    return sets


def _settings(args: argparse.Namespace) -> Settings:
    """The command's Settings; with --demo, the tiny models and the demo input folder (written on first use)."""
    models, inputs = getattr(args, "models", None), getattr(args, "input", None)
    if getattr(args, "demo", False):
        if models:
            raise ValueError("--demo uses its own tiny models: leave out --models")
        demo_models, demo_inputs = prepare_demo(DEMO_FOLDER)
        models, inputs = [str(demo_models)], inputs or str(demo_inputs)
        args.models, args.input = models, inputs  # the server reads them from args
        log.info("demo: tiny random-weight models in %s, so the pictures are noise", demo_models)
    return Settings(models=models, config=getattr(args, "config", None), input=inputs,
                    extra_model_paths=tuple(getattr(args, "extra_model_paths", None) or ()),
                    output=getattr(args, "output", None), vram=getattr(args, "vram", None),
                    reserve=getattr(args, "reserve", None), device=getattr(args, "device", None),
                    devices=getattr(args, "devices", None), dtype=getattr(args, "dtype", None),
                    profile=getattr(args, "profile", None))


def _pipeline(args: argparse.Namespace, **kw: Any) -> Any:
    from ..api.pipeline import Pipeline

    return Pipeline(settings=_settings(args), **kw)


# ------------------------------------------------------------------------------------------ commands

class _Bars:
    """The engine's events a command shows besides the progress bars (api.progress): model moves, step
    previews written to a folder."""

    def __init__(self, preview_dir: str | None = None) -> None:
        self.preview_dir = Path(preview_dir) if preview_dir else None

    def __call__(self, kind: str, data: dict) -> None:
        if kind == "vg_step":
            log.info("  %s %s", data["kind"], data["model"].split(":")[0])
        elif kind == "preview" and self.preview_dir is not None:
            self.preview_dir.mkdir(parents=True, exist_ok=True)
            name = f"{data['node'].replace(':', '_')}_{data['index']}_step{data['step']:03}.png"
            data["image"].save(self.preview_dir / name)


def _log_run(result: Any) -> None:
    log.info("%d nodes ran, %d cached; %d loads, %d unloads; %.2f s", len(result.nodes), len(result.cached),
             result.loads, result.unloads, result.seconds)


def _run(args: argparse.Namespace) -> int:
    pipe = _pipeline(args)
    pipe.previews = bool(args.preview)
    sets = parse_sets(args.set)
    from ..api.pipeline import load

    for w in args.workflow:  # a bad --set is the user's, before anything loads
        load(w, sets, prefix="--set ")
    outs = pipe.run([w for w in args.workflow], set=sets, events=_Bars(args.preview), progress=True)
    _log_run(outs[0].result)
    for out in outs:
        for p in out.paths:
            print(p)
    if args.report:
        Path(args.report).write_text(json.dumps(outs[0].result.to_json(), indent=1))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from ..api.pipeline import load
    from ..graph.workflow.errors import WorkflowError, validation_lines
    from ..graph.workflow.validate import validate
    from ..nodes import ENGINE_NODES

    folders = folders_from(_settings(args))
    try:
        prompt = load(args.workflow, parse_sets(args.set), prefix="--set ").prompt
    except WorkflowError as e:  # an API prompt with a broken node is the validator's to explain, as ComfyUI does
        prompt = _api_like(Path(args.workflow))
        if prompt is None:
            if args.json:
                print(json.dumps({"error": e.to_dict(), "node_errors": {}}, indent=1))
                return 1
            raise
    check = validate(prompt, ENGINE_NODES, folders)
    if check.ok:
        print(json.dumps({"ok": True, "outputs": list(check.outputs)}) if args.json else
              f"{args.workflow}: valid (output nodes {', '.join(check.outputs)})")
        return 0
    if args.json:
        print(json.dumps(check.response(), indent=1))
        return 1
    for line in validation_lines(check.response()):
        print(f"vramgraph validate: {line}", file=sys.stderr)
    hint = no_models_hint(folders)
    if hint and _about_files(check.response()):
        print(f"vramgraph validate: {hint}", file=sys.stderr)
    return 1


def _api_like(path: Path) -> dict | None:
    """The file's JSON if it is an object of node id -> node that the format detection refused (a node that is not
    an object, or has no class_type), else None."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or not data or "nodes" in data or "prompt" in data:
        return None
    return data if any(isinstance(n, dict) and "class_type" in n for n in data.values()) else None


def _plan(args: argparse.Namespace) -> int:
    from ..graph.draw.timeline import timeline_svg
    from ..graph.engine.budget import budget_text

    pipe = _pipeline(args)
    pipe.settings = pipe.settings.replace(host=args.host)
    if args.prompts < 1:
        raise ValueError(f"--prompts {args.prompts}: give 1 or more")
    if pipe.settings.devices:
        return _plan_devices(pipe, args)
    several = args.workflow if len(args.workflow) > 1 else args.workflow[0]
    prep, budget = pipe.planned(several, size=args.size, set=parse_sets(args.set), prompts=args.prompts)
    log.info("%s", pipe.assumed())
    print(json.dumps({**prep.plan.to_json(), "budget_text": budget_text(budget)}, indent=1) if args.json else
          f"{prep.plan.table()}\n{budget_text(budget)}")
    if args.svg:
        title = " + ".join(Path(w).name for w in args.workflow) + (f" x {args.prompts}" if args.prompts > 1 else "")
        svg = timeline_svg(prep.plan, title, card=budget.card, prompt=prep.prompt)
        Path(args.svg).write_text(svg, encoding="utf-8")
        log.info("timeline: %s", args.svg)
    return 0


def _plan_devices(pipe: Any, args: argparse.Namespace) -> int:
    """`plan --devices`: the placement on several devices, one plan table (and one timeline lane) per device."""
    from ..graph.draw.timeline import timeline_svg

    several = args.workflow if len(args.workflow) > 1 else args.workflow[0]
    prep, placed, cards = pipe.placed(several, size=args.size, set=parse_sets(args.set), prompts=args.prompts)
    print(json.dumps(placed.to_json(), indent=1) if args.json else placed.table())
    if args.svg:
        title = " + ".join(Path(w).name for w in args.workflow) + (f" x {args.prompts}" if args.prompts > 1 else "")
        lanes = [timeline_svg(lane.plan, f"{title} on {lane.device}", card=cards[lane.device],
                              prompt=prep.prompt) for lane in placed.lanes]
        Path(args.svg).write_text(_stack_svgs(lanes), encoding="utf-8")
        log.info("timeline: %s (one lane per device)", args.svg)
    return 0


def _stack_svgs(parts: list[str]) -> str:
    """SVG pictures one below the other in one picture."""
    import re

    sizes = [tuple(float(re.search(rf'{k}="([0-9.]+)', p).group(1)) for k in ("width", "height")) for p in parts]
    width, y, body = max(w for w, _ in sizes), 0.0, []
    for p, (_, h) in zip(parts, sizes, strict=True):
        inner = re.sub(r"^.*?<svg[^>]*>", "", p, count=1, flags=re.S).rsplit("</svg>", 1)[0]
        body.append(f'<g transform="translate(0,{y:g})">{inner}</g>')
        y += h
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{y:g}" '
            f'viewBox="0 0 {width:g} {y:g}">' + "".join(body) + "</svg>\n")


def _prompts(args: argparse.Namespace) -> list[str]:
    texts = list(args.prompt)
    if args.prompts:  # one prompt a line; blank lines and lines starting with # are left out
        texts += [t.strip() for t in Path(args.prompts).read_text().splitlines()
                  if t.strip() and not t.lstrip().startswith("#")]
    if not texts:
        raise ValueError("give a prompt with -p TEXT (repeatable) or --prompts FILE")
    return texts


def _generate(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from ..api.pipeline import check_generate

    texts = _prompts(args)
    check_generate(width=args.width, height=args.height, steps=args.steps, guidance=args.guidance, seed=args.seed,
                   spell=GENERATE_OPTIONS)
    out = Path(args.out)
    targets = [out] if len(texts) == 1 else [out.with_name(f"{out.stem}-{i + 1}{out.suffix}")
                                             for i in range(len(texts))]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not args.force:
        raise ValueError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; "
                         "pass --force to overwrite, or choose another -o")
    with tempfile.TemporaryDirectory() as tmp:
        args.output = tmp  # the run writes here; the PNGs are then moved to -o
        if args.image:
            args.input = tmp  # references reach the workflow through an input folder of this run's own
        pipe = _pipeline(args, checkpoint=args.checkpoint, transformer=args.transformer,
                         text_encoder=args.text_encoder, vae=args.vae)
        pipe.previews = bool(args.preview)
        made = pipe.generate(texts, seed=args.seed, width=args.width, height=args.height, steps=args.steps,
                             guidance=args.guidance, negative=args.negative, images=args.image,
                             events=_Bars(args.preview), progress=True, spell=GENERATE_OPTIONS,
                             loras=[lora_arg(x) for x in args.lora])
        for g, target in zip(made, targets, strict=True):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(g.paths[0]), target)
            print(target)
            log.info("seed %d: %s", g.seed, target)
    return 0


def lora_arg(text: str) -> tuple[str, float]:
    """--lora FILE[:STRENGTH] as (file, strength); a colon not followed by a number belongs to the file name."""
    file, sep, tail = text.rpartition(":")
    if sep and file:
        try:
            return file, float(tail)
        except ValueError:
            pass
    return text, 1.0


def _session(args: argparse.Namespace) -> int:
    from .session import Session, repl

    return repl(Session(_pipeline(args, checkpoint=args.checkpoint), save_dir=Path(args.out_dir)))


def _inspect(args: argparse.Namespace) -> int:
    from ..models import loading
    from ..models.gguf import is_gguf, tokenizer_note
    from ..models.headers import read_header

    spec = loading.inspect(args.models)
    out = {"variant": spec.variant, "distilled": spec.distilled, "distilled_from": spec.distilled_from,
           "tokenizer": str(spec.tokenizer) if spec.tokenizer else "bundled"}
    for kind in loading.COMPONENTS:
        c = getattr(spec, kind)
        out[kind] = None if c is None else {
            "layout": c.layout, "files": [str(f) for f in c.files], "dtype": c.dtype, "params": c.params,
            "bf16_gib": round(c.nbytes("bf16") / 2**30, 3), "blocks": len(c.block_params),
            # what loading it for bf16 compute puts on the GPU, by stored dtype (fp8 layers stay fp8)
            "bytes": c.nbytes("bf16"), "dtype_mix": dict(c.dtype_mix), "quantized_layers": c.quant_layers}
        if c is not None and any(is_gguf(f) for f in c.files):  # GGUF: its tensors by stored type (the quant mix)
            out[kind]["gguf_types"] = dict(Counter(i.dtype for i in c.infos.values()).most_common())
            if kind == "text_encoder" and spec.tokenizer is None:
                out[kind]["tokenizer"] = tokenizer_note(c.files[0], read_header(c.files[0])[1])
    print(json.dumps(out, indent=1))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    pngs, seconds = run_demo(Path(args.out))
    for p in pngs:
        print(p)
    log.info("random weights, so the pictures are noise; the whole path ran (%.1f s)", seconds)
    return 0


def _outside(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command whose handler lives outside cli/ (serve, from server/): --demo and the settings are applied to
    its arguments first, as for the commands here."""
    def run(args: argparse.Namespace) -> int:
        _settings(args)  # --demo: the tiny models and inputs, into args
        return handler(args)

    return run


def _fetch(args: argparse.Namespace) -> int:
    from .fetch import run_fetch

    return run_fetch(args, folders_from(_settings(args)))


COMMANDS = {"run": _run, "validate": _validate, "plan": _plan, "generate": _generate, "inspect": _inspect,
            "demo": _demo, "session": _session, "fetch": _fetch}


# ------------------------------------------------------------------------------------------ errors

def _say_error(args: argparse.Namespace, e: BaseException, body: dict | None) -> None:
    """One line on stderr (graph.workflow.errors.one_line), or ComfyUI's JSON with --json."""
    from ..graph.workflow.errors import ValidationFailed, one_line, summary

    if getattr(args, "json", False) and body is not None:
        print(json.dumps(body, indent=1, default=str), file=sys.stderr)
        return
    line = one_line(e)
    if isinstance(e, ValidationFailed):
        line = summary(e.response, ": vramgraph validate lists them")
        try:
            hint = no_models_hint(folders_from(_settings_quiet(args)))
        except ValueError:
            hint = None
        line += f"; {hint}" if hint and _about_files(e.response) else ""
    print(f"vramgraph {args.command}: {line}", file=sys.stderr)


def _about_files(response: dict) -> bool:
    """Whether a refusal is about a model file (where a missing models folder is the reason worth adding)."""
    from ..nodes.files import MODEL_EXTENSIONS

    return any(err.get("type") == "value_not_in_list" and
               str((err.get("extra_info") or {}).get("received_value", "")).lower().endswith(MODEL_EXTENSIONS)
               for entry in response.get("node_errors", {}).values() for err in entry.get("errors", []))


def _settings_quiet(args: argparse.Namespace) -> Settings:
    return Settings(models=getattr(args, "models", None), config=getattr(args, "config", None),
                    extra_model_paths=tuple(getattr(args, "extra_model_paths", None) or ()))


def main(argv: list[str] | None = None, commands: Mapping[str, Callable[[argparse.Namespace], int]] | None = None
         ) -> int:
    """The command line. `commands` adds handlers from outside cli/: the entry point (vramgraph/__main__.py) passes
    `serve`, which lives in server/ (cli/ and server/ never import each other)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Expandable segments: freed activations go back to the allocator without fragmenting it, so a plan that
    # runs close to a --vram cap does not make the allocator flush its cache every step (set before CUDA starts).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv or ["session"])
    from ..graph.plan.planner import PlanError
    from ..graph.workflow.errors import InterruptedRun, VramgraphError
    from ..models.headers import CheckpointError

    try:
        handlers = {**COMMANDS, **{name: _outside(h) for name, h in (commands or {}).items()}}
        if args.command not in handlers:
            raise ValueError(f"'{args.command}' is served by the vramgraph entry point: run `vramgraph "
                             f"{args.command}` or `python -m vramgraph {args.command}`")
        return handlers[args.command](args)
    except (KeyboardInterrupt, InterruptedRun):
        print("interrupted", file=sys.stderr)
        return 130
    except PlanError as e:
        _say_error(args, e, {"error": e.to_dict()})
        return 3
    except VramgraphError as e:
        _say_error(args, e, getattr(e, "response", None) or {"error": e.to_dict()})
        return 1
    except (CheckpointError, ValueError, OSError) as e:
        _say_error(args, e, {"error": {"type": type(e).__name__, "message": str(e), "details": "",
                                       "extra_info": {}}})
        return 2


if __name__ == "__main__":
    sys.exit(main())
