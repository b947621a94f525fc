"""ComfyUI's six FLUX.2 [klein] templates inside the real ComfyUI with this repository as a custom-node pack (CPU).

    PYTHONPATH=<dir holding vramgraph> python3 bench/comfy_pack_templates.py --comfyui /tmp/comfyui \
        --python /tmp/cvenv/bin/python --out bench/results/comfy_pack_templates-cpu.json

(bench/comfy_pack_templates.sh makes the ComfyUI tree and its venv and runs this.) For each set of model files below,
ComfyUI is started (`main.py --cpu --base-directory <set>`, this repository linked into its custom_nodes/vramgraph)
and asked, through its HTTP API only:

- start-up: the pack imported, its VG nodes in /object_info, no node of another name taken over by the pack, the
  panel's script in /extensions;
- per template (the shipped UI file, converted to the API prompt with ComfyUI's own /object_info declarations, as its
  front end does): POST /vramgraph/plan (our pack's route), POST /prompt (ComfyUI's validation, with our nodes
  loaded), and the run that follows: its status, saved images, or ComfyUI's error;
- on the tiny set, two of our VG workflows run inside ComfyUI to saved images (one into ComfyUI's own SaveImage).

Model sets:
- tiny: the tests' tiny random-weight models under the templates' file names (tests/conftest.py TINY_MODEL_NAMES),
  sizes and steps made small as tests/test_templates.py does (the comfy set's too);
- full: header-only files of the real sizes (tests/test_templates.py _header_only_models), templates unchanged: the
  plans at full size; ComfyUI's runs end at its loaders (no weights);
- comfy: files ComfyUI's model detection accepts, for the templates named with --comfy-templates (the 4B ones by
  default). ComfyUI builds its VAE at fixed widths (128 at the top, two ResNet blocks per level) and its Qwen3
  text encoder at the 4B or 8B shape whatever the file holds, so the tiny VAE and encoder are refused; here the
  VAEs are random weights at the real shapes, the text encoder a zero-filled (sparse) file of Qwen3-4B's real shapes
  (ComfyUI holds it in fp16: 7.5 GiB of RAM) and the transformer the tiny one with the real encoder's context width.
  The 9B templates need Qwen3-8B (15 GiB in bf16): name them with --comfy-templates and a --work of their own, on a
  machine with RAM for it (24 GiB with nothing else running did).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from comfy_pack_check import call, run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import INPUT_IMAGES, TINY_MODEL_NAMES  # noqa: E402
from test_loading import header_only, shapes_of  # noqa: E402
from test_templates import TEMPLATES, _header_only_models, _set, template  # noqa: E402

FOUR_B = [n for n in TEMPLATES if "9b" not in n]


# --------------------------------------------------------------------------------------------- model sets


def write_inputs(folder: Path) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, (w, h) in INPUT_IMAGES.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)


def tiny_set(models: Path) -> None:
    from vramgraph.models.tiny import write_tiny_models

    write_tiny_models(models, names=TINY_MODEL_NAMES)


def zero_filled(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A safetensors file of `shapes` in bf16 whose tensors are all zeros, written sparse (no data on disk)."""
    header_only(path, shapes)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    table = json.loads(path.read_bytes()[8:8 + n])
    os.truncate(path, 8 + n + max(t["data_offsets"][1] for t in table.values()))


def comfy_set(models: Path, names: list[str]) -> None:
    """Files ComfyUI's detection accepts for the templates `names` (see the module's docstring)."""
    import torch
    from safetensors.torch import save_file
    from vramgraph.models import flux2, qwen3, vae, vae_config
    from vramgraph.models.tiny import TINY_TRANSFORMER

    used = {f for n in names for f in TEMPLATES[n][4]}
    encoders = {"qwen_3_4b.safetensors": qwen3.Qwen3Config(), "qwen_3_8b_fp8mixed.safetensors": qwen3.QWEN3_8B}
    widths = {f: cfg.out_dim for f, cfg in encoders.items() if f in used}
    for f, cfg in encoders.items():
        if f in used:
            with torch.device("meta"):
                shapes = shapes_of(qwen3.Qwen3Encoder(dataclasses.replace(cfg, output_layers=(cfg.num_layers,))),
                                   "model.")
            shapes["model.norm.weight"] = (cfg.hidden_size,)
            zero_filled(models / "text_encoders" / f, shapes)
    torch.manual_seed(0)
    vaes = {"flux2-vae.safetensors": vae_config.VAEConfig(), "full_encoder_small_decoder.safetensors":
            vae_config.SMALL_DECODER}
    for f, cfg in vaes.items():
        if f in used:
            (models / "vae").mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in vae.Flux2VAE(cfg).state_dict().items()}, str(models / "vae" / f))
    for n in names:  # each transformer with the context width of the encoder its template loads
        files = TEMPLATES[n][4]
        (width,) = {widths[f] for f in files if f in widths}
        for f in files - set(encoders) - set(vaes):
            sd = flux2.Flux2Transformer(dataclasses.replace(TINY_TRANSFORMER, context_dim=width)).state_dict()
            (models / "diffusion_models").mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in sd.items()}, str(models / "diffusion_models" / f))


# --------------------------------------------------------------------------------------------- ComfyUI


class ComfyUI:
    """ComfyUI's main.py on the CPU over one base directory (models/, input/, custom_nodes/vramgraph -> ROOT)."""

    def __init__(self, comfyui: Path, python: str, base: Path, port: int, args: tuple[str, ...] = ()) -> None:
        self.cmd = [python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--base-directory",
                    str(base), "--disable-auto-launch", *args]
        self.comfyui, self.base, self.url = comfyui, base, f"http://127.0.0.1:{port}"
        self.log = base / "comfyui.log"

    def __enter__(self) -> ComfyUI:
        (self.base / "custom_nodes").mkdir(parents=True, exist_ok=True)
        (self.base / "user").mkdir(exist_ok=True)
        link = self.base / "custom_nodes" / "vramgraph"
        if link.is_symlink() and link.resolve() != ROOT:  # an earlier run's checkout (a worktree since removed)
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(ROOT)
        self.t0 = time.time()
        self.proc = subprocess.Popen(self.cmd, cwd=self.comfyui, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        while time.time() - self.t0 < 300:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/system_stats", timeout=5) as r:
                    self.stats = json.loads(r.read())
                self.started_s = round(time.time() - self.t0, 1)
                return self
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"ComfyUI did not answer in 300 s; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def startup(c: ComfyUI, info: dict) -> dict:
    """The pack as ComfyUI loaded it: import, nodes, no node taken over, the panel's script."""
    log = c.log.read_text(errors="replace")
    ours = {k: v for k, v in info.items() if v.get("python_module") == "custom_nodes.vramgraph"}
    extensions = call(c.url, "/extensions")
    return {
        "comfyui_version": c.stats.get("system", {}).get("comfyui_version"),
        "pytorch_version": c.stats.get("system", {}).get("pytorch_version"),
        "started_s": c.started_s,
        "command": c.cmd[1:],
        "import_failed": "IMPORT FAILED" in log or "Cannot import" in log,
        "import_line": next((ln.strip() for ln in log.splitlines() if ln.rstrip().endswith("custom_nodes/vramgraph")),
                            None),
        "nodes_total": len(info),
        "vg_nodes": {k: {"category": v.get("category"), "display_name": v.get("display_name")}
                     for k, v in ours.items()},
        "taken_over": sorted(k for k in ours if not k.startswith("VG")),  # a core (or other) name served by us
        "panel_script": [e for e in extensions if "vramgraph" in e] if isinstance(extensions, list) else extensions,
    }


def declared(info: dict) -> dict[str, type]:
    """Node classes that declare ComfyUI's /object_info inputs (in its input_order), for the UI -> API conversion."""
    out = {}
    for name, d in info.items():
        spec: dict[str, dict] = {}
        for section in ("required", "optional"):
            given = (d.get("input") or {}).get(section) or {}
            order = (d.get("input_order") or {}).get(section) or list(given)
            spec[section] = {}
            for k in order:
                kind, *rest = given[k]
                if kind == "COMBO":  # the newer declaration of a list of choices
                    kind = tuple((rest[0] if rest else {}).get("options", ()))
                spec[section][k] = (kind, *rest)
        out[name] = type(name, (), {"INPUT_TYPES": classmethod(lambda cls, s=spec: s)})
    return out


def plan_summary(url: str, prompt: dict) -> dict:
    body = call(url, "/vramgraph/plan", {"prompt": prompt})
    if "plan" not in body:
        return {"ok": False, "answer": body}
    plan = body["plan"]
    used = body["timeline"]["models"]  # the models this prompt's steps use (plan["models"] also lists earlier ones)
    return {"ok": True, "unplanned": body["unplanned"],
            "runs": sum(s["kind"] == "run" for s in plan["steps"]),
            "loads": sum(s["kind"] == "load" for s in plan["steps"]),
            "models": {Path(k.split(":", 1)[1].rsplit(":", 1)[0]).name: round(m["nbytes"] / 2**30, 3)
                       for k, m in used.items()},
            "peak_gib": round(plan["peak"] / 2**30, 3), "budget_gib": round(plan["budget"]["gpu"] / 2**30, 3)}


def run_summary(url: str, prompt: dict, ui: dict, timeout: float) -> dict:
    """POST /prompt (ComfyUI's validation) and the run: status, images, or the error ComfyUI reports."""
    got = run(url, prompt, extra_data={"extra_pnginfo": {"workflow": ui}}, timeout=timeout)
    if "posted" in got:
        return {"accepted": False, "answer": got["posted"]}
    out = {"accepted": True, "status": got["status"], "seconds": got.get("seconds"),
           "images": [im for o in (got.get("outputs") or {}).values() for im in o.get("images", [])]}
    for _, e in got.get("errors") or ():
        out["error"] = {k: e.get(k) for k in ("node_id", "node_type", "exception_type", "exception_message")}
    return out


def templates(c: ComfyUI, info: dict, names: list[str], small: bool, timeout: float, save: Any) -> dict:
    from vramgraph.graph.workflow.parse import ui_to_api
    from vramgraph.nodes import ENGINE_NODES

    comfy_nodes = declared(info)
    out = {}
    for name in names:
        sets, ran, _, _, models = TEMPLATES[name]
        ui = json.loads(template(name).read_text())
        prompt = ui_to_api(ui, comfy_nodes)
        for s in sets if small else ():
            _set(prompt, s)
        res: dict[str, Any] = {"sets": sets if small else [], "nodes": len(prompt),
                               "converts_as_ours": prompt == _sets(ui_to_api(ui, ENGINE_NODES), sets if small else [])}
        res["plan"] = plan_summary(c.url, prompt)
        res["plan_expected"] = {"runs": sum(ran.values()), "models": sorted(models)}
        if res["plan"]["ok"]:
            res["plan"]["as_expected"] = (res["plan"]["runs"] == sum(ran.values()) and not res["plan"]["unplanned"]
                                          and set(res["plan"]["models"]) == models)
        res["prompt"] = run_summary(c.url, prompt, ui, timeout)
        out[name] = res
        save(out)  # a long run leaves what it has
        print(name, json.dumps({k: res[k] for k in ("plan", "prompt")})[:600], flush=True)
    return out


def loader_probes(c: ComfyUI, info: dict, names: list[str], timeout: float) -> dict:
    """Each core loader of the templates alone, into ComfyUI's PreviewAny: which files its model detection takes (a
    template's run stops at the first loader that fails)."""
    from vramgraph.graph.workflow.parse import ui_to_api

    comfy_nodes, seen, out = declared(info), set(), {}
    for name in names:
        for node in ui_to_api(json.loads(template(name).read_text()), comfy_nodes).values():
            key = json.dumps(node, sort_keys=True)
            if not node["class_type"].endswith("Loader") or key in seen:
                continue
            seen.add(key)
            prompt = {"1": node, "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
            got = run_summary(c.url, prompt, {}, timeout)
            file = next(v for v in node["inputs"].values() if isinstance(v, str) and v.endswith(".safetensors"))
            out[f"{node['class_type']} {file}"] = {k: got[k] for k in ("status", "error") if k in got}
    print("loaders", json.dumps(out)[:600], flush=True)
    return out


def _sets(prompt: dict, sets: list[str]) -> dict:
    for s in sets:
        _set(prompt, s)
    return prompt


def vg_workflows(c: ComfyUI, timeout: float) -> dict:
    """Two of our VG workflows at 64x64: one into our VGSaveImage, the edit into ComfyUI's own SaveImage."""
    t2i = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    t2i["5"]["inputs"].update(width=64, height=64)
    edit = json.loads((ROOT / "workflows" / "edit.json").read_text())
    edit["5"]["inputs"].update(width=64, height=64)
    saver = next(k for k, v in edit.items() if v["class_type"] == "VGSaveImage")
    edit[saver] = {"class_type": "SaveImage", "inputs": {"images": edit[saver]["inputs"]["images"],
                                                         "filename_prefix": "vg_edit_core_save"}}
    out = {}
    for name, prompt in (("workflows/text_to_image.json 64x64", t2i),
                         ("workflows/edit.json 64x64 into core SaveImage", edit)):
        out[name] = {"plan": plan_summary(c.url, prompt), "prompt": run_summary(c.url, prompt, {}, timeout)}
        for im in out[name]["prompt"]["images"]:
            im["on_disk"] = (c.base / "output" / im.get("subfolder", "") / im["filename"]).is_file()
        print(name, json.dumps(out[name]["prompt"])[:400], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui", type=Path, required=True, help="ComfyUI's source tree (its main.py)")
    ap.add_argument("--python", default=sys.executable, help="the Python of ComfyUI's environment")
    ap.add_argument("--commit", default="", help="ComfyUI's git commit, recorded in the report")
    ap.add_argument("--port", type=int, default=8199)
    ap.add_argument("--work", type=Path, default=Path("/tmp/comfy_pack_templates"), help="base directories go here")
    ap.add_argument("--sets", default="tiny,full,comfy", help="model sets to run, of tiny, full, comfy")
    ap.add_argument("--comfy-templates", default=",".join(FOUR_B), help="templates of the comfy set")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    # sets already in --out from an earlier run stay, each with the commit of the code that ran it
    report: dict[str, Any] = json.loads(a.out.read_text()) if a.out.is_file() else {"sets": {}}
    report["comfyui_commit"] = a.commit
    for kind in a.sets.split(","):
        base = a.work / kind
        models, names = base / "models", list(TEMPLATES)
        if not models.is_dir():
            if kind == "tiny":
                tiny_set(models)
            elif kind == "full":
                _header_only_models(models)
            else:
                names = [n for n in a.comfy_templates.split(",") if n]
                comfy_set(models, names)
        if kind == "comfy":
            names = [n for n in a.comfy_templates.split(",") if n]
        write_inputs(base / "input")
        # on the CPU ComfyUI runs text encoders in fp16, which this CPU computes at 0.3 GFLOPS (bf16: 127): the real
        # Qwen3-4B shape of the comfy set would take hours to encode a prompt; bf16 is one of ComfyUI's own options
        args = ("--bf16-text-enc",) if kind == "comfy" else ()
        with ComfyUI(a.comfyui, a.python, base, a.port, args) as c:
            info = call(c.url, "/object_info")
            entry: dict[str, Any] = {"vramgraph_commit": _git_head(), "startup": startup(c, info)}
            print(kind, json.dumps(entry["startup"])[:800], flush=True)
            if kind != "full":
                entry["loaders"] = loader_probes(c, info, names, a.timeout)
            # the tiny and comfy sets run at the tests' small sizes and step counts (ComfyUI's detection does not look
            # at them; at the templates' 1 MP and 20 steps, text to image alone took 17 minutes here)
            entry["templates"] = templates(c, info, names, small=kind != "full", timeout=a.timeout,
                                           save=lambda done, e=entry, k=kind: save(a.out, report, k, e, done))
            if kind == "tiny":
                entry["vg_workflows"] = vg_workflows(c, a.timeout)
        save(a.out, report, kind, entry, entry["templates"])
    print(json.dumps(report["summary"], indent=1))


def save(out: Path, report: dict, kind: str, entry: dict, done: dict) -> None:
    report["sets"][kind] = {**entry, "templates": done}
    report["summary"] = summary(report)
    out.write_text(json.dumps(report, indent=1))


def _git_head() -> str:
    got = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return got.stdout.strip() + ("+changes" if dirty else "")


def summary(report: dict) -> dict:
    out = {}
    for kind, entry in report["sets"].items():
        s = entry["startup"]
        t = entry["templates"]
        ran = {n: r for n, r in t.items() if r["prompt"].get("status") == "success" and r["prompt"]["images"]}
        out[kind] = {
            "pack_loaded": not s["import_failed"] and bool(s["vg_nodes"]) and not s["taken_over"],
            "planned": [n for n, r in t.items() if r["plan"]["ok"]],
            "accepted": [n for n, r in t.items() if r["prompt"]["accepted"]],
            "ran_to_image": list(ran),
            "failed_at": {n: r["prompt"]["error"] for n, r in t.items() if "error" in r["prompt"]},
            "loaders_refused": {k: v["error"]["exception_message"].strip()[:200]
                                for k, v in entry.get("loaders", {}).items() if "error" in v},
        }
        if "vg_workflows" in entry:
            out[kind]["vg_workflows_ran"] = [n for n, r in entry["vg_workflows"].items()
                                             if r["prompt"].get("status") == "success" and r["prompt"]["images"]]
    return out


if __name__ == "__main__":
    main()
