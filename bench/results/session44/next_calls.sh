# Ready for the next session's device (build vidgen and examples/offload_bench with `--features cuda` into .device45/):
#   run(carry: [".device45/vidgen.xz", ".device45/offload_bench.xz"], command: "bash bench/results/session44/next_calls.sh 1")
#   1: FLUX.1-dev's streamed rows (issue 33's last three, above diffusers' memory): what the plan expects a streamed
#      forward to hold (dry run on the GPU: slots of the largest block, the expanded group) against what offload_bench
#      measures, at look-ahead 1 and 2, so the ~0.12 GiB no slot accounts for can be placed.
#   For Mochi-1's bf16 spread, bench/results/session42/calls.sh 2 (an H200: diffusers' f32 run needs its memory).
set -u
for b in vidgen offload_bench; do xz -dc .device45/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
case $1 in
  1) for d in 1 2; do
       /tmp/vidgen generate --model synthetic:flux.1-dev --prompt x --dtype bf16 --height 768 --width 768 \
         --dit-layerwise-offload --num-blocks-per-group 1 --prefetch-depth $d --dry-run 2>&1 | grep -E "^denoise|predicted"
     done
     VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench timeout 200 /tmp/offload_bench synthetic:flux.1-dev 2 1x768x768 \
       "depth1: --num-blocks-per-group 1 --prefetch-depth 1" "depth2: --num-blocks-per-group 1 --prefetch-depth 2" \
       "leaf: --offload-type leaf-level" | grep -E '^\{' | cut -c1-600;;
esac
