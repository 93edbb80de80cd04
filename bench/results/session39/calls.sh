# Session 39's device calls (one H200), each run from the repository root carrying .device (the
# stripped, xz'd CUDA builds named below) and .whl (diffusers 0.42.1's wheel):
#   bash bench/results/session39/calls.sh N
# 1: the channels-last moves issuing all their loads first (64-channel tiles, channel pairs), the fp8
#    quantizer holding rows in a block's registers, q/k/v sharing one quantization: CUDA tests, the
#    Linear bench, the causal-conv decodes beside diffusers' CogVideoX-5b decode, a kernel profile.
# 2: the moves a block per output line, the quantizer a warp per held bf16 row: the same.
# 3: the quantizer multiplying by each row's reciprocal scale, converting pairs: its CUDA tests, the
#    Linear bench, the synthetic Wan2.1 14B bf16 against --fp8-matmul resident, and CogVideoX-5b's
#    whole video beside diffusers with issue 34's text-stage columns.
# 4: whole videos and text stages of Wan2.1 1.3B, LTX-Video and Latte-1 beside diffusers (not run:
#    every later request was refused, "no device machine could be started").
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
for x in vidgen vidgen-lib-tests linear_bench; do
  [ -f .device/$x.xz ] && xz -dc .device/$x.xz > $B/$x && chmod +x $B/$x
done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
tests() { el "lib tests"; $B/vidgen-lib-tests --test-threads=1 "$@" 2>&1 | grep -E "^test |panicked|result:|assert" | tee $OUT/tests.txt; }
linear() { el "linear bench"; timeout 150 $B/linear_bench 2>&1 | tee $OUT/linear.md; }
decodes() { # SMALL (1: the fused-vs-candle small decodes too)
  el "vae family"
  FAMILIES="cogvideox-5b ltx-video mochi-1" SMALL=$1 UNFUSED=0 PEERS="cogvideox-5b" NCU=1 NCU_FAMILIES=cogvideox-5b \
    OUT=$OUT/vae timeout 380 bash bench/vae_family.sh 2>&1 | tail -60
}
case $1 in
  1) tests channel_ops conv3d::cuda_tests fp8_kernels models::fp8:: wan::transformer::cuda_tests; linear; decodes 1;;
  2) tests channel_ops conv3d::cuda_tests fp8_kernels models::fp8::; linear; decodes 0;;
  3) tests fp8_kernels models::fp8::; linear
     el "14B forwards"
     TABLE=.device/wan2.1-configs.json OUT=$OUT/w14 ROWS="bf16-resident fp8mm-resident" timeout 200 bash bench/weights_14b.sh $B/vidgen
     el "cogvideox-5b whole video"
     OUT=$OUT/e2e MODES=default timeout 240 bash bench/family_e2e.sh cogvideox-5b 2>&1 | tail -12;;
  4) OUT=$OUT/e2e MODES=default timeout 560 bash bench/family_e2e.sh wan2.1-t2v-1.3b ltx-video latte-1 2>&1 | tail -20;;
esac
el done
