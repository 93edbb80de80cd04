#!/usr/bin/env bash
# Issue 4's table, in one device call per model (see bench/RESULTS.md): every placement mode of
# synthetic Wan2.1 at 480x832x81 bf16, one process per model so modes are compared side by side.
#   bash bench/gpu_offload.sh 1.3b 2     # model, timed forwards per mode (after one warm-up)
# Run from the repository root on the GPU machine with the CUDA build of the offload_bench
# example at .device/offload_bench.
set -u
M=${1:-1.3b}; N=${2:-2}
OUT=${OUT:-/tmp/vidgen-bench}
mkdir -p "$OUT"
B=./.device/offload_bench
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
OFF="--dit-layerwise-offload=false --dit-cpu-offload=false"
if [ "$M" = 1.3b ]; then
  MODES=("resident: $OFF" "layerwise: " "block-n2: --num-blocks-per-group 2" "block-n4: --num-blocks-per-group 4"
    "depth2: --prefetch-depth 2" "no-stream: --offload-stream=false" "bounded-2g: --max-pinned-memory 2GiB"
    "no-pin: --pin-cpu-memory=false" "sequential: --sequential-cpu-offload" "parked: --dit-layerwise-offload=false"
    "resident-again: $OFF" "vae-resident: --vae-cpu-offload=false" "vae-parked: --vae-cpu-offload")
else
  MODES=("resident: $OFF" "layerwise: " "bounded-2g: --max-pinned-memory 2GiB" "no-stream: --offload-stream=false")
fi
/usr/bin/time -v $B synthetic:wan2.1-t2v-$M "$N" 81x480x832 "${MODES[@]}" > "$OUT/offload-$M.jsonl" 2> "$OUT/offload-$M.log"
echo "exit $?"; cat "$OUT/offload-$M.jsonl"; grep -E "Maximum resident|Elapsed" "$OUT/offload-$M.log"; tail -5 "$OUT/offload-$M.log"
