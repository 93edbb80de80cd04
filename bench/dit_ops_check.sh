#!/usr/bin/env bash
# GPU check of the fused DiT kernels (src/models/kernels/dit_ops.cu), in one call: the CUDA tests
# that compare every kernel (and the LTX / CogVideoX blocks) with the candle composition it
# replaces, the Wan ones (its launch plumbing moved to dit_ops), then the per-family profile.
#   bash bench/dit_ops_check.sh
# Needs .device/vidgen-lib-tests: the binary that
#   cargo test --no-default-features --features cuda --lib --no-run
# prints ("Executable unittests src/lib.rs (…/deps/vidgen-<hash>)"), and .device/offload_bench
# for bench/profile_dit.sh (bench/RESULTS.md says how it is built).
set -u
T=./.device/vidgen-lib-tests
[ -f $T.xz ] && [ ! -x $T ] && xz -dc $T.xz > $T && chmod +x $T
$T --test-threads=1 --nocapture \
  ltx::transformer::cuda_tests cogvideox::transformer::cuda_tests \
  hunyuan_video::transformer::cuda_tests hunyuan_video::vae::cuda_tests wan::transformer::cuda_tests 2>&1 |
  grep -E "worst|relative|skipped|^test |panicked|result:"
[ -x ./.device/offload_bench ] || [ -f ./.device/offload_bench.xz ] && bash bench/profile_dit.sh ltx cogvideox hunyuan
