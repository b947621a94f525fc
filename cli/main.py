"""Command line: run, validate and plan saved workflows; one-shot generation; inspect; the demo.

    vramgraph run WORKFLOW.json [--models DIR] [--set NODE.INPUT=VALUE ...] [-o DIR]
    vramgraph validate WORKFLOW.json
    vramgraph plan WORKFLOW.json [--vram 12GiB] [--size 1536x1536] [--json]
    vramgraph generate -p PROMPT [-W 1024 -H 1024 -S SEED --steps N --guidance G -i REF ...] [-o FILE]
    vramgraph inspect MODEL...      vramgraph demo
    vramgraph serve [--host 127.0.0.1] [--port 8188] [--models DIR] [--vram 12GiB]

Models resolve under a ComfyUI-style models folder (diffusion_models/ or unet/, text_encoders/ or
clip/, vae/) given by --models, $VRAMGRAPH_MODELS, or "models" in a config file (--config, else
./vramgraph.json, else ~/.config/vramgraph/config.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ..graph.runtime import engine_from, folders_from

log = logging.getLogger("vramgraph")
WORKFLOWS = Path(__file__).parent.parent / "workflows"


def _engine_args(p: argparse.ArgumentParser, outputs: bool = True) -> None:
    p.add_argument("--models", action="append", default=None, help="models folder (repeatable)")
    p.add_argument("--config", default=None, help="JSON config with models/input/output/vram/reserve")
    p.add_argument("--input", default=None, help="folder of input images (default ./input)")
    if outputs:
        p.add_argument("-o", "--output", default=None, help="output folder (default ./output)")
    p.add_argument("--vram", default=None, help="GPU budget as a card size, e.g. 12GiB (default: free memory)")
    p.add_argument("--reserve", default=None, help="memory kept free below the budget (default 384MiB)")
    p.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vramgraph", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a saved workflow (ComfyUI API or UI format)")
    r.add_argument("workflow", nargs="+", help="one workflow, or several: they are planned as one queue")
    r.add_argument("--preview", default=None, metavar="DIR", help="write a preview PNG of every sampling step")
    r.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE",
                   help="override an input; NODE is the id or the title (repeatable)")
    r.add_argument("--report", default=None, help="write the run report (plan, per-node peaks) as JSON")
    r.add_argument("--demo", action="store_true",
                   help="use tiny random-weight models (written to ./vramgraph-demo/models) instead of --models")
    _engine_args(r)
    v = sub.add_parser("validate", help="check a workflow; prints ComfyUI's error JSON and exits 1 if invalid")
    v.add_argument("workflow")
    v.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE")
    _engine_args(v, outputs=False)
    p = sub.add_parser("plan", help="print the memory plan (no weights needed) and write its timeline SVG")
    p.add_argument("workflow")
    p.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE")
    p.add_argument("--size", default=None, help="WxH for every latent/scheduler size in the workflow")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--svg", default="plan.svg", help="timeline picture (default plan.svg; '' for none)")
    p.add_argument("--host", default=None, help="host RAM budget (default: available memory)")
    _engine_args(p, outputs=False)
    g = sub.add_parser("generate", help="one-shot text to image or edit with the shipped workflows")
    g.add_argument("-p", "--prompt", action="append", default=[],
                   help="the prompt; repeat it to queue several (planned together: one load per model)")
    g.add_argument("--prompts", default=None, metavar="FILE", help="a file of prompts, one per line, queued")
    g.add_argument("--preview", default=None, metavar="DIR", help="write a preview PNG of every sampling step")
    g.add_argument("-n", "--negative", default=None, help="negative prompt (turns on guidance 4 if not given)")
    g.add_argument("-W", "--width", type=int, default=1024)
    g.add_argument("-H", "--height", type=int, default=1024)
    g.add_argument("-S", "--seed", type=int, default=0)
    g.add_argument("--steps", type=int, default=None, help="default 4 (distilled) or 50 (with --negative)")
    g.add_argument("--guidance", type=float, default=None)
    g.add_argument("-i", "--image", action="append", default=[], help="reference image for editing (repeatable)")
    g.add_argument("-o", "--out", default="vramgraph.png", help="PNG path (-1, -2, ... added for several prompts)")
    g.add_argument("--checkpoint", default=None,
                   help="an HF model folder or a folder of the three files, instead of --models file names")
    g.add_argument("--transformer", default="flux-2-klein-4b.safetensors")
    g.add_argument("--text-encoder", default="qwen_3_4b.safetensors")
    g.add_argument("--vae", default="flux2-vae.safetensors")
    _engine_args(g, outputs=False)
    i = sub.add_parser("inspect", help="recognise checkpoints and print their spec (reads headers only)")
    i.add_argument("models", nargs="+")
    s = sub.add_parser("serve", help="a local server with ComfyUI's API and a page that shows the memory plan")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8188, help="port (default 8188, ComfyUI's)")
    s.add_argument("--demo", action="store_true",
                   help="serve tiny random-weight models (written to ./vramgraph-demo/models) instead of --models")
    s.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE",
                   help="a plugin whose setup(app, engine) adds routes (repeatable; bench/peer_routes.py)")
    s.add_argument("--previews", action="store_true",
                   help="step previews for every prompt (default: only for prompts whose extra_data asks, as ComfyUI)")
    s.add_argument("--enable-cors-header", nargs="?", const="*", default=None, metavar="ORIGIN",
                   help="allow requests from other sites (ORIGIN, default *), as ComfyUI's flag; by default pages of "
                        "other sites, foreign Host headers and cross-site websockets are refused")
    _engine_args(s)
    ss = sub.add_parser("session", help="interactive: prompt lines in, images out, models kept (also: no command)")
    ss.add_argument("--checkpoint", default=None)
    ss.add_argument("-o", "--out-dir", default="output", help="where images are saved (!save DIR changes it)")
    _engine_args(ss, outputs=False)
    d = sub.add_parser("demo", help="tiny random-weight models + the shipped workflows, end to end (any machine)")
    d.add_argument("--out", default="vramgraph-demo", help="folder for the tiny models, inputs and PNGs")
    return ap


# ------------------------------------------------------------------------------------------ settings

def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def apply_sets(prompt: dict, sets: list[str]) -> dict:
    """--set NODE.INPUT=VALUE: NODE is an id or a node title; VALUE is JSON (numbers, true) or a string."""
    for item in sets:
        target, sep, value = item.partition("=")
        node, dot, name = target.rpartition(".")
        if not sep or not dot:
            raise ValueError(f"--set {item}: write NODE.INPUT=VALUE, e.g. --set 6.seed=7")
        ids = [node] if node in prompt else [i for i, n in prompt.items()
                                            if n.get("_meta", {}).get("title") == node]
        if len(ids) != 1:
            raise ValueError(f"--set {item}: no node with id or title '{node}'" if not ids else
                             f"--set {item}: several nodes are titled '{node}' ({', '.join(ids)}); use the id")
        prompt[ids[0]].setdefault("inputs", {})[name] = _value(value)
    return prompt


def _load(args: argparse.Namespace, workflow: str | None = None) -> Any:
    from ..graph.workflow import load_workflow

    path = Path(workflow or (args.workflow[0] if isinstance(args.workflow, list) else args.workflow))
    if not path.exists() and (WORKFLOWS / path.name).exists():
        path = WORKFLOWS / path.name
    wf = load_workflow(path)
    apply_sets(wf.prompt, args.set)
    return wf


# ------------------------------------------------------------------------------------------ commands

class _Bars:
    """tqdm progress for the node that is running."""

    def __init__(self, prompt: dict, preview_dir: str | None = None) -> None:
        self.prompt, self.bar = prompt, None
        self.preview_dir = Path(preview_dir) if preview_dir else None

    def __call__(self, kind: str, data: dict) -> None:
        from tqdm import tqdm

        if kind == "progress":
            if self.bar is None:
                node = data["node"]
                self.bar = tqdm(total=data["max"], desc=f"{node} {self.prompt[node]['class_type']}", leave=False)
            self.bar.n = data["value"]
            self.bar.refresh()
        elif kind in ("executed", "execution_success") and self.bar is not None:
            self.bar.close()
            self.bar = None
        elif kind == "vg_step":
            log.info("  %s %s", data["kind"], data["model"].split(":")[0])
        elif kind == "preview" and self.preview_dir is not None:
            self.preview_dir.mkdir(parents=True, exist_ok=True)
            name = f"{data['node'].replace(':', '_')}_{data['index']}_step{data['step']:03}.png"
            data["image"].save(self.preview_dir / name)


def run_workflows(args: argparse.Namespace, wfs: list, engine: Any = None) -> tuple[Any, list[list[Path]]]:
    """Run one workflow, or several planned as one queue; returns the run and each workflow's images."""
    engine = engine or engine_from(args)
    preview = getattr(args, "preview", None)
    engine.previews = bool(preview)
    extras = [{"workflow": wf.ui} if wf.ui is not None else None for wf in wfs]
    if len(wfs) == 1:
        result = engine.run(wfs[0].prompt, extra_pnginfo=extras[0], events=_Bars(wfs[0].prompt, preview))
        images = [result.images]
    else:
        from ..graph.queue import merge

        bars = _Bars(merge([wf.prompt for wf in wfs]).prompt, preview)
        result, images = engine.run_queue([wf.prompt for wf in wfs], extra_pnginfo=extras, events=bars)
    log.info("%d nodes ran, %d cached; %d loads, %d unloads; %.2f s", len(result.nodes), len(result.cached),
             result.loads, result.unloads, result.seconds)
    return result, images


def run_workflow(args: argparse.Namespace, wf: Any, engine: Any = None) -> Any:
    return run_workflows(args, [wf], engine)[0]


def _run(args: argparse.Namespace) -> int:
    if args.demo:
        from ..models.tiny import SHIPPED_NAMES, write_tiny_models

        models = Path("vramgraph-demo") / "models"
        if not (models / "vae" / SHIPPED_NAMES["vae"]).exists():
            write_tiny_models(models, names=SHIPPED_NAMES)
        args.models = [str(models)]
        log.info("demo: tiny random-weight models in %s, so the picture is noise", models)
    result, images = run_workflows(args, [_load(args, w) for w in args.workflow])
    for p in (p for group in images for p in group):
        print(p)
    if args.report:
        Path(args.report).write_text(json.dumps(result.to_json(), indent=1))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from ..graph.errors import WorkflowError
    from ..graph.validate import validate
    from ..nodes import ENGINE_NODES

    try:
        prompt = _load(args).prompt
    except WorkflowError as e:  # an API prompt with a broken node is the validator's to explain, as ComfyUI does
        prompt = _api_like(Path(args.workflow))
        if prompt is None:
            print(json.dumps({"error": e.to_dict(), "node_errors": {}}, indent=1))
            return 1
    check = validate(prompt, ENGINE_NODES, folders_from(args))
    if check.ok:
        print(json.dumps({"ok": True, "outputs": list(check.outputs)}))
        return 0
    print(json.dumps(check.response(), indent=1))
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


def _resize(prompt: dict, size: str) -> None:
    w, _, h = size.lower().partition("x")
    if not (w.isdigit() and h.isdigit()):
        raise ValueError(f"--size {size}: write WxH, e.g. 1536x1536")
    for node in prompt.values():
        inputs = node.get("inputs", {})
        if node.get("class_type") in ("EmptyFlux2LatentImage", "VGEmptyLatent", "Flux2Scheduler"):
            for name, v in (("width", int(w)), ("height", int(h))):
                if name in inputs and not isinstance(inputs[name], list):
                    inputs[name] = v
        title = str(node.get("_meta", {}).get("title", "")).lower()  # ComfyUI's templates title them "Width"
        if node.get("class_type") in ("PrimitiveInt",) and title in ("width", "height"):
            inputs["value"] = int(w) if title == "width" else int(h)


def _plan(args: argparse.Namespace) -> int:
    from ..graph.timeline import timeline_svg

    wf = _load(args)
    if args.size:
        _resize(wf.prompt, args.size)
    if args.dtype is None:  # a plan is for the GPU, where the models run in bf16 (fp32 is the CPU's run default)
        args.dtype = "bf16"
    engine = engine_from(args, allow_builtin=True, host=args.host)
    prep = engine.prepare(wf.prompt)
    if args.json:
        print(json.dumps(prep.plan.to_json(), indent=1))
    else:
        print(prep.plan.table())
    if args.svg:
        Path(args.svg).write_text(timeline_svg(prep.plan, f"{Path(args.workflow).name}"))
        log.info("timeline: %s", args.svg)
    return 0


def _prompts(args: argparse.Namespace) -> list[str]:
    texts = list(args.prompt)
    if args.prompts:
        texts += [t.strip() for t in Path(args.prompts).read_text().splitlines() if t.strip()]
    if not texts:
        raise ValueError("give a prompt with -p TEXT (repeatable) or --prompts FILE")
    return texts


def _generate(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from PIL import Image

    from ..graph.prompts import build_prompt
    from ..graph.workflow import Workflow

    texts = _prompts(args)
    names = {"checkpoint": args.checkpoint} if args.checkpoint else \
        {"transformer": args.transformer, "text_encoder": args.text_encoder, "vae": args.vae}
    with tempfile.TemporaryDirectory() as tmp:
        args.output = tmp
        refs = []
        if args.image:  # the references are read through the input folder, as a workflow would
            args.input = tmp
            for i, path in enumerate(args.image):
                src = Path(path)
                try:
                    with Image.open(src) as im:
                        im.verify()
                except OSError as e:
                    raise ValueError(f"--image {path}: not a readable image ({e})") from e
                shutil.copy(src, Path(tmp) / f"ref{i}{src.suffix}")
                refs.append(f"ref{i}{src.suffix}")
        wfs = [Workflow(build_prompt(t, width=args.width, height=args.height, seed=args.seed + i, steps=args.steps,
                                     guidance=args.guidance, negative=args.negative, references=tuple(refs),
                                     **names), None, "generate")
               for i, t in enumerate(texts)]
        _, images = run_workflows(args, wfs)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        targets = [out] if len(texts) == 1 else [out.with_name(f"{out.stem}-{i + 1}{out.suffix}")
                                                 for i in range(len(texts))]
        for group, target in zip(images, targets, strict=True):
            shutil.move(str(group[0]), target)
            print(target)
    return 0


def _session(args: argparse.Namespace) -> int:
    from .session import Session, repl

    names = {"checkpoint": args.checkpoint} if getattr(args, "checkpoint", None) else {}
    return repl(Session(engine_from(args), save_dir=Path(args.out_dir), names=names))


def _inspect(args: argparse.Namespace) -> int:
    import torch

    from ..models import loading

    spec = loading.inspect(args.models)
    out = {"variant": spec.variant, "distilled": spec.distilled, "distilled_from": spec.distilled_from,
           "tokenizer": str(spec.tokenizer) if spec.tokenizer else "bundled"}
    for kind in loading.COMPONENTS:
        c = getattr(spec, kind)
        out[kind] = None if c is None else {
            "layout": c.layout, "files": [str(f) for f in c.files], "dtype": c.dtype, "params": c.params,
            "bf16_gib": round(c.nbytes(torch.bfloat16) / 2**30, 3), "blocks": len(c.block_params)}
    print(json.dumps(out, indent=1))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    pngs, seconds = run_demo(Path(args.out))
    for p in pngs:
        print(p)
    log.info("random weights, so the pictures are noise; the whole path ran (%.1f s)", seconds)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from ..server.app import serve

    return serve(args)


COMMANDS = {"run": _run, "validate": _validate, "plan": _plan, "generate": _generate, "inspect": _inspect,
            "demo": _demo, "serve": _serve, "session": _session}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Expandable segments: freed activations go back to the allocator without fragmenting it, so a plan that
    # runs close to a --vram cap does not make the allocator flush its cache every step (set before CUDA starts).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv or ["session"])
    from ..graph.errors import VramgraphError
    from ..graph.planner import PlanError
    from ..models.common import CheckpointError

    try:
        return COMMANDS[args.command](args)
    except PlanError as e:
        print(json.dumps({"error": e.to_dict()}, indent=1), file=sys.stderr)
        return 3
    except VramgraphError as e:
        body = getattr(e, "response", None) or {"error": e.to_dict()}
        print(json.dumps(body, indent=1, default=str), file=sys.stderr)
        return 1
    except (CheckpointError, ValueError, OSError) as e:
        print(f"vramgraph {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
