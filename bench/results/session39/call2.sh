# Session 39, call 2: the channels-last moves a block per output line (the tile loop inside, the
# line's place found once, the upsampling a shift) and the fp8 quantizer a warp per held bf16 row:
# their CUDA tests, the Linear bench, the causal-conv decodes beside diffusers' CogVideoX-5b decode
# with a per-kernel profile.
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
for x in vidgen-lib-tests linear_bench; do xz -dc .device/$x.xz > $B/$x; chmod +x $B/$x; done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
el "lib tests"
$B/vidgen-lib-tests --test-threads=1 channel_ops conv3d::cuda_tests fp8_kernels models::fp8:: 2>&1 | grep -E "^test |panicked|result:|assert" | tee $OUT/tests.txt
el "linear bench"
timeout 150 $B/linear_bench 2>&1 | tee $OUT/linear.md
el "vae family"
FAMILIES="cogvideox-5b ltx-video mochi-1" SMALL=0 UNFUSED=0 PEERS="cogvideox-5b" NCU=1 NCU_FAMILIES=cogvideox-5b OUT=$OUT/vae timeout 200 bash bench/vae_family.sh 2>&1 | tail -40
el done
