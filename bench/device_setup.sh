# Sourced by a session's calls.sh on the GPU machine, with DEV set to its carried build folder (.deviceNN):
# sets OUT and `el` (a line stamped with the seconds since the start), prints the GPU, installs the carried
# diffusers wheel (.whl) for the peer scripts, unpacks DEV's xz'd binaries into /tmp, and puts offload_bench
# and the peer script where bench/seed_table.sh looks for them.
set -u
export PATH=/opt/torch/.venv/bin:$PATH
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
for b in vidgen vidgen-lib-tests offload_bench; do
  [ -f $DEV/$b.xz ] && xz -dc $DEV/$b.xz > /tmp/$b && chmod +x /tmp/$b
done
mkdir -p .device && cp /tmp/offload_bench .device/offload_bench && cp $DEV/seed_table_bench.py .device/
export VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench
