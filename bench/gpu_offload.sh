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
for M in ${MODELS:-1.3b 14b}; do
  if [ "$M" = 1.3b ]; then
    MODES=("resident: $OFF" "layerwise: " "block-n2: --num-blocks-per-group 2" "block-n4: --num-blocks-per-group 4"
      "depth2: --prefetch-depth 2" "no-stream: --offload-stream=false" "bounded-1g: --max-pinned-memory 1GiB"
      "no-pin: --pin-cpu-memory=false" "sequential: --sequential-cpu-offload" "parked: --dit-layerwise-offload=false"
      "resident-again: $OFF" "vae-resident: --vae-cpu-offload=false" "vae-parked: --vae-cpu-offload")
  else
    MODES=("resident: $OFF" "layerwise: " "bounded-2g: --max-pinned-memory 2GiB" "no-stream: --offload-stream=false")
  fi
  /usr/bin/time -v $B synthetic:wan2.1-t2v-$M "$N" 81x480x832 "${MODES[@]}" > "$OUT/offload-$M.jsonl" 2> "$OUT/offload-$M.log"
  echo "== $M: exit $?"; cat "$OUT/offload-$M.jsonl"; grep -E "wrote|Maximum resident|Elapsed" "$OUT/offload-$M.log"
  rm -rf /dev/shm/vidgen-bench
done
