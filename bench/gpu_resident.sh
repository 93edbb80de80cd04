#!/usr/bin/env bash
# Issue 3's GPU measurements, in one device call (see bench/RESULTS.md):
#   1. the tiny fixture on CUDA in f32 against diffusers' reference frames;
#   2. synthetic Wan2.1 1.3B and 14B at 480x832x81 bf16, resident, CFG 5: s/forward, decode time,
#      peak device memory per stage (CUDA pool high-water marks).
# Run from the repository root on the GPU machine with the CUDA build at .device/vidgen.
set -u
B=./.device/vidgen
OUT=${OUT:-/tmp/vidgen-bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P=$(python3 -c 'import json;print(json.load(open("tests/fixtures/wan-tiny-a/reference/README.json"))["files"]["pipeline.safetensors"]["inputs"]["prompt"])')
for g in 5 1; do
  $B generate --model tests/fixtures/wan-tiny-a --prompt "$P" --negative-prompt "blurry, static, low quality" \
    --height 32 --width 32 --num-frames 9 --num-inference-steps 3 --guidance-scale $g --max-sequence-length 20 \
    --latents .device/latents_init.safetensors --device cuda --dtype f32 --output-type safetensors \
    --output-path "$OUT/tiny" --output-video-name cfg$g 2> "$OUT/tiny_cfg$g.log"
  python3 bench/compare_frames.py "$OUT/tiny/cfg$g.safetensors" tests/fixtures/wan-tiny-a/reference/pipeline.safetensors cfg$g.frames
done
RESIDENT="--no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload"
for m in 1.3b 14b; do
  steps=3; [ $m = 14b ] && steps=2
  /usr/bin/time -v $B generate --model synthetic:wan2.1-t2v-$m --prompt "a red fox runs through fresh snow" --seed 1 \
    --num-inference-steps $steps --device cuda --dtype bf16 $RESIDENT --output-type safetensors --output-path /tmp/vg/$m \
    > "$OUT/$m.stdout" 2> "$OUT/$m.log"
  echo "== $m: exit $?"; grep -E "loaded|forwards|encode_text:|denoise:|decode:|write:|s, |Maximum resident|Elapsed" "$OUT/$m.log"
  python3 -c "from safetensors import safe_open as o; f=o(open(\"$OUT/$m.stdout\").read().strip(),\"np\"); print(\"frames\", f.get_slice(\"frames\").get_shape())"
done
# The offload engine's first cut (synchronous copies from pageable host memory, no copy stream yet),
# against the resident run above: same command, --dit-layerwise-offload on.
/usr/bin/time -v $B generate --model synthetic:wan2.1-t2v-1.3b --prompt "a red fox runs through fresh snow" --seed 1 \
  --num-inference-steps 3 --device cuda --dtype bf16 --dit-layerwise-offload --no-dit-cpu-offload \
  --no-text-encoder-cpu-offload --no-vae-cpu-offload --output-type safetensors --output-path /tmp/vg/1.3b-layerwise \
  > "$OUT/1.3b-layerwise.stdout" 2> "$OUT/1.3b-layerwise.log"
echo "== 1.3b layerwise: exit $?"; grep -E "loaded|offload|forwards|encode_text:|denoise:|decode:|Maximum resident" "$OUT/1.3b-layerwise.log"
python3 -c "
from safetensors.numpy import load_file as l
a = l(open('$OUT/1.3b.stdout').read().strip())['frames']; b = l(open('$OUT/1.3b-layerwise.stdout').read().strip())['frames']
print('layerwise frames identical to resident:', bool((a == b).all()))"
