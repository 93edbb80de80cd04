# Session 39, call 3: the fp8 quantizer multiplying by each row's reciprocal scale and converting
# pairs: its CUDA tests and the Linear bench; the synthetic Wan2.1 14B, bf16 against --fp8-matmul
# resident; then CogVideoX-5b's whole video beside diffusers, with issue 34's text-stage columns.
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
for x in vidgen vidgen-lib-tests linear_bench; do xz -dc .device/$x.xz > $B/$x; chmod +x $B/$x; done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
el "lib tests"
$B/vidgen-lib-tests --test-threads=1 fp8_kernels models::fp8:: 2>&1 | grep -E "^test |panicked|result:|assert" | tee $OUT/tests.txt
el "linear bench"
timeout 100 $B/linear_bench 2>&1 | tee $OUT/linear.md
el "14B forwards"
TABLE=.device/wan2.1-configs.json OUT=$OUT/w14 ROWS="bf16-resident fp8mm-resident" timeout 200 bash bench/weights_14b.sh $B/vidgen
el "cogvideox-5b whole video"
OUT=$OUT/e2e MODES=default timeout 240 bash bench/family_e2e.sh cogvideox-5b 2>&1 | tail -12
el done
