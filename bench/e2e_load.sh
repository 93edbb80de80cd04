#!/usr/bin/env bash
# Loading at link speed, A/B in one call on the GPU machine: two vidgen binaries load and run the
# same on-disk synthetic Wan2.1 checkpoint (bf16, diffusers layout, in /dev/shm: the page cache's
# speed), resident and with vidgen's default streaming, and their frames are compared bit for bit.
#   bench/e2e_load.sh NEW_VIDGEN OLD_VIDGEN OUT_DIR [MODEL_ASSETS]
# Needs the peer's checkpoint writer (../shared/peer/wan_e2e_bench.py, copied next to this script
# as wan_e2e_bench.py) and the diffusers 0.42.1 wheel in .whl/.
set -euo pipefail
NEW=$1; OLD=$2; OUT=$3; ASSETS=${4:-assets/wan2.1-t2v-1.3b}
CKPT=/dev/shm/wan-e2e
mkdir -p "$OUT" /tmp/e2e-videos
python3 -m pip install -q --no-deps --target /tmp/dl .whl/diffusers-*.whl >/dev/null 2>&1
PYTHONPATH=/tmp/dl:$(dirname "$0") python3 -c "import wan_e2e_bench as w; w.write_checkpoint('$ASSETS', '$CKPT')"
RESIDENT="--no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload"
run() { # label binary flags...
  local label=$1 bin=$2; shift 2
  local start=$(date +%s.%N)
  "$bin" generate --model "$CKPT" --prompt "a red fox runs through fresh snow" --seed 1 \
    --num-frames 9 --num-inference-steps 2 --device cuda --output-type safetensors \
    --output-path /tmp/e2e-videos --output-video-name "$label" --overwrite \
    --stats-json "/tmp/e2e-videos/$label.json" "$@" 2> "/tmp/e2e-videos/$label.log" >/dev/null \
    || { echo "== $label FAILED:"; tail -3 "/tmp/e2e-videos/$label.log"; return 0; }
  local end=$(date +%s.%N)
  echo "== $label: process $(awk "BEGIN{printf \"%.2f\", $end - $start}") s"
  grep -E "^loaded|forwards" "/tmp/e2e-videos/$label.log" || true
}
{
  for round in 1 2; do
    run "new-resident-$round" "$NEW" $RESIDENT
    run "old-resident-$round" "$OLD" $RESIDENT
  done
  run new-default "$NEW"
  run new-leaf "$NEW" --offload-type leaf-level
  run old-default "$OLD"
  for extra in ${EXTRA_RUNS:-}; do run "new-$extra" "$NEW" $RESIDENT; done
  python3 - <<'PY'
from safetensors.numpy import load_file
import numpy as np
d = "/tmp/e2e-videos/"
ref = load_file(d + "old-resident-1.safetensors")["frames"]
import os
for label in ["new-resident-1", "new-resident-2", "old-resident-2", "new-default", "new-leaf", "old-default"]:
    if not os.path.exists(d + label + ".safetensors"):
        print(f"{label}: no output")
        continue
    f = load_file(d + label + ".safetensors")["frames"]
    print(f"{label}: max |frames - old-resident-1| = {np.abs(f - ref).max()}, identical {np.array_equal(f, ref)}")
PY
} 2>&1 | tee "$OUT/e2e_load.txt"
