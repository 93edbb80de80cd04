#!/usr/bin/env bash
# Issue 4's table in one device call (see bench/RESULTS.md): every placement mode of synthetic
# Wan2.1 at 480x832x81 bf16, one process per model so its modes run side by side. The synthetic
# weights are first written as safetensors to /dev/shm, so every mode loads them the way it
# would load a downloaded checkpoint that sits in the page cache (setup times are real).
#   bash bench/gpu_offload.sh            # both models, 2 timed forwards per mode after a warm-up
# Run from the repository root on the GPU machine with the CUDA build of the offload_bench
# example at .device/offload_bench.
set -u
N=${N:-2}
OUT=${OUT:-/tmp/vidgen-bench}
mkdir -p "$OUT"
export VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench
B=./.device/offload_bench
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
OFF="--dit-layerwise-offload=false --dit-cpu-offload=false"
# 1. Every placement mode on CUDA gives the resident frames bit for bit (tiny fixture, f32, CFG 5),
#    and the resident frames match diffusers'.
[ -f bench/pin_cost.py ] && [ -z "${NO_PIN_COST:-}" ] && python3 bench/pin_cost.py 8
if [ -x .device/vidgen ] && [ -z "${NO_TINY:-}" ]; then
  P=$(python3 -c 'import json;print(json.load(open("tests/fixtures/wan-tiny-a/reference/README.json"))["files"]["pipeline.safetensors"]["inputs"]["prompt"])')
  tiny() {  # name, flags...
    local name=$1; shift
    .device/vidgen generate --model tests/fixtures/wan-tiny-a --prompt "$P" --negative-prompt "blurry, static, low quality" \
      --height 32 --width 32 --num-frames 9 --num-inference-steps 3 --guidance-scale 5 --max-sequence-length 20 \
      --latents .device/latents_init.safetensors --device cuda --dtype f32 --output-type safetensors \
      --output-path "$OUT/tiny" --output-video-name "$name" --overwrite "$@" > /dev/null 2> "$OUT/tiny-$name.log" || echo "tiny $name: exit $?"
  }
  tiny resident $OFF --text-encoder-cpu-offload=false --vae-cpu-offload=false
  python3 bench/compare_frames.py "$OUT/tiny/resident.safetensors" tests/fixtures/wan-tiny-a/reference/pipeline.safetensors cfg5.frames
  tiny layerwise; tiny n2-depth2 --num-blocks-per-group 2 --prefetch-depth 2; tiny no-stream --offload-stream=false
  tiny no-pin --pin-cpu-memory=false; tiny bounded --max-pinned-memory 1MiB; tiny parked --dit-layerwise-offload=false
  tiny te-cpu --text-encoder-compute cpu; tiny model-offload --model-cpu-offload; tiny sequential --sequential-cpu-offload
  tiny leaf-level --offload-type leaf-level; tiny lazy --lazy-module-load; tiny h3-sequential --h3-sequential-load
  python3 - "$OUT/tiny" <<'PY'
import sys, glob, os
from safetensors.numpy import load_file
d = sys.argv[1]; ref = load_file(f"{d}/resident.safetensors")["frames"]
for f in sorted(glob.glob(f"{d}/*.safetensors")):
    x = load_file(f)["frames"]
    print(f"tiny cuda {os.path.basename(f)[:-12]:14s} identical to resident: {bool((x == ref).all())}")
PY
  grep -h "transformer:\|text_encoder:\|vae:" "$OUT"/tiny-*.log | sort | uniq -c
fi
# 2. The offload table.
for M in ${MODELS:-1.3b 14b}; do
  if [ "$M" = 1.3b ]; then
    MODES=("resident: $OFF" "layerwise: " "block-n2: --num-blocks-per-group 2" "block-n4: --num-blocks-per-group 4"
      "no-stream: --offload-stream=false" "no-stream-n2: --offload-stream=false --num-blocks-per-group 2"
      "no-stream-n4: --offload-stream=false --num-blocks-per-group 4" "depth2: --prefetch-depth 2"
      "leaf-level: --offload-type leaf-level" "bounded-1g: --max-pinned-memory 1GiB" "no-pin: --pin-cpu-memory=false"
      "sequential: --sequential-cpu-offload" "parked: --dit-layerwise-offload=false"
      "vae-resident: --vae-cpu-offload=false" "vae-parked: --vae-cpu-offload")
  else
    MODES=("resident: $OFF" "layerwise: " "leaf-level: --offload-type leaf-level" "bounded-2g: --max-pinned-memory 2GiB"
      "no-stream: --offload-stream=false")
  fi
  /usr/bin/time -v $B synthetic:wan2.1-t2v-$M "$N" 81x480x832 "${MODES[@]}" > "$OUT/offload-$M.jsonl" 2> "$OUT/offload-$M.log"
  echo "== $M: exit $?"; cat "$OUT/offload-$M.jsonl"; grep -E "wrote|Maximum resident|Elapsed" "$OUT/offload-$M.log"
  rm -rf /dev/shm/vidgen-bench
done
# 3. diffusers on the same GPU in the same call (../shared/peer's script, 1.3B resident and block-level
#    stream modes only: the budget), for the side-by-side ratio.
if [ -f .device/wan_offload_bench.py ] && [ -n "${PEER:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl && export PYTHONPATH=/tmp/site
  python3 .device/wan_offload_bench.py --out "$OUT/peer" --skip "${PEER_SKIP:-bw,sdpa,big,seq}" --budget-s "${PEER_BUDGET:-75}" > "$OUT/peer.log" 2>&1
  echo "== peer: exit $?"; cat "$OUT/peer/results.md"
fi
