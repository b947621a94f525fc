#!/usr/bin/env bash
# The real ComfyUI from a git mirror with this repository as its custom-node pack, on the CPU (not CI: ComfyUI is not
# on PyPI). From the repository root:
#   bash bench/comfy_pack_templates.sh /work/.mirror/silveroxides+ComfyUI/repo bench/results/comfy_pack_templates-cpu.json
# Extracts the mirror's HEAD into /tmp/comfyui (blobs the mirror lacks are skipped and listed: two tokenizers the
# FLUX.2 templates do not use), makes /tmp/cvenv with ComfyUI's requirements.txt and runs bench/comfy_pack_templates.py.
set -eu
git_dir=$1 out=$2 tree=${COMFYUI:-/tmp/comfyui} venv=${CVENV:-/tmp/cvenv}
if [ ! -f "$tree/main.py" ]; then
  mkdir -p "$tree"
  git --git-dir="$git_dir" ls-tree -r HEAD | while read -r mode type sha path; do
    [ "$type" = blob ] || continue
    mkdir -p "$tree/$(dirname "$path")"
    git --git-dir="$git_dir" cat-file blob "$sha" > "$tree/$path" 2>/dev/null || { rm -f "$tree/$path"; echo "missing: $path"; }
  done
fi
[ -x "$venv/bin/python" ] || { python3 -m venv --system-site-packages "$venv" && "$venv/bin/pip" install -q -r "$tree/requirements.txt"; }
commit=$(git --git-dir="$git_dir" log -1 --format='%H %cs %s')
mkdir -p /tmp/comfy_pack_pkgs && ln -sfn "$PWD" /tmp/comfy_pack_pkgs/vramgraph  # this checkout as `vramgraph`
PYTHONPATH=/tmp/comfy_pack_pkgs python3 bench/comfy_pack_templates.py --comfyui "$tree" --python "$venv/bin/python" \
  --commit "$commit" --out "$out" "${@:3}"
