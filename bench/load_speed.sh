#!/usr/bin/env bash
# Loading at link speed (issue 11 item 4), old binary against new in ONE device call: a full-size
# synthetic Wan2.1 14B checkpoint (bf16, diffusers layout) is written once to $CKPT (default
# /dev/shm; a disk path measures a disk file's page cache, as a downloaded checkpoint that was
# read before), then each binary generates
# from it with every component resident, interleaved new/old twice, and once with the default
# flags (layerwise streaming: the outer parts load resident, the blocks stream).
# Reports per run: each component's load time and GB/s (stored bytes / "loaded X in" time, which
# waits for the device), the time from process start to the end of the first denoising step and
# to the start of the denoise stage, the first forward's time; then whether every run's frames
# are bit-identical to the old binary's resident frames.
#   bash bench/load_speed.sh NEW_VIDGEN OLD_VIDGEN OUT_DIR
# Binaries may be given xz-compressed (NAME.xz): they are unpacked next to themselves. With
# LIB_TESTS=PATH (the new build's lib test binary), its staging tests run first on the GPU
# (offload::staging: the ring against candle's own loading, bit for bit).
# Needs ../shared/peer/wan_e2e_bench.py copied to .device/wan_e2e_bench.py (the checkpoint writer)
# and the diffusers 0.42.1 wheel in .whl/ (carry both).
set -euo pipefail
NEW=$1; OLD=$2; OUT=$3
CKPT=${CKPT:-/dev/shm/wan14b-load}
ASSETS=assets/wan2.1-t2v-14b
mkdir -p "$OUT" /tmp/load-videos
for b in "$NEW" "$OLD"; do
  [ -x "$b" ] || { xz -dkf "$b.xz" && chmod +x "$b"; }
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /dev/shm | tail -1
if [ -n "${LIB_TESTS:-}" ]; then
  [ -x "$LIB_TESTS" ] || { xz -dkf "$LIB_TESTS.xz" && chmod +x "$LIB_TESTS"; }
  "$LIB_TESTS" offload::staging 2>&1 | tail -12 | tee "$OUT/staging_tests.txt"
fi
python3 -m pip install -q --no-deps --target /tmp/dl .whl/diffusers-*.whl >/dev/null 2>&1
start=$(date +%s.%N)
PYTHONPATH=/tmp/dl:.device python3 -c "import wan_e2e_bench as w; w.write_checkpoint('$ASSETS', '$CKPT')"
# Written back to disk first: page-locking dirty pages of a just-written file waits for their
# writeback (a downloaded checkpoint is long written back when it is used).
sync
echo "checkpoint ready in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}") s: $(du -sh "$CKPT" | cut -f1)"
bytes() { stat -c %s "$CKPT/$1"/*.safetensors | awk '{ s += $1 } END { print s }'; }
declare -A SIZE=([text_encoder]=$(bytes text_encoder) [transformer]=$(bytes transformer) [vae]=$(bytes vae))
RESIDENT="--no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload"
run() { # label binary flags...
  local label=$1 bin=$2; shift 2
  local log=$OUT/$label.log t0
  t0=$(date +%s.%N)
  # Every stderr line stamped with the seconds since the process started.
  "$bin" generate --model "$CKPT" --prompt "a red fox runs through fresh snow" --seed 1 \
    --height 480 --width 832 --num-frames 5 --num-inference-steps 2 --device cuda \
    --output-type safetensors --output-path /tmp/load-videos --output-video-name "$label" \
    --overwrite --stats-json "$OUT/$label.json" "$@" 2>&1 >/dev/null \
    | python3 -u -c 'import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    print(f"{time.time() - t0:8.3f} {line}", end="")' "$t0" > "$log" \
    || { echo "== $label FAILED:"; tail -3 "$log"; return 0; }
  echo "== $label: process $(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $t0}") s"
  for c in text_encoder transformer vae; do
    awk -v c="$c" -v bytes="${SIZE[$c]}" '$2 == "loaded" && $3 == c {
      s = $5; sub(/s:$/, "", s)
      printf "  %-12s %6.2f GB in %6.2f s: %6.1f GB/s\n", c, bytes / 1e9, s, bytes / 1e9 / s }' "$log"
  done
  awk '/\] denoise/ && !d { printf "  denoise stage starts at %.2f s after process start\n", $1; d = 1 }
       /step 1\// && !s { printf "  first step done at %.2f s after process start\n", $1; s = 1 }
       /transformer forwards:/ { sub(/^ *[0-9.]+ +/, ""); print "  " $0 }' "$log"
}
{
  for round in 1 2; do
    run "new-resident-$round" "$NEW" $RESIDENT
    run "old-resident-$round" "$OLD" $RESIDENT
  done
  run new-default "$NEW"
  run old-default "$OLD"
  python3 - <<'PY'
import os
from safetensors.numpy import load_file
import numpy as np
d = "/tmp/load-videos/"
ref = load_file(d + "old-resident-1.safetensors")["frames"]
for label in ["new-resident-1", "new-resident-2", "old-resident-2", "new-default", "old-default"]:
    if not os.path.exists(d + label + ".safetensors"):
        print(f"{label}: no output")
        continue
    f = load_file(d + label + ".safetensors")["frames"]
    print(f"{label}: max |frames - old-resident-1| = {np.abs(f - ref).max()}, identical {np.array_equal(f, ref)}")
PY
} 2>&1 | tee "$OUT/load_speed.txt"
