# Session 38, call 2: why call 1's original-layout runs failed on CUDA (each failing run again, its whole
# stderr), the streaming tests that need the Wan fixtures (carried in fx2.tar.xz this time), and the
# LayerNormZero test (1 element in 54.6M over its bound in call 1) three times.
set -u
B=/tmp/b; mkdir -p $B
xz -dc .device/vidgen.xz > $B/vidgen; chmod +x $B/vidgen
mkdir -p tests/fixtures && xz -dc .device/fx.tar.xz | tar -xf - -C tests/fixtures
xz -dc .device/fx2.tar.xz | tar -xf - -C tests/fixtures
echo "repo at $PWD"
# The library's tests find the fixtures under the path they were built in.
[ "$PWD" = /work/main ] || { mkdir -p /work/main/tests && ln -sfn $PWD/tests/fixtures /work/main/tests/fixtures; }
ls /work/main/tests/fixtures | head -3
F=tests/fixtures
fail() { # model file extra...
  m=$1; f=$2; shift 2
  echo "=== $f $*"
  RUST_BACKTRACE=0 $B/vidgen generate --model $F/$m --transformer $F/original-layouts/$f --prompt "a red fox" \
    --seed 7 --height 64 --width 64 --num-inference-steps 2 --output-type safetensors \
    --output-path /tmp/o --output-video-name x --overwrite "$@" 2>&1 | grep -v "^\[\|^loaded\|^freed\|^load" | tail -15
}
fail flux-tiny-a flux-tiny-a-Q8_0.gguf --device cuda --dtype bf16
fail flux-tiny-a flux-tiny-a-comfyui-bf16.safetensors --device cuda --dtype f32
fail hunyuanvideo-tiny-a hunyuanvideo-tiny-a-Q8_0.gguf --device cuda --dtype bf16 --num-frames 9
fail mochi-tiny-a mochi-tiny-a-Q8_0.gguf --device cuda --dtype bf16 --num-frames 7
xz -dc .device/vidgen-lib-tests.xz > $B/lib; chmod +x $B/lib
$B/lib --test-threads=1 offload::streamer::cuda_tests 2>&1 | grep -E "^test |panicked|Error|result:" | head -20
for i in 1 2 3; do $B/lib --test-threads=1 layer_norm_zero_matches_composite 2>&1 | grep -E "worst|result:"; done
