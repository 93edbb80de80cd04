#!/usr/bin/env bash
# Session 51's calls. Build vidgen (and examples) at HEAD into .deviceNN/ (strip, xz -9e), then
#   run(carry: [".deviceNN"], command: "DEV=.deviceNN bash bench/results/session51/calls.sh 1")
#   1: issue 36's "the DiT's Linear time": Wan2.1 14B at 81x480x832, resident, no CFG, under Nsight Compute
#      (kernel durations only, caches and clocks left alone), bf16 and --fp8-matmul, each at 1 and 2 steps:
#      the difference of the two runs is one whole forward's kernels (the second, after the fp8 weights are
#      made), summed by kind (products, quantization, attention, the rest) by bench/linear_time.py.
DEV=${DEV:-.device63} source bench/device_setup.sh
case $1 in
  1) for mode in ${MODES:-bf16 fp8}; do for steps in 1 2; do
       extra=(); [ $mode = fp8 ] && extra=(--fp8-matmul)
       el "14B $mode, $steps step(s), under ncu"
       timeout 140 ncu --clock-control none --cache-control none --csv --page raw \
         --metrics gpu__time_duration.sum /tmp/vidgen generate --model synthetic:wan2.1-t2v-14b \
         --prompt "a red fox runs through fresh snow" --seed 1 --num-frames 81 --height 480 --width 832 \
         --num-inference-steps $steps --guidance-scale 1 --dtype bf16 "${extra[@]}" \
         --dit-layerwise-offload=false --dit-cpu-offload=false --output-type safetensors \
         --output-path /tmp/v --overwrite > $OUT/ncu-$mode-$steps.csv 2> $OUT/ncu-$mode-$steps.log
       echo "exit $?"; tail -2 $OUT/ncu-$mode-$steps.log
     done; done
     for n in 1 2; do [ -f $OUT/ncu-bf16-$n.csv ] || xz -dc $DEV/ncu-bf16-$n.csv.xz > $OUT/ncu-bf16-$n.csv; done
     python3 bench/linear_time.py exact=$OUT/ncu-bf16-1.csv,$OUT/ncu-bf16-2.csv fp8=$OUT/ncu-fp8-1.csv,$OUT/ncu-fp8-2.csv
     [ "${NO_BENCH:-0}" = 1 ] && exit 0
     el "linear_bench"
     xz -dc $DEV/linear_bench.xz > /tmp/linear_bench && chmod +x /tmp/linear_bench
     timeout 200 /tmp/linear_bench;;
  2) el "the exact Hopper attention kernel: tiles of 128 keys against 176 (FlashAttention-3's choice), interleaved"
     xz -dc $DEV/attn_bench.xz > /tmp/attn_bench && chmod +x /tmp/attn_bench
     timeout 300 /tmp/attn_bench hopper 2>&1 | tail -40;;
  3) el "the fp8 CUDA tests (the quantizer with a bias and GELU; the hidden codes; the Linears; Wan's fp8 forward)"
     timeout 200 /tmp/vidgen-lib-tests --test-threads=1 fp8 projection row_ops wan::transformer::cuda_tests 2>&1 \
       | grep -E "^test |panicked|result:" | tail -40
     xz -dc $DEV/fp8-tests.xz > /tmp/fp8-tests && chmod +x /tmp/fp8-tests
     timeout 200 /tmp/fp8-tests --test-threads=1 --nocapture cuda 2>&1 | grep -E "^test |fp8|bf16|panicked|result:" | tail -20
     el "linear_bench"
     xz -dc $DEV/linear_bench.xz > /tmp/linear_bench && chmod +x /tmp/linear_bench
     timeout 120 /tmp/linear_bench
     NO_BENCH=1 MODES=${MODES:-bf16 fp8} bash bench/results/session51/calls.sh 1;;
esac
