"""The side-by-side harness's new parts on the CPU (bench/peer_compare.sh runs them on the GPU): the card emulation's
holder, the base-model graph against ComfyUI's template, and the base and GGUF clients and their comparisons run
against `vramgraph serve --device cpu` on tiny models (the same server standing in for both sides)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from serving import serve_process
from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import gguf_step  # noqa: E402
import hold_memory  # noqa: E402
import peer_base  # noqa: E402
from hold_memory import GiB, HoldError, MiB, fill, target_free  # noqa: E402


class FakeDevice:
    """cudaMemGetInfo's free bytes; allocations take whole 2 MiB pages (as the driver rounds them)."""

    def __init__(self, free: int, extra: int = 0) -> None:
        self.free_bytes, self.extra = free, extra

    def free(self) -> int:
        return self.free_bytes

    def take(self, n: int) -> int:
        assert n > 0 and n <= hold_memory.CHUNK
        self.free_bytes -= -(-n // (2 * MiB)) * 2 * MiB + self.extra
        return n


@pytest.mark.parametrize("free", [80 * GiB - 517 * MiB, 139 * GiB + 3 * MiB, 12 * GiB + 5 * MiB])
def test_holder_leaves_the_card_free(free: int) -> None:
    dev = FakeDevice(free)
    target = target_free(12)
    assert target == 12 * GiB - GiB // 4
    held = fill(target, dev.free, dev.take)
    assert target <= dev.free_bytes <= target + hold_memory.SLACK
    assert sum(held) == free - dev.free_bytes


def test_holder_refuses_what_it_cannot_hold() -> None:
    with pytest.raises(HoldError, match="less than"):
        fill(target_free(12), FakeDevice(11 * GiB).free, FakeDevice(11 * GiB).take)
    stuck = FakeDevice(40 * GiB)
    with pytest.raises(HoldError, match="did not fall"):
        fill(target_free(8), stuck.free, lambda n: n)
    greedy = FakeDevice(40 * GiB, extra=3 * GiB)  # another process takes memory meanwhile
    with pytest.raises(HoldError, match="under the"):
        fill(target_free(8), greedy.free, greedy.take)


def test_base_graph_is_comfyuis_base_template() -> None:
    """Node types and the values that set the work (steps, CFG, negative, sampler) as in ComfyUI's
    image_flux2_klein_text_to_image template, flattened as its front end queues it."""
    from test_templates import template
    from vramgraph.graph.workflow.parse import ui_to_api
    from vramgraph.nodes import ENGINE_NODES

    api = ui_to_api(json.loads(template("image_flux2_klein_text_to_image.json").read_text()), ENGINE_NODES)
    ours = peer_base.graph("x", 42, 1024, "p")
    kinds = Counter(v["class_type"] for v in api.values() if not v["class_type"].startswith("Primitive"))
    assert Counter(v["class_type"] for v in ours.values()) == kinds

    def one(g: dict, kind: str) -> dict:
        (node,) = [v["inputs"] for v in g.values() if v["class_type"] == kind]
        return node

    assert one(ours, "Flux2Scheduler")["steps"] == one(api, "Flux2Scheduler")["steps"] == 20
    assert one(ours, "CFGGuider")["cfg"] == one(api, "CFGGuider")["cfg"] == 5
    assert one(ours, "KSamplerSelect") == one(api, "KSamplerSelect")
    neg = one(ours, "CFGGuider")["negative"][0]
    assert ours[neg] == {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["2", 0]}}
    assert one(ours, "CLIPLoader") == one(api, "CLIPLoader")
    assert one(ours, "UNETLoader")["unet_name"] == "flux-2-klein-4b.safetensors"  # the harness's klein-4B file


def test_gguf_files_as_comfyui_gguf_reads_them(tmp_path: Path) -> None:
    """gguf_step's text encoder holds every layer, the final norm and the 8B's lm_head under llama.cpp names
    (ComfyUI builds them all; ComfyUI-GGUF makes a Linear missing from the file a zero matrix of the wrong shape),
    the transformer BFL names."""
    import gguf

    files = gguf_step.write_files(tmp_path, "klein-9b", "Q4_K", tiny=True)
    te = gguf.GGUFReader(files["text_encoder"])
    names = {t.name for t in te.tensors}
    arch = te.get_field("general.architecture")
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen3"
    assert {"token_embd.weight", "output_norm.weight", "output.weight", "blk.27.ffn_down.weight",
            "blk.0.attn_q_norm.weight"} <= names  # output.weight: Qwen3-8B's untied lm_head
    assert not any(n.startswith("model.") for n in names)
    tr = {t.name for t in gguf.GGUFReader(files["transformer"]).tensors}
    assert "double_stream_modulation_img.lin.weight" in tr  # what ComfyUI detects FLUX.2 by


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("peer")
    models = write_tiny_models(folder / "models", names=SHIPPED_NAMES)
    gguf_step.write_files(models, "klein-9b", "Q4_K", tiny=True)
    with serve_process(folder) as (url, proc, _log):
        yield url.rsplit(":", 1)[1], proc.pid, folder


def test_base_and_gguf_parts_run_and_compare(server) -> None:
    """Each client runs its graph through the server's ComfyUI API (the same server as both "sides"), and each
    comparison gives ratios, per-step seconds and pixel differences (0: the same server and seeds)."""
    port, pid, folder = server
    logs, pngs = folder / "logs", folder / "pngs"
    logs.mkdir()
    for label in ("comfy_card8", "ours_card8"):  # as peer_compare.sh waits for each server
        r = _run("peer_client.py", "wait", "--port", port, "--pid", str(pid), "--record",
                 str(logs / f"ready_{label}.json"))
        assert r.returncode == 0, r.stdout + r.stderr
    for script, kind in (("peer_base.py", "base"), ("peer_gguf.py", "gguf")):
        for label in ("comfy_card8", "ours_card8"):
            r = _run(script, "run", "--port", port, "--pid", str(pid), "--label", label, "--out", str(logs),
                     "--png", str(pngs), "--tiny", *(["--jobs", "1024_s42,1024_s43"] if kind == "base" else []))
            assert r.returncode == 0, r.stdout + r.stderr
        out = folder / f"peer_{kind}.json"
        r = _run(script, "compare", str(logs), str(out))
        assert r.returncode == 0, r.stdout + r.stderr
        rep = json.loads(out.read_text())
        assert rep["problems"] == [] and list(rep["settings"]) == ["card8"]
        assert rep["settings"]["card8"]["server_ready_s"]["ours"] >= 0
        jobs = rep["settings"]["card8"]["jobs"]
        assert len(jobs) == (2 if kind == "base" else 3)
        for row in jobs.values():
            assert row["pixels"]["mean_abs"] == 0.0 and row["wall_ours_over_comfyui"] > 0
            assert row["comfyui"]["steps"] == 2 and row["comfyui"]["step_s"] > 0
            assert row["comfyui"]["sampler_s"] > 0 and row["pictures"]["ours"]["std"] >= 0
    base = json.loads((logs / "base_comfy_card8.json").read_text())
    assert [j["cold"] for j in base["jobs"]] == [True, False]  # the server's first prompt, then warm
    gguf_run = json.loads((logs / "gguf_ours_card8.json").read_text())
    assert not any(j["cold"] for j in gguf_run["jobs"])
    assert all(j["png"] and Path(j["png"]).is_file() for j in gguf_run["jobs"])


def test_failures_are_loud(server, tmp_path: Path) -> None:
    """A graph the server refuses fails the client (after writing its report); a comparison with a side missing
    fails too, naming it."""
    port, pid, _ = server
    r = _run("peer_base.py", "run", "--port", port, "--pid", str(pid), "--label", "comfy_card6", "--out",
             str(tmp_path), "--png", str(tmp_path), "--tiny", "--jobs", "1024_s42")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run("peer_base.py", "compare", str(tmp_path), str(tmp_path / "b.json"))
    assert r.returncode != 0 and "card6: ComfyUI ran, ours did not" in r.stderr
    assert json.loads((tmp_path / "b.json").read_text())["problems"]
    r = _run("peer_gguf.py", "run", "--port", port, "--pid", str(pid), "--label", "ours_x", "--out", str(tmp_path),
             "--png", str(tmp_path), "--tiny", "--transformer", "missing.gguf")
    assert r.returncode == 1 and "gguf ours_x FAILED 64_s42" in r.stderr, r.stdout + r.stderr
    assert json.loads((tmp_path / "gguf_ours_x.json").read_text())["jobs"][0]["error"]["refused"]
