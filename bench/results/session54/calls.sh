#!/usr/bin/env bash
# Session 54's calls: `--fp8-matmul` for FLUX.1 and HunyuanVideo. DEV holds, stripped and xz'd, vidgen and
# tests/fp8_matmul.rs (fp8-matmul-tests) built with `--features cuda` at the working tree; .whl the diffusers
# 0.42.1 wheel.
#   run(carry: [".deviceNN", ".whl"], command: "DEV=.deviceNN bash bench/results/session54/calls.sh N")
#   1: the CUDA tests of the fp8 forwards (Wan, FLUX.1, HunyuanVideo against their bf16 forwards); FLUX.1-dev's
#      whole image at 1024x1024, 4 steps, beside diffusers in the same call (bench/family_e2e.py: vidgen
#      resident exact, resident with --fp8-matmul, and --fp8-matmul with the default flags).
#   2: HunyuanVideo's whole video (SIZE, default 61x544x960; 4 steps), the same three vidgen runs beside
#      diffusers.
#   3: (the build with every family's fp8 path, and the library's CUDA tests as vidgen-lib-tests) the CUDA
#      tests of the fp8 forwards and of the fused blocks of LTX-Video, CogVideoX, Mochi-1 and PixArt (Allegro,
#      Latte); each of those families' synthetic model at its default size, 2 steps, exact and fp8.
DEV=${DEV:-.device1} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
e2e() {  # e2e FAMILY [ARGS...]: bench/family_e2e.py with the three runs
  local family=$1; shift
  el "$family: vidgen resident, fp8-resident, fp8 (default flags) beside diffusers"
  python3 bench/family_e2e.py --family $family --vidgen /tmp/vidgen --out $OUT/$family --steps 4 \
    --ckpt-root /tmp/vidgen-e2e --vidgen-modes resident,fp8-resident,fp8 "$@" > $OUT/$family.log 2>&1
  echo "exit $?"; tail -25 $OUT/$family.log
  python3 bench/family_e2e.py --table $OUT/$family
}
case $1 in
  1) el "CUDA tests: the fp8 forwards against bf16"
     xz -dc $DEV/fp8-matmul-tests.xz > /tmp/fp8-matmul-tests && chmod +x /tmp/fp8-matmul-tests
     [ -n "${SKIP_TESTS:-}" ] || timeout 150 /tmp/fp8-matmul-tests --test-threads=1 --nocapture cuda_tests 2>&1 \
       | grep -E "^test |relative|bf16 .* ms|panicked|result:"
     e2e flux.1-dev ;;
  2) e2e hunyuanvideo --size ${SIZE:-61,544,960} ;;
  3) el "CUDA tests: the fp8 forwards against bf16; the families' fused blocks against their compositions"
     xz -dc $DEV/fp8-matmul-tests.xz > /tmp/fp8-matmul-tests && chmod +x /tmp/fp8-matmul-tests
     timeout 100 /tmp/fp8-matmul-tests --test-threads=1 --nocapture cuda_tests 2>&1 \
       | grep -E "^test |relative|panicked|result:"
     [ -f /tmp/vidgen-lib-tests ] && timeout 150 /tmp/vidgen-lib-tests --test-threads=1 \
       ltx:: cogvideox:: mochi:: pixart:: latte:: allegro:: 2>&1 | grep -E "^test |panicked|result:" | tail -40
     # Each family's synthetic model at its default size, 2 steps, resident: exact, then fp8.
     for m in ltx-video cogvideox-5b mochi-1 latte-1; do
       for mode in exact fp8; do
         flags=""; [ $mode = fp8 ] && flags=--fp8-matmul
         el "$m $mode"
         timeout 120 /tmp/vidgen generate --model synthetic:$m --prompt "a red fox runs through fresh snow" \
           --seed 1 --num-inference-steps 2 --dtype bf16 $flags --dit-layerwise-offload=false \
           --dit-cpu-offload=false --output-type safetensors --output-path /tmp/v --output-video-name $m-$mode \
           --overwrite --stats-json $OUT/$m-$mode.json > $OUT/$m-$mode.log 2>&1
         echo "exit $?: $(grep -E 'fp8 matmuls|transformer forwards' $OUT/$m-$mode.log | tr '\n' ' ')"
       done
       python3 -c "
import sys
from safetensors.numpy import load_file
a = load_file('/tmp/v/$m-exact.safetensors')['frames'].astype('float64')
b = load_file('/tmp/v/$m-fp8.safetensors')['frames'].astype('float64')
print('$m frames fp8 vs exact: relative L2', (((a - b) ** 2).sum() / (a ** 2).sum()) ** 0.5)" 2>&1 | tail -1
     done ;;
esac
el done
