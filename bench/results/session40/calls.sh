# The device calls planned in session 40 (2026-12-05), which was lent no device: run them when one is
# lent, one H200, from the repository root:
#   bash bench/results/session40/calls.sh N
# Carried: .whl (diffusers 0.42.1's wheel) and, for call 1, DEV=.device-call1 (HEAD's and the patch's
# vae_decode, the patch's library CUDA tests), for calls 2-5 .device (vidgen, linear_bench,
# wan2.1-configs.json). Session 40 built both folders from d7e97d2's src (stripped, xz'd; rebuild them if
# src changed since), e.g. run(carry: [".device-call1", ".whl"], command: "DEV=.device-call1 bash
# bench/results/session40/calls.sh 1").
# 1: session 39's untested store patch (bench/results/session39/untested-store-column-pairs.patch): its
#    CUDA test, then the causal-conv decodes of HEAD and of the patch in one call, CogVideoX-5b beside
#    diffusers, with the kernel profile.
# 2: the Linear bench with the GPU's SM clock and power sampled beside it (is the block loop's 2.85 ms over
#    the per-shape sum the clock dropping under a longer sustained load?), then the streamed LoRA load
#    again (issue 35: +11% against +10% in session 27), a warm-up run first, bf16 and LoRA rows interleaved.
# 3-5: issue 34's whole videos and text stages (family_e2e.sh), the families not yet in the table.
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B/patched
DEV=${DEV:-.device}
for x in vidgen vidgen-lib-tests linear_bench vae_decode; do
  [ -f $DEV/$x.xz ] && xz -dc $DEV/$x.xz > $B/$x && chmod +x $B/$x
  [ -f $DEV/patched/$x.xz ] && xz -dc $DEV/patched/$x.xz > $B/patched/$x && chmod +x $B/patched/$x
done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
decodes() { # VAE_DECODE binary, output folder
  FAMILIES="cogvideox-5b ltx-video mochi-1" SMALL=1 UNFUSED=0 PEERS="cogvideox-5b" NCU=1 \
    NCU_FAMILIES=cogvideox-5b VAE_DECODE=$1 OUT=$2 timeout 250 bash bench/vae_family.sh 2>&1 | tail -40
}
case $1 in
  1) el "patched store: CUDA test"
     $B/patched/vidgen-lib-tests --test-threads=1 channel_ops 2>&1 | grep -E "^test |panicked|result:" | tee $OUT/tests.txt
     el "decodes, HEAD"; decodes $B/vae_decode $OUT/head
     el "decodes, patched"; decodes $B/patched/vae_decode $OUT/patched;;
  2) el "linear bench with clocks"
     nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 100 > $OUT/clocks.csv &
     SMI=$!; timeout 150 $B/linear_bench 2>&1 | tee $OUT/linear.md; kill $SMI
     el "streamed LoRA load"
     TABLE=.device/wan2.1-configs.json OUT=$OUT/w14 ROWS="bf16-stream bf16-lora-stream" WARM=1 REPEAT=2 \
       timeout 400 bash bench/weights_14b.sh $B/vidgen;;
  3) OUT=$OUT/e2e MODES=default timeout 560 bash bench/family_e2e.sh wan2.1-t2v-1.3b ltx-video latte-1 2>&1 | tail -20;;
  4) OUT=$OUT/e2e MODES=default timeout 560 bash bench/family_e2e.sh mochi-1 flux.1-dev 2>&1 | tail -20;;
  5) OUT=$OUT/e2e MODES=default timeout 560 bash bench/family_e2e.sh hunyuanvideo 2>&1 | tail -20;;
esac
el done
