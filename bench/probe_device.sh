set -u
mkdir -p /tmp/site /tmp/pkgs $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
ln -sfn "$PWD" /tmp/pkgs/vramgraph
export PYTHONPATH=/tmp/pkgs:/tmp/site:$PWD/bench PYTHONUNBUFFERED=1 QWEN_TOKENIZER_DIR=$PWD/.whl/tok
t0=$(date +%s)
python3 .whl/ckpt_script/make_checkpoints.py /tmp/ck --full --device cuda --dtype bf16 --comfy-only > /tmp/mk.log 2>&1 || tail -20 /tmp/mk.log
echo "ckpt $(( $(date +%s) - t0 )) s"; free -g | head -2
python3 bench/load_probe.py /tmp/ck/comfyui/models $OUT/load_probe.json $@ 2>&1 | tail -150
