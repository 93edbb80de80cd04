#!/usr/bin/env bash
# Two builds of vidgen, every family's whole run side by side on one GPU, in one call: the stage
# times and forward times of each (`--stats-json`), rounds interleaved (clocks drift), and whether
# the two wrote the same frames (seeded draws, default flags, bf16). Each pair is reported as soon
# as it has run.
#   bash bench/before_after.sh OLD_VIDGEN NEW_VIDGEN [ROUNDS]
# Run from the repository root; writes $OUT (or /tmp/before-after).
set -u
OLD=$1 NEW=$2 ROUNDS=${3:-2}
O=${OUT:-/tmp/before-after}
mkdir -p "$O"
run() { # tag binary model size steps
  local tag=$1 bin=$2 model=$3 size=$4 steps=$5
  IFS=x read -r f h w <<< "$size"
  "$bin" generate --model "$model" --prompt "a red fox runs through fresh snow" --seed 1 \
    --num-frames "$f" --height "$h" --width "$w" --num-inference-steps "$steps" --dtype bf16 \
    --output-type safetensors --output-path "$O" --output-video-name "$tag" --overwrite --quiet \
    --stats-json "$O/$tag.json" 2> "$O/$tag.log" || { echo "FAIL $tag"; tail -3 "$O/$tag.log"; }
}
report() { # family round
  python3 - "$O" "$1" "$2" <<'PY'
import json, sys, os
import numpy as np
from safetensors.numpy import load_file
o, fam, r = sys.argv[1:4]
lines = []
for v in ["old", "new"]:
    p = f"{o}/{fam}-{v}-{r}.json"
    if not os.path.exists(p):
        lines.append(f"{v}: no stats"); continue
    job = json.load(open(p))["jobs"][0]
    fw = job["metrics"].get("forward_seconds", [])
    st = " ".join(f"{s['name']} {s['seconds']:.2f}" for s in job["stages"])
    lines.append(f"{v}: forwards {' '.join(f'{x:.3f}' for x in fw)} | {st} | total {job['seconds']:.2f}")
a, b = f"{o}/{fam}-old-{r}.safetensors", f"{o}/{fam}-new-{r}.safetensors"
same = "frames missing"
if os.path.exists(a) and os.path.exists(b):
    fa, fb = load_file(a)["frames"], load_file(b)["frames"]
    same = f"max |old-new| {np.abs(fa - fb).max():.3g} over {fa.shape}"
print(f"{fam} round {r}: {same}", *("    " + l for l in lines), sep="\n", flush=True)
PY
  rm -f "$O/$1-old-$2.safetensors" "$O/$1-new-$2.safetensors"
}
for r in $(seq "$ROUNDS"); do
  while read -r fam model size steps; do
    run "$fam-old-$r" "$OLD" "$model" "$size" "$steps"
    run "$fam-new-$r" "$NEW" "$model" "$size" "$steps"
    report "$fam" "$r"
  done <<'EOF'
wan synthetic:wan2.1-t2v-1.3b 81x480x832 3
ltx synthetic:ltx-video 161x512x704 3
cogvideox synthetic:cogvideox-5b 49x480x720 3
hunyuan synthetic:hunyuanvideo 61x320x512 3
EOF
done
