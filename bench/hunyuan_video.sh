#!/usr/bin/env bash
# Issue 16's whole HunyuanVideo video at the published 720x1280x129 with default flags, in one device call:
# synthetic:hunyuanvideo, STEPS steps (default 2), bf16, safetensors output (the GPU machines have no FFmpeg),
# the per-stage device peaks and forward times from --stats-json beside the dry run's prediction for the
# same flags (an under-predicted stage is marked).
#   bash bench/hunyuan_video.sh PATH/TO/vidgen         (OUT=... for the JSON and logs)
set -u
B=${1:?path to a CUDA build of vidgen}
O=${OUT:-/tmp/vidgen-hunyuan}
STEPS=${STEPS:-2}
mkdir -p "$O"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ARGS=(--model synthetic:hunyuanvideo --prompt "a cat walks on the grass" --seed 1 --num-inference-steps $STEPS
  --device cuda --dtype bf16)
$B generate "${ARGS[@]}" --dry-run --json > "$O/plan.json" 2> "$O/plan.log" || { echo "FAIL dry run"; head -3 "$O/plan.log"; }
/usr/bin/time -v $B generate "${ARGS[@]}" --output-path /tmp/vidgen-hunyuan-out --output-type safetensors \
  --output-video-name hy720 --overwrite --stats-json "$O/hy720.json" > /dev/null 2> "$O/hy720.log" \
  && echo "ok   hy720" || { echo "FAIL hy720"; grep -i error "$O/hy720.log" | head -3; }
grep -E "Maximum resident|Elapsed" "$O/hy720.log"
grep -E "prompt \"" "$O/hy720.log"
python3 - "$O" <<'PY'
import json, sys
o = sys.argv[1]
try:
    plan = {s["name"]: s["memory"] for s in json.load(open(f"{o}/plan.json"))["stages"]}
    job = json.load(open(f"{o}/hy720.json"))["jobs"][0]
except Exception as e:
    sys.exit(f"no plan or stats: {e}")
m = job.get("metrics", {})
print("forwards (s):", ["%.2f" % x for x in m.get("forward_seconds", [])])
print("stage, predicted peak / measured device used peak / reserved (GiB)")
for name, p in m.get("stages", {}).items():
    want = plan.get(name, {}).get("peak_bytes", 0) / 2**30
    got, res = p["device_used_peak"] / 2**30, p["device_reserved_peak"] / 2**30
    print(f"  {name:12} {want:6.2f} / {got:6.2f} / {res:6.2f}{'  (under-predicted)' if got > want else ''}")
PY
