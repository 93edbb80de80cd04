# Session 38, call 3: after the staging fix (a swapped original-layout tensor made on the host in the staged dtype):
# the offload and weights CUDA tests with their fixtures, then call 1's GPU-vs-CPU table again.
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
xz -dc .device/vidgen.xz > $B/vidgen; chmod +x $B/vidgen
xz -dc .device/vidgen-lib-tests.xz > $B/lib; chmod +x $B/lib
mkdir -p tests/fixtures && xz -dc .device/fx.tar.xz | tar -xf - -C tests/fixtures
xz -dc .device/fx2.tar.xz | tar -xf - -C tests/fixtures
[ "$PWD" = /work/main ] || { mkdir -p /work/main/tests && ln -sfn $PWD/tests/fixtures /work/main/tests/fixtures; }
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
el "CUDA tests: offload, weights, lora"
$B/lib --test-threads=1 offload:: weights:: lora:: 2>&1 | grep -E "FAILED|panicked|result:"
el "GPU vs CPU"
python3 bench/results/session38/gpu_vs_cpu.py $B/vidgen tests/fixtures $OUT/runs 2>&1 | tee $OUT/gpu-vs-cpu.txt
rm -rf $OUT/runs
el done
