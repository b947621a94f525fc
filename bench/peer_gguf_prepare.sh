#!/usr/bin/env bash
# The carry for bench/peer_compare.sh's GGUF=1 part, beside the one ../shared/tools/comfyui-peer/prepare.sh builds:
#   bash bench/peer_gguf_prepare.sh [MIRROR_GIT_DIR]
# MIRROR_GIT_DIR: what `fetch github:city96/ComfyUI-GGUF` returned (default /work/.mirror/city96+ComfyUI-GGUF/repo).
# Writes, in the git-ignored .whl/ of this checkout:
#   .whl/comfyui_gguf.tar.xz   ComfyUI-GGUF/ = the mirror's HEAD (its commit in ComfyUI-GGUF/COMMIT), which
#                              peer_compare.sh unpacks into ComfyUI's custom_nodes
#   .whl/gguf-*.whl            the `gguf` package (ComfyUI-GGUF's and our reader of .gguf files), kept if present,
#                              else downloaded from PyPI (pure Python; its numpy, pyyaml, requests, tqdm are on the
#                              GPU image)
# Nothing from the mirror is ever committed. The carry of a run with GGUF=1 (7 paths, ~52 MiB of the 64 allowed):
#   [".whl/peer", ".whl/ckpt_script", ".whl/wheels", ".whl/comfy.tar.xz", ".whl/tok", ".whl/comfyui_gguf.tar.xz",
#    ".whl/gguf-0.19.0-py3-none-any.whl"]
set -eu
MIRROR=${1:-/work/.mirror/city96+ComfyUI-GGUF/repo}
GGUF_VERSION=${GGUF_VERSION:-0.19.0}
root=$(git rev-parse --show-toplevel)
cd "$root"
git --git-dir="$MIRROR" rev-parse --verify -q HEAD > /dev/null || { echo "no git mirror at $MIRROR" >&2; exit 1; }
tmp=$(mktemp -d)
mkdir -p "$tmp/ComfyUI-GGUF" .whl
git --git-dir="$MIRROR" archive --format=tar HEAD | tar -x -C "$tmp/ComfyUI-GGUF"
git --git-dir="$MIRROR" log -1 --format='%H %cs %s' > "$tmp/ComfyUI-GGUF/COMMIT"
for f in __init__.py nodes.py loader.py ops.py dequant.py; do  # what ComfyUI imports
  [ -f "$tmp/ComfyUI-GGUF/$f" ] || { echo "ComfyUI-GGUF export lacks $f" >&2; exit 1; }
done
tar -C "$tmp" -cJf .whl/comfyui_gguf.tar.xz ComfyUI-GGUF
rm -rf "$tmp"
if ! ls .whl/gguf-"$GGUF_VERSION"-py3-none-any.whl > /dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$GGUF_VERSION"
fi
echo "ComfyUI-GGUF $(tar -xJOf .whl/comfyui_gguf.tar.xz ComfyUI-GGUF/COMMIT)"
du -sh .whl/comfyui_gguf.tar.xz .whl/gguf-"$GGUF_VERSION"-py3-none-any.whl
