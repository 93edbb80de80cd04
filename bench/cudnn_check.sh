#!/usr/bin/env bash
# Issue 11 items 1-3 (cuDNN found at run time) on the GPU machine, in one device call:
#   run(carry: [".device"], command: "bash bench/cudnn_check.sh", timeout_s: 600)
# Needs .device/gz/vidgen.xz and .device/gz/cudnn_check.xz: stripped, xz-compressed CUDA builds
#   (cargo build --release --no-default-features --features cuda --bin vidgen --example cudnn_check).
#   1. cudnn_check: cuDNN found and its version; its SDPA against the own fused kernel at Wan's
#      shapes (max error, CUDA-event times, interleaved); its conv3d against the own path on Wan VAE
#      decoder convs, f32 with TF32 and exact; bf16 throughput at the HunyuanVideo VAE decoder's shapes,
#      and torch's at the same shapes (bench/peer_conv3d.py: contiguous and channels_last_3d).
#   2. the same with VIDGEN_CUDNN=off: the fallback (no cuDNN, attention on the own kernel).
#   3. synthetic Wan2.1 1.3B, 480x832x81 bf16 (VAE f32), 2 steps, resident: with cuDNN (TF32), with cuDNN and
#      --no-tf32, and VIDGEN_CUDNN=off; stage times (the decode is the VAE) and the frames compared
#      (cuDNN runs attention too, so the denoised latents differ slightly as well).
set -u
OUT=${OUT:-/tmp/cudnn-check}
BIN=/tmp/cudnn-bin
mkdir -p "$OUT" "$BIN"
for b in vidgen cudnn_check; do
  xz -dc ".device/gz/$b.xz" > "$BIN/$b" && chmod +x "$BIN/$b" || { echo "missing .device/gz/$b.xz"; exit 1; }
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== cudnn_check"
"$BIN/cudnn_check" 2>&1 | tee "$OUT/check.log"
echo "== torch's bf16 conv3d at the same HunyuanVideo shapes (NCDHW and channels_last_3d)"
PATH=/opt/torch/.venv/bin:$PATH python3 bench/peer_conv3d.py 2>&1 | tee "$OUT/peer-conv3d.log"
echo "== cudnn_check, VIDGEN_CUDNN=off"
VIDGEN_CUDNN=off "$BIN/cudnn_check" 2>&1 | tee "$OUT/check-off.log"
RESIDENT="--no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload"
run() { # label cudnn-setting flags...
  local label=$1 setting=$2; shift 2
  local start=$(date +%s.%N)
  VIDGEN_CUDNN=$setting "$BIN/vidgen" generate --model synthetic:wan2.1-t2v-1.3b \
    --prompt "a red fox runs through fresh snow" --seed 1 --num-inference-steps 2 --device cuda \
    --dtype bf16 $RESIDENT --output-type safetensors --output-path /tmp/cudnn-videos \
    --output-video-name "$label" --overwrite --stats-json "$OUT/$label.json" "$@" \
    > /dev/null 2> "$OUT/$label.log"
  local rc=$? end=$(date +%s.%N)
  echo "== $label (VIDGEN_CUDNN=$setting $*): exit $rc, process $(awk "BEGIN{printf \"%.1f\", $end - $start}") s"
  grep -E "^note|encode_text:|denoise:|decode:|write:|forwards|error" "$OUT/$label.log"
}
# An empty VIDGEN_CUDNN: cuDNN is found by vidgen's own search (here PyTorch's wheel).
run cudnn ""
run cudnn-exact "" --no-tf32
run own off
python3 - <<'PY'
from safetensors.numpy import load_file
import numpy as np, os
d = "/tmp/cudnn-videos/"
def frames(n):
    p = d + n + ".safetensors"
    return load_file(p)["frames"].astype(np.float64) if os.path.exists(p) else None
own, tf32, exact = frames("own"), frames("cudnn"), frames("cudnn-exact")
for name, a, b in [("cudnn (TF32) vs own", tf32, own), ("cudnn exact vs own", exact, own),
                   ("cudnn TF32 vs cudnn exact (decode only differs)", tf32, exact)]:
    if a is None or b is None:
        print(f"{name}: missing output"); continue
    diff = np.abs(a - b)
    print(f"{name}: frames {a.shape}, max |diff| {diff.max():.4f}, mean {diff.mean():.2e}, finite {np.isfinite(a).all()}")
PY
