#!/usr/bin/env bash
# The real ComfyUI and `vramgraph serve` side by side on the H200: same full-size random-weight checkpoints,
# same ComfyUI-API client, same graph of ComfyUI's core node types, a 12 GiB card and uncapped.
# Run on the device from the repo root with the carry built by ../shared/tools/comfyui-peer/prepare.sh:
#   run(command='bash bench/peer_compare.sh "cap12 uncapped"',
#       carry=[".whl/peer", ".whl/ckpt_script", ".whl/wheels", ".whl/comfy.tar.xz", ".whl/tok"])
# Writes $OUT/peer_compare.json (bench/peer_compare.py; $NAME.json with NAME=...) with the PNGs and logs.
# FP8=1: the transformer file is quantized to fp8 as ComfyUI stores it (../shared/tools/comfyui-peer/quantize_fp8.py)
# before either server starts, under the same name, so both run the same fp8 file. Settings: capN (an N GiB card,
# e.g. cap12, cap8, cap6), uncapped; SETTING:JOB,JOB runs that setting with its own jobs (e.g. cap10:2048_s42).
# PACK=0 skips the pack check inside ComfyUI. LORAS=1: after the jobs, each server also runs bench/peer_lora.py (two
# stacked random full-size LoRAs in two key styles, one with a text encoder part; 1024², warm and cold, and the same
# without LoRAs); $OUT/peer_lora.json has the pixel differences and time ratios.
set -u
SETTINGS=${1:-"cap12 uncapped"}
ALL_JOBS=${JOBS:-1024_s42,1024_s43,1024_s44,512_s42,2048_s42}
R=$(pwd)
L=/tmp/peerlogs
P=/tmp/pngs
OUT=${OUT:-/tmp/out}
mkdir -p $L $P $OUT /tmp/emptyfe /tmp/cbase/custom_nodes /tmp/pkgs
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export PYTHONUNBUFFERED=1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/wheels/*.whl
tar -xJf .whl/wheels/comfy_kitchen-0.2.24.tar.xz -C /tmp/site
tar -xJf .whl/comfy.tar.xz -C /tmp
ln -sfn "$R" /tmp/pkgs/vramgraph
export PYTHONPATH=/tmp/site
echo "== t=$(el) making checkpoints"
python3 .whl/ckpt_script/make_checkpoints.py /tmp/ck --full --device cuda --dtype bf16 --comfy-only > $L/make_checkpoints.log 2>&1 \
  || { tail -20 $L/make_checkpoints.log; exit 1; }
if [ "${FP8:-}" = 1 ]; then  # the transformer as ComfyUI stores fp8 files (block linears e4m3fn, weight_scale), same name
  t=/tmp/ck/comfyui/models/diffusion_models/flux-2-klein-4b.safetensors
  python3 .whl/peer/quantize_fp8.py $t /tmp/fp8.safetensors > $L/quantize_fp8.log 2>&1 || { cat $L/quantize_fp8.log; exit 1; }
  mv /tmp/fp8.safetensors $t; cat $L/quantize_fp8.log
fi
if [ "${LORAS:-}" = 1 ]; then
  PYTHONPATH=/tmp/pkgs:/tmp/site python3 bench/peer_lora.py files /tmp/ck/comfyui/models || exit 1
fi
ls -la /tmp/ck/comfyui/models/*/
ln -sfn /tmp/ck/comfyui/models /tmp/cbase/models
cp .whl/peer/peer_probe.py /tmp/cbase/custom_nodes/
NVML_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print $1/1024}')
RES_B=$(python3 -c "print(round($NVML_GIB - 12 + 1.2, 3))")
echo "== t=$(el) checkpoints done; ComfyUI 12 GiB card: --reserve-vram $RES_B + torch cap 12 GiB"

# "Cold" = a fresh server process with the checkpoint files in the OS file cache, the same for both tools:
# the writes of make_checkpoints are flushed (not left to write back under the first server) and every file
# is read once before each server starts; page_cache.log records the memory each start found.
prewarm() {
  sync
  cat /tmp/ck/comfyui/models/*/*.safetensors > /dev/null
  { echo "== before $1"; free -g | head -2; fincore /tmp/ck/comfyui/models/*/*.safetensors 2>&1; } >> $L/page_cache.log
}

# QUEUES="cap12 uncapped": the settings that also run the queue of 8 at 1024² (bench/peer_queue.py); default all.
queue_wanted() { [ -z "${QUEUES:-}" ] || [[ " $QUEUES " == *" ${1#*_} "* ]]; }

wait_down() { kill $1 2>/dev/null; sleep 2; kill -9 $1 2>/dev/null; wait $1 2>/dev/null; }

comfy() {  # $1 label, rest: ComfyUI arguments
  label=$1; shift
  prewarm $label
  echo "== t=$(el) ComfyUI $label: $*"
  COMFY_DIR=/tmp/comfy STUB_MODULES=av python3 .whl/peer/run_comfy.py --disable-api-nodes --front-end-root /tmp/emptyfe \
    --base-directory /tmp/cbase --disable-auto-launch --port 8188 "$@" > $L/comfy_$label.log 2>&1 &
  pid=$!
  timeout 300 python3 .whl/peer/peer_bench.py --port 8188 --label $label --out $P --results $L/results_$label.json \
    --wait 150 --pid $pid --jobs $JOBS 2>&1 | tail -8
  queue_wanted $label && timeout 200 python3 bench/peer_queue.py --port 8188 --label $label --out $L
  [ "${LORAS:-}" = 1 ] && timeout 600 python3 bench/peer_lora.py run --port 8188 --label $label --out $L | tail -5
  if [ -n "${SAMPLER_PAIRS:-}" ] && [ "$label" = comfy_uncapped ]; then  # same picture per sampler/scheduler pair
    timeout 400 python3 bench/peer_samplers.py run --port 8188 --label comfy --out $P
  fi
  if [ "${PACK_CHECK:-}" = "$label" ]; then
    timeout 200 python3 bench/comfy_pack_check.py --port 8188 --out $L/pack_check.json || echo "pack check failed"
  fi
  wait_down $pid
  grep -E "vramgraph|Traceback|Error" $L/comfy_$label.log | grep -v "comfy_kitchen backend" | head -20
}

ours() {  # $1 label, rest: vramgraph serve arguments
  label=$1; shift
  prewarm $label
  echo "== t=$(el) vramgraph $label: $*"
  PYTHONPATH=/tmp/pkgs:/tmp/site python3 -m vramgraph serve --port 8189 --models /tmp/ck/comfyui/models \
    --output /tmp/ours_out --input /tmp/ours_in --plugin bench/peer_routes.py "$@" > $L/ours_$label.log 2>&1 &
  pid=$!
  timeout 300 python3 .whl/peer/peer_bench.py --port 8189 --label $label --out $P --results $L/results_$label.json \
    --wait 150 --pid $pid --jobs $JOBS 2>&1 | tail -8
  queue_wanted $label && timeout 200 python3 bench/peer_queue.py --port 8189 --label $label --out $L
  [ "${LORAS:-}" = 1 ] && timeout 600 python3 bench/peer_lora.py run --port 8189 --label $label --out $L | tail -5
  if [ -n "${SAMPLER_PAIRS:-}" ] && [ "$label" = ours_uncapped ]; then
    timeout 400 python3 bench/peer_samplers.py run --port 8189 --label ours --out $P
  fi
  wait_down $pid
  grep -E "Traceback|Error" $L/ours_$label.log | head -20
}

# SAMPLER_PAIRS=1 (with the uncapped setting): KSampler for every sampler/scheduler pair on both servers
# (bench/peer_samplers.py: 512², 6 steps, seed 42); $OUT/peer_samplers.json has each pair's picture difference.
for s in $SETTINGS; do
  setting=${s%%:*}
  JOBS=$ALL_JOBS; [ "$setting" != "$s" ] && JOBS=${s#*:}
  case $setting in
    cap*)     n=${setting#cap}
              PEER_CAP_GIB=$n comfy comfy_$setting --reserve-vram $(python3 -c "print(round($NVML_GIB - $n + 1.2, 3))")
              ours ours_$setting --vram ${n}GiB ;;
    uncapped) ln -sfn "$R" /tmp/cbase/custom_nodes/vramgraph
              if [ "${PACK:-1}" = 1 ]; then PACK_CHECK=comfy_uncapped comfy comfy_uncapped; else comfy comfy_uncapped; fi
              rm -rf /tmp/cbase/custom_nodes/vramgraph
              ours ours_uncapped ;;
  esac
done
[ -n "${SAMPLER_PAIRS:-}" ] && PYTHONPATH=/tmp/pkgs:/tmp/site python3 bench/peer_samplers.py compare $P comfy ours \
  $OUT/peer_samplers.json
echo "== t=$(el) comparing"
[ "${LORAS:-}" = 1 ] && PYTHONPATH=/tmp/pkgs:/tmp/site python3 bench/peer_lora.py compare $L comfy ours $OUT/peer_lora.json
PYTHONPATH=/tmp/pkgs:/tmp/site python3 bench/peer_compare.py $L $P $OUT/${NAME:-peer_compare}.json
cp $L/page_cache.log $OUT/ 2>/dev/null
(cd /tmp && tar -czf $OUT/peer_logs.tgz --exclude='*.png' peerlogs)  # few files come back from the device: the logs in one (PNGs are too big)
echo "== t=$(el) end"
