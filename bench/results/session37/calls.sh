# Session 37 had no device. The first call of the next session with one: the GPU paths of this
# session's CPU-checked work, on the tiny fixtures.
# Carry: .device (vidgen.xz, vidgen-lib-tests.xz, built with --features cuda), and
# tests/fixtures/{original-layouts,flux-tiny-a,hunyuanvideo-tiny-a,mochi-tiny-a,ltx-video-tiny-a,lora-families,
# wan-tiny-a,wan-loras}
# (the fixtures are otherwise left out of a call's tree).
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
for x in vidgen vidgen-lib-tests; do xz -dc .device/$x.xz > $B/$x; chmod +x $B/$x; done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
el "CUDA lib tests: weights, lora, step caches"
$B/vidgen-lib-tests --test-threads=1 weights lora step_cache 2>&1 | grep -E "panicked|result:" | tee $OUT/lib.txt
# Each original-layout file on the GPU, resident and streamed (row-cut views and swapped GGUF halves on
# the copy stream), against the same file on the CPU: the frames agree to f32 rounding.
F=tests/fixtures
for pair in flux-tiny-a:flux-tiny-a-Q8_0.gguf flux-tiny-a:flux-tiny-a-comfyui-bf16.safetensors \
            hunyuanvideo-tiny-a:hunyuanvideo-tiny-a-Q8_0.gguf mochi-tiny-a:mochi-tiny-a-Q8_0.gguf \
            ltx-video-tiny-a:ltx-video-tiny-a-Q8_0.gguf; do
  m=${pair%%:*}; f=${pair##*:}
  for mode in cpu cuda cuda-streamed; do
    dev=cuda; extra=""
    [ $mode = cpu ] && dev=cpu
    [ $mode = cuda-streamed ] && extra="--memory-model discrete --dit-layerwise-offload"
    el "$f $mode"
    $B/vidgen generate --model $F/$m --transformer $F/original-layouts/$f --prompt "a red fox" --seed 1 \
      --num-inference-steps 2 --device $dev --dtype f32 --output-type safetensors --output-path $OUT/ol \
      --output-video-name "$f.$mode" --overwrite $extra 2>&1 | tail -1
  done
done
# kohya FLUX.1 LoRAs merged on the GPU, resident and streamed: the transformer's alone, then with CLIP's
# (session 38: the text encoder's weights merged where they land); Wan's original names with PEFT halves and
# bias deltas (session 38).
for lora in flux-tiny-a:lora-families/flux-kohya.safetensors flux-tiny-a:lora-families/flux-kohya-te.safetensors \
            wan-tiny-a:wan-loras/wan-original-peft.safetensors; do
  m=${lora%%:*}; f=${lora##*:}; n=$(basename $f .safetensors)
  for mode in cpu cuda cuda-streamed; do
    dev=cuda; extra=""
    [ $mode = cpu ] && dev=cpu
    [ $mode = cuda-streamed ] && extra="--memory-model discrete --dit-layerwise-offload"
    el "$n $mode"
    size=""; [ $m = wan-tiny-a ] && size="--height 32 --width 32 --num-frames 9"
    $B/vidgen generate --model $F/$m --lora $F/$f --prompt "a red fox" $size \
      --seed 1 --num-inference-steps 2 --device $dev --dtype f32 --output-type safetensors --output-path $OUT/ol \
      --output-video-name "lora-$n.$mode" --overwrite $extra 2>&1 | tail -1
  done
done
python3 - $OUT/ol <<'PY' | tee $OUT/compare.txt
import sys, glob
from safetensors.numpy import load_file
d = sys.argv[1]
for cpu in sorted(glob.glob(f"{d}/*.cpu.safetensors")):
    ref = load_file(cpu)["frames"]
    for mode in ("cuda", "cuda-streamed"):
        other = cpu.replace(".cpu.", f".{mode}.")
        try:
            got = load_file(other)["frames"]
        except FileNotFoundError:
            print(f"{other}: missing"); continue
        print(f"{other.split('/')[-1]}: max |cuda - cpu| {abs(got - ref).max():.2e}")
PY
el done
