#!/usr/bin/env bash
# bench/peer_compare.sh's flow on the CPU, without a GPU or ComfyUI, to check the script (settings, parts, the
# card emulation's holder, time budget, comparisons, the list of failed parts), not its numbers:
#   bash bench/peer_dry_run.sh ["SETTINGS"]          (default "card8 uncapped"; other env as for peer_compare.sh)
#   e.g. GGUF=1 BASE=1 JOBS=512_s42 bash bench/peer_dry_run.sh "card8 uncapped"
# A fake carry in a temporary folder: "ComfyUI" is `vramgraph serve --device cpu` on ComfyUI's port (the same API;
# our own UnetLoaderGGUF/CLIPLoaderGGUF stand in for ComfyUI-GGUF), the checkpoints are the tests' tiny models, the
# holder simulates an 80 GiB device, nvidia-smi is a stub; sizes are tiny (PEER_TINY=1). GGUF=1 also needs the gguf
# wheel and ComfyUI-GGUF's tarball in .whl (bench/peer_gguf_prepare.sh; the tarball is unpacked, not run).
# Exit status: peer_compare.sh's. Everything stays under the printed folder.
set -u
root=$(git rev-parse --show-toplevel)
cd "$root"
d=$(mktemp -d /tmp/peer_dry.XXXXXX)
W=$d/whl
mkdir -p $W/wheels $W/peer $W/ckpt_script $d/bin $d/comfy/comfy
printf '#!/bin/sh\necho 81559\n' > $d/bin/nvidia-smi && chmod +x $d/bin/nvidia-smi
python3 - $W/wheels <<'EOF'
import sys, zipfile  # a wheel that installs nothing that matters
with zipfile.ZipFile(sys.argv[1] + "/peer_dry_dummy-0.0.0-py3-none-any.whl", "w") as z:
    z.writestr("peer_dry_dummy/__init__.py", "")
    z.writestr("peer_dry_dummy-0.0.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: peer-dry-dummy\nVersion: 0.0.0\n")
    z.writestr("peer_dry_dummy-0.0.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr("peer_dry_dummy-0.0.0.dist-info/RECORD", "")
EOF
tar -cJf $W/wheels/comfy_kitchen-0.2.24.tar.xz -T /dev/null
tar -C $d/comfy -cJf $W/comfy.tar.xz comfy
for f in .whl/gguf-*.whl .whl/comfyui_gguf.tar.xz; do [ -e "$f" ] && cp -L "$f" $W/; done
cp -L .whl/peer/peer_bench.py $W/peer/ 2>/dev/null || cp ../shared/tools/comfyui-peer/peer_bench.py $W/peer/ 2>/dev/null \
  || cp /work/shared/tools/comfyui-peer/peer_bench.py $W/peer/
: > $W/peer/peer_probe.py
cat > $W/ckpt_script/make_checkpoints.py <<'EOF'
"""Fake: the tests' tiny models under the harness's file names (vramgraph from $PEER_TMP/pkgs)."""
import os, sys
from pathlib import Path
sys.path.insert(0, os.environ["PEER_TMP"] + "/pkgs")
from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
print(write_tiny_models(Path(sys.argv[1]) / "comfyui" / "models", names=SHIPPED_NAMES))
EOF
cat > $W/peer/run_comfy.py <<'EOF'
"""Fake ComfyUI: `vramgraph serve --device cpu` on ComfyUI's port over its base directory's models."""
import argparse, os, sys
ap = argparse.ArgumentParser()
ap.add_argument("--port")
ap.add_argument("--base-directory")
a, _ = ap.parse_known_args()
t = os.environ["PEER_TMP"]
os.environ["PYTHONPATH"] = f"{t}/pkgs:{t}/site"
b = a.base_directory
os.execvp(sys.executable, [sys.executable, "-m", "vramgraph", "serve", "--device", "cpu", "--port", a.port, "--models",
                           f"{b}/models", "--output", f"{b}/output", "--input", f"{b}/input", "--plugin",
                           "bench/peer_routes.py"])
EOF
ports=$(python3 -c "
import socket
ss = [socket.socket() for _ in range(2)]
for s in ss: s.bind(('127.0.0.1', 0))
print(*[s.getsockname()[1] for s in ss])")
echo "== dry run in $d (ports $ports)"
COMFY_PORT=${ports% *} OURS_PORT=${ports#* } PATH=$d/bin:$PATH PEER_TMP=$d/tmp WHL=$W PEER_TINY=1 OUT=$d/out BUDGET_S=${BUDGET_S:-1800} QUEUES=${QUEUES:-none} \
  PACK=${PACK:-0} JOBS=${JOBS-512_s42} bash bench/peer_compare.sh "${1:-card8 uncapped}"
rc=$?
echo "== dry run exit $rc; outputs in $d/out:"
ls $d/out
exit $rc
