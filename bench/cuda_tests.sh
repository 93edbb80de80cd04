#!/usr/bin/env bash
# Every CUDA test in one lane, on a GPU machine: the `cuda_tests` modules of the library (the row
# kernels, convolutions, attention, the offload engine's device paths, and each family's fused
# block against its composition), then the integration tests that have a CUDA path. Each test's
# result is printed as it ends.
#   bash bench/cuda_tests.sh [FILTER...]   (default: every `cuda_tests` module and `candle_strided`, the
#   tests of the vendored candle kernels' strided paths)
# Needs .device/vidgen-lib-tests(.xz): the library's test binary, built here with
#   cargo test --release --no-default-features --features cuda --lib --no-run
# (its path is the "Executable unittests src/lib.rs (…/deps/vidgen-<hash>)" line); and, when
# present, .device/parity_vae-tests(.xz) from `--test parity_vae` likewise.
set -u
status=0
filters=("$@")
[ $# = 0 ] && filters=(cuda_tests candle_strided)
for t in vidgen-lib-tests parity_vae-tests; do
  T=./.device/$t
  [ -f $T.xz ] && [ ! -x $T ] && xz -dc $T.xz > $T && chmod +x $T
  [ -x $T ] || { echo "$T: not built, skipped"; continue; }
  args=(--test-threads=1)
  [ $t = vidgen-lib-tests ] && args+=("${filters[@]}")
  $T "${args[@]}" 2>&1 | grep --line-buffered -E "^test |panicked|skipped|worst|result:"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit $status
