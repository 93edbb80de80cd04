#!/usr/bin/env bash
# Session 52's calls. Build vidgen, examples/linear_bench and the library's CUDA tests at HEAD into .deviceNN/
# (strip, xz -9e), then
#   run(carry: [".deviceNN"], command: "DEV=.deviceNN bash bench/results/session52/calls.sh 1")
#   1: the fp8 Linear's own Hopper kernel (fp8_sm90.cu): its CUDA tests, `linear_bench` (per shape: the kernel,
#      cuBLASLt's scaled and bare products; a block's Linears with the kernel, then with cuBLASLt's products by
#      capping the shared memory the own kernels may use below the kernel's 193 KiB, which keeps the Hopper
#      attention's 161 KiB), then one 14B forward's kernels under Nsight Compute (session 51's `calls.sh 1`
#      method, bench/linear_time.py) with the kernel.
#   2: the same forward exact, and fp8 with cuBLASLt's products (the cap), for the ratios in one call.
#   3: the same forward exact and fp8 with the kept kernel (.device67's build: the kept kernel, whose
#      4,096-input rule changes none of the 14B's Linears), in one call.
DEV=${DEV:-.device68} source bench/device_setup.sh
CAP=VIDGEN_MAX_SHARED_MEMORY_PER_BLOCK=180000
forward() {  # forward NAME STEPS [ENV...] [-- vidgen flags]
  local name=$1 steps=$2; shift 2
  el "14B $name, $steps step(s), under ncu"
  env "$@" timeout 150 ncu --clock-control none --cache-control none --csv --page raw \
    --metrics gpu__time_duration.sum /tmp/vidgen generate --model synthetic:wan2.1-t2v-14b \
    --prompt "a red fox runs through fresh snow" --seed 1 --num-frames 81 --height 480 --width 832 \
    --num-inference-steps $steps --guidance-scale 1 --dtype bf16 ${FLAGS:-} \
    --dit-layerwise-offload=false --dit-cpu-offload=false --output-type safetensors \
    --output-path /tmp/v --overwrite > $OUT/ncu-$name-$steps.csv 2> $OUT/ncu-$name-$steps.log
  echo "exit $?"; tail -2 $OUT/ncu-$name-$steps.log
}
case $1 in
  1) el "the Hopper kernel's test first (a hang or failure stops the call)"
     timeout 60 /tmp/vidgen-lib-tests --test-threads=1 hopper_kernel 2>&1 | grep -E "^test |panicked|result:" \
       | tee /dev/stderr | grep -q " 0 failed" || exit 1
     el "CUDA tests: the fp8 Linears (the Hopper kernel among them), the 8-bit attention (its TMA maps)"
     timeout 200 /tmp/vidgen-lib-tests --test-threads=1 fp8 sage_kernels 2>&1 \
       | grep -E "^test |panicked|result:" | tail -30
     xz -dc $DEV/linear_bench.xz > /tmp/linear_bench && chmod +x /tmp/linear_bench
     el "linear_bench"
     timeout 150 /tmp/linear_bench
     el "linear_bench, the own kernels capped at 180000 bytes of shared memory (cuBLASLt's products)"
     env $CAP timeout 150 /tmp/linear_bench | tail -6
     for steps in 1 2; do FLAGS=--fp8-matmul forward fp8 $steps; done
     for n in 1 2; do xz -dc $DEV/ncu-bf16-$n.csv.xz > $OUT/ncu-bf16-$n.csv; done
     python3 bench/linear_time.py exact-session51=$OUT/ncu-bf16-1.csv,$OUT/ncu-bf16-2.csv \
       fp8=$OUT/ncu-fp8-1.csv,$OUT/ncu-fp8-2.csv;;
  2) for steps in 1 2; do forward bf16 $steps; done
     for steps in 1 2; do FLAGS=--fp8-matmul forward fp8-cublaslt $steps $CAP; done
     python3 bench/linear_time.py exact=$OUT/ncu-bf16-1.csv,$OUT/ncu-bf16-2.csv \
       fp8-cublaslt=$OUT/ncu-fp8-cublaslt-1.csv,$OUT/ncu-fp8-cublaslt-2.csv;;
  3) for steps in 1 2; do forward bf16 $steps; done
     for steps in 1 2; do FLAGS=--fp8-matmul forward fp8 $steps; done
     python3 bench/linear_time.py exact=$OUT/ncu-bf16-1.csv,$OUT/ncu-bf16-2.csv \
       fp8=$OUT/ncu-fp8-1.csv,$OUT/ncu-fp8-2.csv;;
esac
