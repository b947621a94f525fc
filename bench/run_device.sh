#!/usr/bin/env bash
# Run on the device machine from the repository root, with `.whl` carried (see README "GPU benchmarks"):
#   bash bench/run_device.sh "equivalence speed load_rss checkpoints tests"   ("tests": the gpu-marked tests)
#   bash bench/run_device.sh oom_matrix --cards 6,8      (arguments after the names go to every benchmark named)
# Installs the carried wheels (diffusers) beside the image's torch/transformers, makes this checkout
# importable as `vramgraph`, and writes each benchmark's JSON report to $OUT (or ./out).
set -eu
out=${OUT:-out}
failed=""
mkdir -p "$out" /tmp/site /tmp/pkgs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/pkgs/vramgraph
export PYTHONPATH=/tmp/pkgs:/tmp/site:$PWD/bench PYTHONUNBUFFERED=1 QWEN_TOKENIZER_DIR=$PWD/.whl/tok
for b in ${1:-equivalence speed load_rss}; do
  echo "== $b"
  if [ "$b" = tests ]; then
    (set -o pipefail; python3 -m pytest -q -rs -m gpu tests 2>&1 | tee "$out/gpu-tests.txt") || failed="$failed $b"
  else
    python3 "bench/$b.py" "$out/$b.json" "${@:2}" || failed="$failed $b"
  fi
done
# every benchmark runs even when one fails, and the script then fails naming them
if [ -n "$failed" ]; then
  echo "== FAILED:$failed" >&2
  exit 1
fi
