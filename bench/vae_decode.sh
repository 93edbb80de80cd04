#!/usr/bin/env bash
# Issue 11 item 3 (the Wan VAE decode) in ONE device call, about 3-4 minutes (< 8):
#   here:   bash bench/vae_decode.sh build      # CUDA builds into .device/vaefast (see below)
#   device: run(carry: [".device", ".whl"], command: "bash bench/vae_decode.sh", timeout_s: 600)
# `build` runs, with ../shared/gpu/cuda-env.sh sourced and the release profile:
#   cargo build --release --no-default-features --features cuda --bin vidgen --example vae_decode
#   cargo test --release --no-default-features --features cuda --no-run --lib --test parity_vae
# and puts vidgen, vae_decode and the two test binaries (lib, parity_vae) xz-compressed (~33 MB in
# all) into .device/vaefast, with the folder the tests were built in (their fixture paths are
# compiled in); and downloads the diffusers 0.42.1 wheel into .whl if it is not there (the torch
# image has its other dependencies; ../shared/peer/README.md).
# On the device:
#   (a) the CUDA-only tests: the fused VAE kernels against the candle fallback, a residual block
#       over chunks against the CPU, the timed cuDNN conv (exact and TF32) against the tap sum,
#       the tiny fixture's decode on CUDA (exact within the CPU tolerances, TF32 reported);
#   (b) the full-size decode, [1,16,21,60,104] -> 81x480x832 f32, synthetic Wan2.1 weights, after
#       a warm-up on 2 latent frames (its time, warm_up_s, includes the algorithm choices):
#       cuDNN with TF32, cuDNN exact (--no-tf32), cuDNN with TF32 and the timed algorithm search
#       instead of the heuristic order (VIDGEN_CUDNN_CONV_ALGO=timed), VIDGEN_CUDNN=off;
#   (c) max |TF32 - exact| on the tiny fixture (and each against diffusers' frames) and on the
#       full-size decode;
#   (d) diffusers' decode of the same shape in the same call (bench/peer_wan_vae_decode.py);
#   (e) every family's tiny fixture on CUDA (bench/gpu_smoke.sh): the other causal-conv VAEs
#       (LTX-Video, CogVideoX, HunyuanVideo) use the same cuDNN convolution.
set -u
D=.device/vaefast
if [ "${1:-}" = build ]; then
  set -e
  source ../shared/gpu/cuda-env.sh
  mkdir -p "$D"
  cargo build --release --no-default-features --features cuda --bin vidgen --example vae_decode
  json=$(cargo test --release --no-default-features --features cuda --no-run --lib --test parity_vae \
    --message-format=json 2>/dev/null)
  lib=$(echo "$json" | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["lib"]: print(m["executable"])')
  par=$(echo "$json" | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="parity_vae": print(m["executable"])')
  [ -n "$lib" ] && [ -n "$par" ] || { echo "test binaries not found"; exit 1; }
  for pair in "vidgen:$CARGO_TARGET_DIR/release/vidgen" "vae_decode:$CARGO_TARGET_DIR/release/examples/vae_decode" \
      "lib_tests:$lib" "parity_vae:$par"; do
    xz -T2 -6 -c "${pair#*:}" > "$D/${pair%%:*}.xz"
  done
  pwd > "$D/manifest_dir"
  ls .whl/diffusers-0.42.1-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps diffusers==0.42.1 -d .whl
  ls -la "$D" .whl; exit 0
fi
export PATH=/opt/torch/.venv/bin:$PATH
OUT=${OUT:-/tmp/vaefast}; mkdir -p "$OUT"
B=/tmp/vaefast-bin; mkdir -p "$B"
for b in vidgen vae_decode lib_tests parity_vae; do
  xz -dc "$D/$b.xz" > "$B/$b" && chmod +x "$B/$b" || echo "missing $D/$b.xz"
done
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s]"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# The test binaries find tests/fixtures under the folder they were built in.
M=$(cat "$D/manifest_dir" 2>/dev/null)
if [ -n "$M" ] && [ ! -e "$M/tests/fixtures" ]; then mkdir -p "$(dirname "$M")"; ln -sfn "$PWD" "$M"; fi
echo "== (a) CUDA-only tests"
"$B/lib_tests" --test-threads 1 models::conv3d::cuda_tests models::wan::vae::blocks::cuda_tests 2>&1 | tail -12
"$B/parity_vae" --nocapture cuda_decode 2>&1 | grep -E "^test |cuda decode|panicked|test result"
el
echo "== (b, c) full-size decode and the tiny fixture: cuDNN, TF32 and exact"
"$B/vae_decode" 1,16,21,60,104 --exact --fixture tests/fixtures/wan-tiny-a 2> "$OUT/decode-cudnn.log" | tee "$OUT/decode-cudnn.jsonl"
grep -E "^note|rror" "$OUT/decode-cudnn.log" | head -5
el
echo "== (b) full-size decode, the timed algorithm search instead of cuDNN's heuristic (VIDGEN_CUDNN_CONV_ALGO=timed)"
VIDGEN_CUDNN_CONV_ALGO=timed "$B/vae_decode" 1,16,21,60,104 2> "$OUT/decode-timed.log" | tee "$OUT/decode-timed.jsonl"
el
echo "== (b) full-size decode, VIDGEN_CUDNN=off"
VIDGEN_CUDNN=off "$B/vae_decode" 1,16,21,60,104 2> "$OUT/decode-off.log" | tee "$OUT/decode-off.jsonl"
grep -E "^note|rror" "$OUT/decode-off.log" | head -5
el
echo "== (d) diffusers 0.42.1, same shape, same call"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && PYTHONPATH=/tmp/site python3 bench/peer_wan_vae_decode.py 2>&1 | tail -1 | tee "$OUT/peer.json"
el
if [ -x "$B/vidgen" ] && [ -z "${NO_SMOKE:-}" ]; then
  echo "== (e) every family's tiny fixture on CUDA"
  bash bench/gpu_smoke.sh "$B/vidgen" 2>&1 | tail -22
  el
fi
