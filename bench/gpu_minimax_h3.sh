#!/usr/bin/env bash
# Issue 14's GPU checks of MiniMax H3 in one device call. Run from the repository root on a GPU
# machine with a CUDA build of vidgen: bash bench/gpu_minimax_h3.sh PATH/TO/vidgen
#  1. the tiny fixture on CUDA (f32 against diffusers' frames and audio; bf16 finite), every
#     offload mode and load lever bit-identical to the resident CUDA run;
#  2. synthetic:minimax-h3 at the published size (768x1344, 124 frames = 5 s), STEPS points
#     (STEPS-1 forwards), bf16: default flags on the discrete H200 (layerwise DiT and encoder),
#     resident, and the DGX Spark rules (--memory-model unified); per-stage device peaks and
#     forward times from --stats-json; the outputs' lengths (safetensors). For the default flags, each
#     stage's measured device peak beside the dry run's prediction for the same flags, and the
#     issue's 8 GiB target checked per stage and on the whole run (PASS/FAIL lines).
# PARTS picks sections (default "tiny full"; "peer" adds diffusers' per-block time, after vidgen's own
# per-block time from examples/minimax_blocks when BLOCKS=PATH names its CUDA build), RUNS the full-size
# runs (default "default resident unified"); PARTS=full RUNS=default STEPS=2 measures the 8 GiB target alone.
set -u
B=${1:?path to a CUDA build of vidgen}
STEPS=${STEPS:-3}
O=${OUT:-/tmp/vidgen-minimax}
PARTS=${PARTS:-"tiny full"}
mkdir -p "$O"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
F=tests/fixtures/minimax-h3-tiny-a
if [[ " $PARTS " == *" tiny "* ]]; then
python3 - "$F" "$O" <<'PY'
import sys
from safetensors.numpy import load_file, save_file
f, o = sys.argv[1:]
r = load_file(f"{f}/reference/pipeline.safetensors")
save_file({"latents": r["latents_init"], "audio_latents": r["audio_latents_init"]}, f"{o}/draws.safetensors")
PY
P="A red car drives along a coastal road at sunset."
tiny() { # name dtype flags...
  local n=$1 d=$2; shift 2
  $B generate --model $F --prompt "$P" --height 16 --width 24 --num-frames 121 --num-inference-steps 4 \
    --latents "$O/draws.safetensors" --device cuda --dtype $d --output-type safetensors --output-path "$O/tiny" \
    --output-video-name $n --overwrite "$@" > /dev/null 2> "$O/tiny-$n.log" && echo "ok   tiny $n" || { echo "FAIL tiny $n $*"; grep -i error "$O/tiny-$n.log" | head -3; }
}
OFF="--memory-model discrete --no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload"
tiny resident f32 $OFF
tiny bf16 bf16
for m in "layerwise --memory-model discrete --dit-layerwise-offload --text-encoder-cpu-offload" \
         "leaf --memory-model discrete --offload-type leaf-level" "parked --memory-model discrete --model-cpu-offload" \
         "sequential-offload --memory-model discrete --sequential-cpu-offload" \
         "lazy --memory-model discrete --lazy-module-load" "h3seq --memory-model discrete --h3-sequential-load"; do
  tiny ${m%% *} f32 ${m#* }
done
python3 - "$O/tiny" "$F" <<'PY'
import sys, glob, numpy as np
from safetensors.numpy import load_file
d, f = sys.argv[1:]
ref = load_file(f"{f}/reference/pipeline.safetensors")
res = load_file(f"{d}/resident.safetensors")
for k, want in [("frames", ref["videos"][0]), ("audio", ref["audio"][0])]:
    diff = np.abs(res[k] - want); tol = 3e-5 + 3e-5 * np.abs(want)
    print(f"tiny f32 cuda {k}: max |diff| {diff.max():.3e}, within tolerance: {(diff <= tol).all()}")
for p in sorted(glob.glob(f"{d}/*.safetensors")):
    x = load_file(p)
    finite = all(np.isfinite(x[k]).all() for k in x)
    if p.endswith("/bf16.safetensors"):  # another dtype: finite is all it can show
        print(f"bf16.safetensors: finite {finite}")
        continue
    same = all(np.array_equal(x[k], res[k]) for k in ("frames", "audio"))
    print(f"{p.split('/')[-1]}: finite {finite}, bit-identical to resident: {same}")
PY

fi

full() { # name flags...
  local n=$1; shift
  /usr/bin/time -v $B generate --model synthetic:minimax-h3 --prompt "waves on a beach, gulls crying" --seed 1 \
    --num-inference-steps $STEPS --device cuda --dtype bf16 --output-path /tmp/vidgen-minimax-out --output-type safetensors --output-video-name $n --overwrite \
    --stats-json "$O/$n.json" "$@" > /dev/null 2> "$O/$n.log" && echo "ok   full $n" || { echo "FAIL full $n $*"; grep -i error "$O/$n.log" | head -3; }
  grep "Maximum resident" "$O/$n.log"
}
# 3. (PARTS=peer) diffusers' MiniMaxH3Transformer3DModel per block at the same sequence, beside vidgen's
#    whole forward (needs the diffusers wheel in .whl and torch on the machine).
if [[ " $PARTS " == *" peer "* ]]; then
  if [ -d .whl ]; then
    export PATH=/opt/torch/.venv/bin:$PATH
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
    export PYTHONPATH=/tmp/site
  fi
  [ -n "${BLOCKS:-}" ] && "$BLOCKS" 2>&1 | grep -v "^\s*$" | tail -8
  python3 bench/peer_minimax_blocks.py --out "$O/peer" 2>&1 | grep -v "kept in float32" | tail -4
fi
[[ " $PARTS " == *" full "* ]] || exit 0
$B generate --model synthetic:minimax-h3 --prompt "waves on a beach, gulls crying" --num-inference-steps $STEPS \
  --device cuda --dtype bf16 --memory-model discrete --dry-run --json > "$O/default-plan.json" 2> "$O/default-plan.log" \
  || { echo "FAIL dry run"; head -3 "$O/default-plan.log"; }
RUNS=${RUNS:-"default resident unified"}
[[ " $RUNS " == *" default "* ]] && full default --memory-model discrete
[[ " $RUNS " == *" resident "* ]] && full resident --memory-model discrete --lazy-module-load --no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload
[[ " $RUNS " == *" unified "* ]] && full unified --memory-model unified
python3 - "$O" <<'PY'
import sys, json
o = sys.argv[1]
for n in ["default", "resident", "unified"]:
    try:
        s = json.load(open(f"{o}/{n}.json"))
    except Exception as e:
        print(n, "no stats:", e); continue
    for job in s.get("jobs", []):
        m = job.get("metrics", {})
        fw = m.get("forward_seconds", [])
        print(f"{n}: status {job.get('status')}, forwards {['%.2f' % x for x in fw]}")
        for stage, p in m.get("stages", {}).items():
            print(f"  {stage:13} device used {p['device_used_peak']/2**30:7.2f} GiB, reserved {p['device_reserved_peak']/2**30:7.2f} GiB, host RSS {p['host_rss_peak']/2**30:7.2f} GiB")
PY
python3 - "$O" <<'PY'
import sys, json
o = sys.argv[1]
try:
    plan = {s["name"]: s["memory"] for s in json.load(open(f"{o}/default-plan.json"))["stages"]}
    job = json.load(open(f"{o}/default.json"))["jobs"][0]
except Exception as e:
    sys.exit(f"default: no plan or stats: {e}")
stages = job.get("metrics", {}).get("stages", {})
print("default flags, bf16, 5 s 768x1344: stage, predicted peak / measured device used peak (GiB)")
for name, p in stages.items():
    want = plan.get(name, {}).get("peak_bytes", 0) / 2**30
    got = p["device_used_peak"] / 2**30
    print(f"  {name:13} {want:6.2f} / {got:6.2f}{'  (under-predicted)' if got > want else ''}")
    if name in ("encode_text", "modulate", "denoise"):
        print(f"{'PASS' if got <= 8 else 'FAIL'} {name} device used peak {got:.2f} GiB <= 8 GiB")
whole = max((p["device_used_peak"] for p in stages.values()), default=0) / 2**30
print(f"{'PASS' if whole <= 8 else 'FAIL'} whole run: device used peak {whole:.2f} GiB <= 8 GiB")
PY
# The outputs (safetensors: the GPU machines have no FFmpeg; CI checks the MP4 muxing with ffprobe on the
# tiny fixture): frames at 24 fps and the stereo track at the audio VAE's rate cover the same time.
python3 - <<'PY'
import glob, json
from safetensors.numpy import load_file
rate = json.load(open("assets/minimax-h3/audio_vae/config.json"))["sampling_rate"]
for p in sorted(glob.glob("/tmp/vidgen-minimax-out/*.safetensors")):
    x = load_file(p)
    frames, audio = x["frames"], x["audio"]
    video_s, audio_s = frames.shape[0] / 24, audio.shape[-1] / rate
    print(f"{p.split('/')[-1]}: frames {frames.shape} = {video_s:.4f} s at 24 fps, audio {audio.shape} = {audio_s:.4f} s at {rate} Hz")
PY
