# Session 45 got no device (none was lent): these calls are ready for the next session. Build vidgen, offload_bench and
# the library's CUDA tests at HEAD into .device46/ (strip, xz -9e: the carry with .whl must stay under 64 MiB), then
#   run(carry: [".device46/…", ".whl"], command: "bash bench/results/session45/calls.sh N")
#   1 (carry .device46/{vidgen-lib-tests,offload_bench,vidgen}.xz, .device46/seed_table_bench.py, .whl): the offload
#      engine's CUDA tests (groups sharing a slot land each at its own place); FLUX.1-dev's stream rows, vidgen
#      (default: one slot ahead, two single-stream blocks a slot; leaf level; two slots ahead) beside diffusers'
#      in the same call, and the dry-run plan of the default row (expected: 0.035 + 0.12 outer + 1.26 slots + 0.17
#      activations = 1.58 GiB against diffusers' 1.632).
#   2 (carry .device46/{offload_bench.xz,seed_table_bench.py}, .whl): HunyuanVideo 61x320x512, vidgen's default
#      (one slot ahead, two single-stream blocks a slot) against two slots ahead (the old default's look-ahead)
#      and resident, beside diffusers' stream row: the default must keep the old +1.2% overhead at 2 slots.
DEV=.device46 source bench/device_setup.sh
case $1 in
  1) el "the offload engine's CUDA tests"
     timeout 120 /tmp/vidgen-lib-tests --test-threads=1 offload:: 2>&1 | grep -E "^test |panicked|result:" | tail -20
     el "FLUX.1-dev's plan at default flags (dry run on the GPU)"
     /tmp/vidgen generate --model synthetic:flux.1-dev --prompt x --dtype bf16 --height 768 --width 768 \
       --dry-run 2>&1 | grep -E "^denoise|predicted|transformer" | head -8
     el "FLUX.1-dev stream rows, vidgen then diffusers"
     EXTRA_MODE='two_slots_ahead: --num-blocks-per-group 1 --prefetch-depth 2' \
     PEER_MODES=none,block_level_N1_stream,leaf_level_stream PEER_BUDGET_S=300 OUT=$OUT/seed \
       timeout 560 bash bench/seed_table.sh flux 2>&1 | tail -24;;
  2) el "HunyuanVideo 61x320x512: resident, default, two slots ahead, leaf; diffusers' stream row"
     EXTRA_MODE='two_slots_ahead: --num-blocks-per-group 1 --prefetch-depth 2' FORWARDS=3 \
     PEER_MODES=none,block_level_N1_stream PEER_BUDGET_S=250 OUT=$OUT/seed \
       timeout 560 bash bench/seed_table.sh hunyuan 2>&1 | tail -24;;
esac
