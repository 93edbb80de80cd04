#!/usr/bin/env bash
# Issue 16's whole HunyuanVideo video at the published 720x1280x129 with default flags, in one device call:
# synthetic:hunyuanvideo, STEPS steps (default 2), bf16, safetensors output (the GPU machines have no FFmpeg),
# the per-stage device peaks and forward times from --stats-json beside the dry run's prediction for the
# same flags (an under-predicted stage is marked).
# PARTS=tiny (in the default "tiny video") first runs the tiny fixture on CUDA in f32 from the fixture's
# draws: frames against diffusers' (cfg1 and truecfg4 runs), and the streamed modes bit-identical to resident.
#   bash bench/hunyuan_video.sh PATH/TO/vidgen         (OUT=... for the JSON and logs)
set -u
B=${1:?path to a CUDA build of vidgen}
O=${OUT:-/tmp/vidgen-hunyuan}
STEPS=${STEPS:-2}
PARTS=${PARTS:-"tiny video"}
mkdir -p "$O"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
F=tests/fixtures/hunyuanvideo-tiny-a
if [[ " $PARTS " == *" tiny "* ]]; then
python3 - "$F" "$O" <<'PY'
import sys
from safetensors.numpy import load_file, save_file
f, o = sys.argv[1:]
save_file({"latents": load_file(f"{f}/reference/pipeline.safetensors")["latents_init"]}, f"{o}/draws.safetensors")
PY
{ read -r PROMPT; read -r NEG; } < <(python3 -c "import json;p=json.load(open('$F/reference/README.json'))['preset'];print(p['prompts'][p['pipeline_prompt_index']]);print(p['negative_prompt'])")
tiny() { # name true-cfg flags...
  local n=$1 c=$2; shift 2
  $B generate --model $F --prompt "$PROMPT" --negative-prompt "$NEG" --height 32 --width 48 --num-frames 17 \
    --num-inference-steps 3 --guidance-scale 6 --true-cfg-scale $c --max-sequence-length 16 \
    --latents "$O/draws.safetensors" --device cuda --dtype f32 --output-type safetensors --output-path "$O/tiny" \
    --output-video-name $n --overwrite "$@" > /dev/null 2> "$O/tiny-$n.log" && echo "ok   tiny $n" || { echo "FAIL tiny $n $*"; grep -i error "$O/tiny-$n.log" | head -3; }
}
OFF="--memory-model discrete --no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload"
tiny cfg1 1 $OFF
tiny truecfg4 4 $OFF
tiny cfg1-layerwise 1 --memory-model discrete
tiny cfg1-leaf 1 --memory-model discrete --offload-type leaf-level
tiny cfg1-lazy 1 --memory-model discrete --lazy-module-load
python3 - "$O/tiny" "$F" <<'PY'
import sys, glob, numpy as np
from safetensors.numpy import load_file
d, f = sys.argv[1:]
ref = load_file(f"{f}/reference/pipeline.safetensors")
for tag in ["cfg1", "truecfg4"]:
    got, want = load_file(f"{d}/{tag}.safetensors")["frames"], ref[f"{tag}.frames"][0]
    diff = np.abs(got - want); tol = 1e-4 + 1e-4 * np.abs(want)
    print(f"tiny f32 cuda {tag} frames: max |diff| {diff.max():.3e}, within the fixture's 1e-4 tolerance: {(diff <= tol).all()}")
res = load_file(f"{d}/cfg1.safetensors")["frames"]
for p in sorted(glob.glob(f"{d}/cfg1-*.safetensors")):
    print(f"{p.split('/')[-1]}: bit-identical to resident: {np.array_equal(load_file(p)['frames'], res)}")
PY
fi
[[ " $PARTS " == *" video "* ]] || exit 0
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
