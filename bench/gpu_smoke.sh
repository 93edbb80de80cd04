#!/usr/bin/env bash
# Run from the repository root on a GPU machine: bench/gpu_smoke.sh PATH/TO/vidgen
# Every family on CUDA: the tiny fixtures in f32 and bf16 with default flags; frames compared.
B=$1; O=/tmp/smoke; mkdir -p $O
run() { # name model dtype flags...
  local n=$1 m=$2 d=$3; shift 3
  $B generate --model tests/fixtures/$m --prompt "a cat walks on the grass" --seed 1 --num-inference-steps 3 \
    --device cuda --dtype $d --output-type safetensors --output-path $O \
    --output-video-name $n-$d --overwrite "$@" > /dev/null 2> $O/$n-$d.log && echo "ok   $n $d" || { echo "FAIL $n $d $*"; grep -i error $O/$n-$d.log | head -3; }
}
for d in f32 bf16; do
  run wan wan-tiny-a $d --height 32 --width 32 --num-frames 5 --max-sequence-length 16
  run i2v wan21-i2v-tiny-a $d --height 32 --width 48 --num-frames 9 --image tests/fixtures/wan21-i2v-tiny-a/reference/input.png
  run ti2v wan22-ti2v-tiny-a $d --height 64 --width 64 --num-frames 5 --max-sequence-length 20 --image tests/fixtures/wan22-ti2v-tiny-a/reference/input.png
  run a14b wan22-a14b-tiny-a $d --height 32 --width 32 --num-frames 9 --max-sequence-length 16 --guidance-scale-2 3
  run ltx ltx-video-tiny-a $d --height 64 --width 64 --num-frames 9 --max-sequence-length 16
  run cog cogvideox-tiny-a $d --height 32 --width 48 --num-frames 17 --max-sequence-length 16
  run hun hunyuanvideo-tiny-a $d --height 32 --width 48 --num-frames 17 --max-sequence-length 16
done
python3 - <<'PY'
from safetensors.numpy import load_file
import numpy as np, os
d = "/tmp/smoke/"
for n in ["wan", "i2v", "ti2v", "a14b", "ltx", "cog", "hun"]:
    a, b = d + n + "-f32.safetensors", d + n + "-bf16.safetensors"
    if os.path.exists(a) and os.path.exists(b):
        fa, fb = load_file(a)["frames"], load_file(b)["frames"]
        print(f"{n}: frames {fa.shape}, f32 vs bf16 max |diff| {np.abs(fa - fb).max():.3f}, finite {np.isfinite(fb).all()}")
PY
