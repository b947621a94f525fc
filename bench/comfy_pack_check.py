"""Inside the real ComfyUI: are the VG nodes registered, and do our workflows run there (GPU, real ComfyUI)?

    python3 bench/comfy_pack_check.py --port 8188 --out pack_check.json
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

WORKFLOW = Path(__file__).parents[1] / "workflows" / "text_to_image.json"


def call(base: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"http_error": e.code, "body": e.read().decode()[:3000]}


def run(base: str, prompt: dict, extra_data: dict | None = None, timeout: float = 300) -> dict:
    t0 = time.time()
    posted = call(base, "/prompt", {"prompt": prompt, "client_id": "pack-check", "extra_data": extra_data or {}})
    if "prompt_id" not in posted:
        return {"posted": posted}
    pid = posted["prompt_id"]
    while time.time() - t0 < timeout:
        hist = call(base, f"/history/{pid}")
        st = hist.get(pid, {}).get("status", {})
        if st.get("status_str") in ("success", "error"):
            msgs = [m for m in st.get("messages", []) if m[0] == "execution_error"]
            return {"status": st["status_str"], "seconds": round(time.time() - t0, 3),
                    "outputs": hist[pid].get("outputs"), "errors": msgs}
        time.sleep(0.1)
    return {"status": "timeout"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8188)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    info = call(base, "/object_info")
    vg = {k: {"category": v.get("category"), "display_name": v.get("display_name")} for k, v in info.items()
          if k.startswith("VG")}
    report = {"vg_nodes": vg, "runs": {}}
    prompt = json.loads(WORKFLOW.read_text())
    report["runs"]["vg_text_to_image_1024"] = run(base, prompt)
    prompt["4"]["inputs"]["text"] = "a second prompt, warm"
    report["runs"]["vg_text_to_image_1024_warm"] = run(base, prompt)
    mixed = json.loads(WORKFLOW.read_text())  # our nodes feeding ComfyUI's own SaveImage (IMAGE interop)
    mixed["8"] = {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "vg_mixed"}}
    mixed["5"]["inputs"].update(width=512, height=512)
    report["runs"]["vg_nodes_into_core_SaveImage_512"] = run(base, mixed)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in report["runs"].items()}))
    print(len(vg), "VG nodes registered")


if __name__ == "__main__":
    main()
