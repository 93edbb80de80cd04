#!/usr/bin/env bash
# Session 5's one device call: cuDNN check (issue 11), every family on CUDA with cuDNN found by
# the default search, MiniMax H3's tiny fixture on CUDA, and diffusers' Wan VAE decode beside ours.
set -u
export PATH=/opt/torch/.venv/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s]"; }
OUT=$OUT/cudnn bash .device/cudnn_check.sh 2>&1 | tee "$OUT/cudnn_check.txt"
el
B=/tmp/cudnn-bin/vidgen
echo "== smoke: every family, f32 and bf16, default cuDNN search"
bash .device/gpu_smoke.sh $B 2>&1 | tee "$OUT/smoke.txt"
grep -h "cudnn\|cuDNN" /tmp/smoke/*.log | sort | uniq -c | head -5
el
echo "== minimax tiny on CUDA"
F=tests/fixtures/minimax-h3-tiny-a; O=/tmp/mm; mkdir -p $O
python3 - "$F" "$O" <<'PY'
import sys
from safetensors.numpy import load_file, save_file
f, o = sys.argv[1:]
r = load_file(f"{f}/reference/pipeline.safetensors")
save_file({"latents": r["latents_init"], "audio_latents": r["audio_latents_init"]}, f"{o}/draws.safetensors")
PY
for d in f32 bf16; do
  $B generate --model $F --prompt "A red car drives along a coastal road at sunset." --height 16 --width 24 --num-frames 121 \
    --num-inference-steps 4 --latents $O/draws.safetensors --device cuda --dtype $d --output-type safetensors \
    --output-path $O --output-video-name $d --overwrite > /dev/null 2> $O/$d.log && echo "ok minimax $d" || { echo "FAIL minimax $d"; tail -3 $O/$d.log; }
done
python3 - "$O" "$F" <<'PY'
import sys, numpy as np
from safetensors.numpy import load_file
d, f = sys.argv[1:]
ref = load_file(f"{f}/reference/pipeline.safetensors")
for dt in ["f32", "bf16"]:
    try: x = load_file(f"{d}/{dt}.safetensors")
    except Exception as e: print(dt, "missing", e); continue
    for k, want in [("frames", ref["videos"][0]), ("audio", ref["audio"][0])]:
        print(f"minimax {dt} {k}: max |diff| vs diffusers {np.abs(x[k] - want).max():.3e}, finite {np.isfinite(x[k]).all()}")
PY
el
echo "== diffusers Wan VAE decode (same call)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl && export PYTHONPATH=/tmp/site
python3 .device/peer_wan_vae_decode.py 2>&1 | tail -2 | tee "$OUT/peer_vae.txt"
el
