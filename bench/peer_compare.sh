#!/usr/bin/env bash
# The real ComfyUI and `vramgraph serve` side by side on the GPU: same full-size random-weight checkpoints,
# same ComfyUI-API clients, same graphs of ComfyUI's core node types, per setting (a card size).
# Run on the device from the repo root with the carry built by ../shared/tools/comfyui-peer/prepare.sh
# (and, for GGUF=1, bench/peer_gguf_prepare.sh):
#   run(command='bash bench/peer_compare.sh "cap12 uncapped"',
#       carry=[".whl/peer", ".whl/ckpt_script", ".whl/wheels", ".whl/comfy.tar.xz", ".whl/tok"])
# Writes $OUT/peer_compare.json (bench/peer_compare.py; $NAME.json with NAME=...) with the logs (peer_logs.tgz).
# Two runs of under 9 minutes each on an H100 (run's timeout_s=600; add the GGUF carry to the second):
#   BASE=1 LORAS=1 LORAS_IN="card12 card8" JOBS=1024_s42 QUEUES=none PACK=0 bash bench/peer_compare.sh "card12 card8 uncapped"
#   GGUF=1 JOBS= QUEUES=none PACK=0 bash bench/peer_compare.sh "card6 card8"
#
# Settings: capN (ComfyUI told of an N GiB card with --reserve-vram and a torch cap, ours with --vram NGiB),
# cardN (card emulation as a user has it: before each server starts, bench/hold_memory.py holds the device's memory
# so that N GiB - 0.25 GiB stays free, until that server stops; both servers on their default flags), uncapped;
# SETTING:JOB,JOB runs that setting with its own distilled jobs (e.g. cap10:2048_s42).
# Parts, in this order on each server (a part's first job is cold only if nothing ran before it on that server):
#   GGUF=1   bench/peer_gguf.py: klein-9B Q4_K GGUF files (bench/gguf_step.py --write) through ComfyUI-GGUF's loaders
#            on ComfyUI (the pack from .whl/comfyui_gguf.tar.xz) and ours, 1024², cold then warm x2 -> $OUT/peer_gguf.json
#   BASE=1   bench/peer_base.py: the base template's graph (20 steps, CFG 5, negative ""), cold 1024², warm 1024²,
#            warm 2048² (BASE_JOBS=...) -> $OUT/peer_base.json (ratios, per-step seconds, pixel differences)
#   JOBS     the shared client's distilled jobs (default 1024_s42,1024_s43,1024_s44,512_s42,2048_s42;
#            JOBS= or JOBS=none: none) -> $OUT/peer_compare.json
#   QUEUES   the queue of 8 at 1024² (bench/peer_queue.py) on the settings named (default all; QUEUES=none: none)
#   LORAS=1  bench/peer_lora.py: two stacked random LoRAs, 1024², cold and warm, and without -> $OUT/peer_lora.json
#   SAMPLER_PAIRS=1 (uncapped), PACK=0 (skip our pack's check inside ComfyUI, uncapped)
# GGUF_IN, BASE_IN, LORAS_IN="card8 card12": run that part on those settings only (default: all).
# FP8=1: the transformer file is quantized to fp8 as ComfyUI stores it before either server starts.
# Time: BUDGET_S (default 540) bounds the whole run; every part runs under a timeout cut to what is left, a part
# with no time left is skipped; comparing and packing the logs always happen. Any failed, timed-out or skipped
# part is listed at the end and the script exits 1.
set -u -o pipefail
shopt -s nullglob
SETTINGS=${1:-"cap12 uncapped"}
ALL_JOBS=${JOBS-1024_s42,1024_s43,1024_s44,512_s42,2048_s42}
[ "$ALL_JOBS" = none ] && ALL_JOBS=
BUDGET_S=${BUDGET_S:-540}
T=${PEER_TMP:-/tmp}  # where everything is unpacked, written and logged
W=${WHL:-.whl}  # the carry
TINY=${PEER_TINY:+--tiny}  # PEER_TINY=1: tiny models on the CPU (bench/peer_dry_run.sh checks this script)
R=$(pwd)
L=$T/peerlogs
P=$T/pngs
M=$T/ck/comfyui/models
OUT=${OUT:-$T/out}
mkdir -p $L $P $OUT $T/emptyfe $T/cbase/custom_nodes $T/pkgs
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore
FAILED=()
RAN=0
fail() { FAILED+=("$*"); echo "== t=$(el) FAILED: $*"; }

# part NAME SECONDS CMD...: CMD under a timeout cut to what the budget leaves (30 s kept for comparing and packing),
# its output in $L/NAME.log (tail shown); a non-zero exit, a timeout or no time left is a failed part.
part() {
  local name=$1 secs=$2 left rc
  shift 2
  left=$(( BUDGET_S - 30 - $(el) ))
  [ "$left" -lt "$secs" ] && secs=$left
  if [ "$secs" -lt 10 ]; then fail "$name: skipped, the ${BUDGET_S} s budget is spent"; return 1; fi
  timeout -k 5 "$secs" "$@" > "$L/$name.log" 2>&1
  rc=$?
  tail -n "${TAIL:-6}" "$L/$name.log"
  if [ $rc -ne 0 ]; then fail "$name (exit $rc$([ $rc -eq 124 ] && echo ", timed out after $secs s"))"; fi
  return $rc
}

# wanted FLAG SETTING: part FLAG is on (FLAG=1) and meant for SETTING (FLAG_IN empty or naming it)
wanted() {
  local in_var=${1}_IN
  [ "${!1:-}" = 1 ] && { [ -z "${!in_var:-}" ] || [[ " ${!in_var} " == *" $2 "* ]]; }
}
queue_wanted() { [ -z "${QUEUES:-}" ] || [[ " $QUEUES " == *" $1 "* ]]; }

finish() {  # always: the comparisons of what ran, the logs tarball, the failed parts; exit 1 if any
  local rc=$?
  trap - EXIT
  echo "== t=$(el) comparing"
  export PYTHONPATH=$T/pkgs:$T/site
  if [ $RAN = 1 ]; then
    [ -n "${SAMPLER_PAIRS:-}" ] && { timeout 120 python3 bench/peer_samplers.py compare $P comfy ours $OUT/peer_samplers.json || fail "samplers compare"; }
    [ "${LORAS:-}" = 1 ] && { timeout 60 python3 bench/peer_lora.py compare $L comfy ours $OUT/peer_lora.json || fail "lora compare"; }
    [ "${BASE:-}" = 1 ] && { timeout 120 python3 bench/peer_base.py compare $L $OUT/peer_base.json || fail "base compare"; }
    [ "${GGUF:-}" = 1 ] && { timeout 120 python3 bench/peer_gguf.py compare $L $OUT/peer_gguf.json || fail "gguf compare"; }
    local res=($L/results_*_*.json)  # the shared client's jobs ran (JOBS, or SETTING:JOB,...)
    [ ${#res[@]} -gt 0 ] && { timeout 120 python3 bench/peer_compare.py $L $P $OUT/${NAME:-peer_compare}.json || fail "compare"; }
  fi
  cp $L/page_cache.log $L/hold_*.json $OUT/ 2>/dev/null
  (cd $T && tar -czf $OUT/peer_logs.tgz --exclude='*.png' peerlogs)  # the logs in one file (PNGs are too big)
  if [ ${#FAILED[@]} -gt 0 ]; then
    echo "== FAILED parts (${#FAILED[@]}):"
    printf '   %s\n' "${FAILED[@]}" | tee $OUT/failed.txt
    rc=1
  fi
  echo "== t=$(el) end (exit $rc)"
  exit $rc
}
trap finish EXIT

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $T/site $W/wheels/*.whl \
  || { fail "pip install"; exit 1; }
if [ "${GGUF:-}" = 1 ]; then  # the gguf package for ComfyUI-GGUF and for ours, the pack into ComfyUI's custom_nodes
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $T/site $W/gguf-*.whl \
    && tar -xJf $W/comfyui_gguf.tar.xz -C $T/cbase/custom_nodes && cat $T/cbase/custom_nodes/ComfyUI-GGUF/COMMIT \
    || { fail "GGUF=1 needs $W/gguf-*.whl and $W/comfyui_gguf.tar.xz (bash bench/peer_gguf_prepare.sh)"; exit 1; }
fi
tar -xJf $W/wheels/comfy_kitchen-0.2.24.tar.xz -C $T/site
tar -xJf $W/comfy.tar.xz -C $T
ln -sfn "$R" $T/pkgs/vramgraph
export PYTHONPATH=$T/site
echo "== t=$(el) making checkpoints"
if [ "${GGUF:-}" = 1 ]; then  # on the CPU beside make_checkpoints on the GPU
  PYTHONPATH=$T/pkgs:$T/site timeout 300 python3 bench/gguf_step.py --write $M --variant klein-9b --types Q4_K $TINY \
    > $L/gguf_write.log 2>&1 &
  gguf_pid=$!
fi
timeout 300 python3 $W/ckpt_script/make_checkpoints.py $T/ck --full --device cuda --dtype bf16 --comfy-only > $L/make_checkpoints.log 2>&1 \
  || { tail -20 $L/make_checkpoints.log; fail "make_checkpoints"; exit 1; }
if [ "${GGUF:-}" = 1 ]; then
  wait $gguf_pid || { cat $L/gguf_write.log; fail "gguf_step.py --write"; exit 1; }
  cat $L/gguf_write.log
fi
if [ "${FP8:-}" = 1 ]; then  # the transformer as ComfyUI stores fp8 files (block linears e4m3fn, weight_scale), same name
  t=$M/diffusion_models/flux-2-klein-4b.safetensors
  python3 $W/peer/quantize_fp8.py $t $T/fp8.safetensors > $L/quantize_fp8.log 2>&1 || { cat $L/quantize_fp8.log; fail "quantize_fp8"; exit 1; }
  mv $T/fp8.safetensors $t; cat $L/quantize_fp8.log
fi
if [ "${LORAS:-}" = 1 ]; then
  PYTHONPATH=$T/pkgs:$T/site python3 bench/peer_lora.py files $M $TINY || { fail "peer_lora.py files"; exit 1; }
fi
ls -la $M/*/
ln -sfn $M $T/cbase/models
cp $W/peer/peer_probe.py $T/cbase/custom_nodes/
NVML_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print $1/1024}')
echo "== t=$(el) checkpoints done"

# "Cold" = a fresh server process with the checkpoint files in the OS file cache, the same for both tools:
# the writes of make_checkpoints are flushed (not left to write back under the first server) and every file
# is read once before each server starts; page_cache.log records the memory each start found.
prewarm() {
  sync
  cat $M/*/*.safetensors $M/*/*.gguf > /dev/null 2>&1
  { echo "== before $1"; free -g | head -2; fincore $M/*/*.safetensors $M/*/*.gguf 2>&1; } >> $L/page_cache.log
}

# hold GIB LABEL: bench/hold_memory.py leaves GIB - 0.25 GiB of the device free until `unhold` (HOLD_PID)
hold() {
  local i
  rm -f $L/hold_$2.json
  python3 bench/hold_memory.py --card-gib "$1" --out $L/hold_$2.json ${PEER_TINY:+--fake-device-gib 80} > $L/hold_$2.log 2>&1 &
  HOLD_PID=$!
  for i in $(seq 240); do
    if [ -s $L/hold_$2.json ]; then tail -1 $L/hold_$2.log; return 0; fi
    kill -0 $HOLD_PID 2>/dev/null || break
    sleep 0.25
  done
  fail "hold $2: $(tail -2 $L/hold_$2.log | tr '\n' ' ')"
  unhold
  return 1
}
unhold() { [ -n "${HOLD_PID:-}" ] && { kill $HOLD_PID 2>/dev/null; wait $HOLD_PID 2>/dev/null; }; HOLD_PID=; }

wait_down() { kill $1 2>/dev/null; sleep 2; kill -9 $1 2>/dev/null; wait $1 2>/dev/null; }

# server TOOL SETTING [ARGS...]: start TOOL's server with ARGS (comfy: ComfyUI on COMFY_PORT, default 8188; ours:
# vramgraph serve on OURS_PORT, 8189), after the holder with HOLD=GIB; run the parts wanted for SETTING; stop it
# (then the holder).
server() {
  local tool=$1 setting=$2 label=${1}_$2 port pid c
  shift 2
  if [ $(( BUDGET_S - 30 - $(el) )) -lt 60 ]; then fail "$label: not started, the ${BUDGET_S} s budget is spent"; return 1; fi
  prewarm $label
  if [ -n "${HOLD:-}" ]; then hold "$HOLD" $label || return 1; fi
  echo "== t=$(el) $label: $*"
  if [ $tool = comfy ]; then
    port=${COMFY_PORT:-8188}
    COMFY_DIR=$T/comfy STUB_MODULES=av python3 $W/peer/run_comfy.py --disable-api-nodes --front-end-root $T/emptyfe \
      --base-directory $T/cbase --disable-auto-launch --port $port "$@" > $L/server_$label.log 2>&1 &
  else
    port=${OURS_PORT:-8189}
    PYTHONPATH=$T/pkgs:$T/site python3 -m vramgraph serve --port $port --models $M --output $T/ours_out \
      --input $T/ours_in --plugin bench/peer_routes.py ${PEER_TINY:+--device cpu} "$@" > $L/server_$label.log 2>&1 &
  fi
  pid=$!
  RAN=1
  c="--port $port --label $label --pid $pid"
  if part wait_$label 160 python3 bench/peer_client.py wait --port $port --pid $pid --timeout 150 \
       --record $L/ready_$label.json; then
    wanted GGUF $setting && { echo gguf >> $L/order_$label.txt; part gguf_$label 300 python3 bench/peer_gguf.py run $c --out $L --png $P $TINY; }
    wanted BASE $setting && { echo base >> $L/order_$label.txt
      part base_$label 300 python3 bench/peer_base.py run $c --out $L --png $P ${BASE_JOBS:+--jobs $BASE_JOBS} $TINY; }
    [ -n "$JOBS" ] && { echo bench >> $L/order_$label.txt
      part bench_$label 300 python3 $W/peer/peer_bench.py $c --out $P --results $L/results_$label.json --wait 150 --jobs $JOBS; }
    queue_wanted $setting && part queue_$label 200 python3 bench/peer_queue.py --port $port --label $label --out $L
    wanted LORAS $setting && part lora_$label 400 python3 bench/peer_lora.py run --port $port --label $label --out $L ${PEER_TINY:+--side 64}
    if [ -n "${SAMPLER_PAIRS:-}" ] && [ "$setting" = uncapped ]; then  # same picture per sampler/scheduler pair
      part samplers_$label 400 python3 bench/peer_samplers.py run --port $port --label $tool --out $P
    fi
    if [ "${PACK_CHECK:-}" = "$label" ]; then
      part pack_check 200 python3 bench/comfy_pack_check.py --port $port --out $L/pack_check.json
    fi
  fi
  wait_down $pid
  unhold
  grep -E "vramgraph|Traceback|Error" $L/server_$label.log | grep -v "comfy_kitchen backend" | grep -v "No module named" | head -20
  return 0
}

# SAMPLER_PAIRS=1 (with the uncapped setting): KSampler for every sampler/scheduler pair on both servers
# (bench/peer_samplers.py: 512², 6 steps, seed 42); $OUT/peer_samplers.json has each pair's picture difference.
for s in $SETTINGS; do
  setting=${s%%:*}
  JOBS=$ALL_JOBS; [ "$setting" != "$s" ] && JOBS=${s#*:}
  if ! [[ $setting =~ ^((cap|card)[0-9]+|uncapped)$ ]]; then fail "unknown setting $s (capN, cardN, uncapped)"; continue; fi
  case $setting in
    cap*)     n=${setting#cap}
              PEER_CAP_GIB=$n server comfy $setting --reserve-vram $(python3 -c "print(round($NVML_GIB - $n + 1.2, 3))")
              server ours $setting --vram ${n}GiB ;;
    card*)    n=${setting#card}  # both on their default flags: only the free memory says the card's size
              HOLD=$n server comfy $setting
              HOLD=$n server ours $setting ;;
    uncapped) ln -sfn "$R" $T/cbase/custom_nodes/vramgraph
              if [ "${PACK:-1}" = 1 ]; then PACK_CHECK=comfy_uncapped server comfy uncapped; else server comfy uncapped; fi
              rm -rf $T/cbase/custom_nodes/vramgraph
              server ours uncapped ;;
  esac
done
exit 0  # finish (the EXIT trap) compares, packs and says which parts failed
